"""Prefixes that container tools put in front of every line they copy.

* ``docker compose logs`` / ``docker compose up``: ``<service>-<n>  | message`` (Compose
  v2; v1 wrote ``<service>_<n>``), the name padded to the widest service;
* ``kubectl logs --prefix``: ``[pod/<pod>/<container>] message``;
* the CRI log files the kubelet writes (``/var/log/pods/...``, ``/var/log/containers/*.log``,
  what log collectors ship): ``<RFC 3339 time> stdout|stderr P|F message`` (``P`` a partial
  line the runtime split, ``F`` the full or last part). Its time is the node's and goes
  with the message's own header, which keeps the time it printed; the prefix names no
  container, so it only is stripped;
* ``docker logs --timestamps`` (and tools that read a container's raw log stream):
  ``<RFC 3339 time>Z message``, where a reader that did not demultiplex the stream leaves
  the residue of Docker's 8-byte frame header before the time (control bytes and the one
  printable byte of the frame's length: ``B2025-05-23T16:49:12.290114123Z Traceback ...``),
  and a wrapper may tag each line with its service first (``[trainer] ``). Tag and residue
  are stripped (the tag is kept in ``node``); the time is then read as the line's header.

Job platforms that stamp every line they collect in CJK brackets (``【2024-12-13 15:37:21】``)
put the stamp before the process's own prefix (a Ray worker's ``(Actor pid=N)``): it is
taken as the line's time and stripped, so the prefix behind it is read. Platforms that
stamp in square brackets (``[2025-05-10 00:18:21] (WorkerDict pid=1230, ip=...) ...``) are
read the same way where a Ray process prefix follows the stamp; a stamp followed by
anything else is left to the headers (``[2025-05-10 00:18:21] INFO ...`` is a logger's own
header).

Log viewers that draw a box around the log (a terminal UI's pane) leave a frame on every
line they copy: ``│ <message padded to the pane's width> │``. The frame is removed in a
file where most lines carry it.

The prefix names the container the line came from; it is kept in ``node`` (where no
host is known) and stripped, so that the headers and tracebacks behind it are read as
if the process had written them. A line of some other file may start the same way by
chance (a table row, a path), so a prefix is stripped only in a file where it begins
most lines (of the chunk read): a container tool prefixes every line it copies.
"""
from __future__ import annotations

import polars as pl

from ..base import LineFormat
from .common import apply_header, coalesce_into, g, on_most_lines, parse_ts, strip_prefix_of_most_lines

_COMPOSE = r"^(?P<h>(?P<svc>[A-Za-z0-9][\w.-]*?[-_]\d+) +\| ?)"
_KUBECTL = r"^(?P<h>\[pod/(?P<pod>[\w.-]+)/(?P<container>[\w.-]+)\] )"
# a platform's stamp (date, time, an optional fraction) and an RFC 3339 time up to its zone
_STAMP_TIME = r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d{1,9})?"
_RFC3339_TIME = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d{1,9})?"
_STAMPED = r"^(?P<h>【(?P<ts>" + _STAMP_TIME + r")】 ?)"
# the square-bracket stamp (the whole stamp, then the same stamp before a Ray process prefix)
_SQ_STAMP = r"^\[" + _STAMP_TIME + r"\] "
_SQ_STAMPED = (r"^(?P<h>\[(?P<ts>" + _STAMP_TIME + r")\] ?)"
               r"\((?:[A-Za-z_][\w.<>\-]*(?:\([^()\s]*\))? )?(?:rank=\d+ )?pid=\d+[,)]")
_CRI = r"^(?P<h>" + _RFC3339_TIME + r"(?:Z|[+-]\d{2}:\d{2}) (?:stdout|stderr) [PF] )"
# an optional service tag and what is left of a stream frame header (control bytes around
# at most one other character), stripped where the daemon's UTC time follows; the time itself
# is left to the header that reads a line starting with an ISO 8601 time (headers.py)
_DOCKER_TS = r"^(?P<h>(?:\[(?P<svc>[\w.-]+)\] )?[\x00-\x08\x0e-\x1f]*(?:.[\x00-\x08\x0e-\x1f]*)?)" + _RFC3339_TIME + "Z "


# a line drawn inside a box: the left border, the message, its padding, the right border
_FRAMED = r"^│ ?(.*?)\s*│\s*$"


def _unframe(df: pl.DataFrame) -> pl.DataFrame:
    msg = pl.col("message")
    if not df.select(msg.str.starts_with("│").any()).item():  # the cheap test first
        return df
    framed = msg.str.contains(_FRAMED)
    return df.with_columns(pl.when(framed & on_most_lines(framed)).then(msg.str.extract(_FRAMED, 1)).otherwise(msg).alias("message"))


def annotate(df: pl.DataFrame, ctx) -> tuple[pl.DataFrame, dict]:
    df = _unframe(df)
    for pattern, node in ((_COMPOSE, g("svc")), (_KUBECTL, g("pod")), (_CRI, pl.lit(None, pl.String))):
        df = strip_prefix_of_most_lines(df, pattern, {"node": coalesce_into("node", node)})
    # loose (a time and a space): only where at least three lines of the file carry it
    df = strip_prefix_of_most_lines(df, _DOCKER_TS, {"node": coalesce_into("node", g("svc"))}, min_lines=3)
    if df.select(pl.col("message").str.starts_with("【").any()).item():
        df = strip_prefix_of_most_lines(df, _STAMPED, {"ts": parse_ts(g("ts")), "ts_quality": pl.lit("full")})
    if df.select(pl.col("message").str.starts_with("[").any()).item():
        # the platform stamps every line; only those with a Ray process prefix behind the
        # stamp lose it here
        msg = pl.col("message")
        stamped = on_most_lines(msg.str.contains(_SQ_STAMP)) & msg.str.contains(_SQ_STAMPED)
        df = apply_header(df, _SQ_STAMPED, None, {"ts": parse_ts(g("ts")), "ts_quality": pl.lit("full")},
                          only_unset=False, prefilter=stamped)
    return df, {}


FORMATS = (
    LineFormat("containers", 5, annotate),  # first of all: the prefix hides everything behind it
)
