"""Prefixes that container tools put in front of every line they copy.

* ``docker compose logs`` / ``docker compose up``: ``<service>-<n>  | message`` (Compose
  v2; v1 wrote ``<service>_<n>``), the name padded to the widest service;
* ``kubectl logs --prefix``: ``[pod/<pod>/<container>] message``.

The prefix names the container the line came from; it is kept in ``node`` (where no
host is known) and stripped, so that the headers and tracebacks behind it are read as
if the process had written them. A line of some other file may start the same way by
chance (a table row, a path), so a prefix is stripped only in a file where it begins
most lines (of the chunk read): a container tool prefixes every line it copies.
"""
from __future__ import annotations

import polars as pl

from ..base import LineFormat
from .common import apply_header, coalesce_into, g

_COMPOSE = r"^(?P<h>(?P<svc>[A-Za-z0-9][\w.-]*?[-_]\d+) +\| ?)"
_KUBECTL = r"^(?P<h>\[pod/(?P<pod>[\w.-]+)/(?P<container>[\w.-]+)\] )"


def annotate(df: pl.DataFrame, ctx) -> tuple[pl.DataFrame, dict]:
    msg = pl.col("message")
    written = (msg.str.len_bytes() > 0).sum().over("file_id")
    for pattern, node in ((_COMPOSE, g("svc")), (_KUBECTL, g("pod"))):
        hit = msg.str.contains(pattern)
        if not df.select(hit.any()).item():
            continue
        # the files of the chunk (a batch holds many) whose lines mostly carry the prefix
        mostly = hit.sum().over("file_id") * 2 >= written
        df = apply_header(df, pattern, None, {"node": coalesce_into("node", node)}, only_unset=False,
                          prefilter=mostly)
    return df, {}


FORMATS = (
    LineFormat("containers", 5, annotate),  # first of all: the prefix hides everything behind it
)
