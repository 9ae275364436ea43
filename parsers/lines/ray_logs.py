"""Ray session logs (``/tmp/ray/session_*/logs``) and Ray's own line headers.

* Python logging: ``2025-03-14 10:02:11,345\\tINFO worker.py:1841 -- message``
* C++ logging (raylet, gcs_server, core workers):
  ``[2025-03-14 10:02:11,345 E 4411 4450] (raylet) node_manager.cc:3277: message``
  (the ``(component)`` tag is absent in older Ray and in core-worker files).
* Worker stdout/stderr files ``worker-<worker id>-<job id>-<pid>.out|.err`` begin with
  ``:job_id:01000000`` and then ``:actor_name:WorkerDict`` or ``:task_name:...``;
  Ray repeats the markers when the process is reused for another actor/task.
* ``python-core-worker-<worker id>_<pid>.log``, ``python-core-driver-<id>_<pid>.log``,
  ``raylet.out``, ``gcs_server.out``, ``monitor.log``, ``dashboard*.log``.
"""
from __future__ import annotations

import re

import polars as pl

from ..base import FileContext, Format, LineFormat, Sniff
from .common import apply_header, coalesce_into, g, normalise_level, parse_ts

_TS = r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3}"
PY = rf"^(?P<h>(?P<ts>{_TS})\t(?P<level>[A-Z]+) (?P<logger>[^\s]+:\d+) -- )"
CPP = rf"^(?P<h>\[(?P<ts>{_TS}) (?P<level>[DIWEFC]) (?P<pid>\d+) (?P<tid>\d+)\] (?:\((?P<comp>[\w.-]+)\) )?(?P<logger>[\w./<>-]+:\d+): )"
_MARKER = r"^:(job_id|actor_name|task_name):(.*)$"

_WORKER_FILE = re.compile(r"(?:^|/)worker-(?P<wid>[0-9a-f]{8,})-(?P<job>[0-9a-f]{8})-(?P<pid>\d+)\.(?:out|err)$")
_CORE_FILE = re.compile(r"(?:^|/)python-core-(?:worker|driver)-(?P<wid>[0-9a-f]+)_(?P<pid>\d+)\.log$")
DAEMONS = ("raylet", "gcs_server", "monitor", "log_monitor", "dashboard", "dashboard_agent", "runtime_env_agent")
_DAEMON_FILE = re.compile(rf"(?:^|/)(?P<name>{'|'.join(DAEMONS)})(?:\.\d+)?\.(?:out|err|log)$")
_EVENT_FILE = re.compile(r"(?:^|/)events/event_(?P<name>[A-Z_]+?)(?:_(?P<pid>\d+))?\.log$")


def file_hints(path: str) -> dict:
    """What a Ray session file's name says: its role, pid, worker and job ids."""
    m = _WORKER_FILE.search(path)
    if m:
        return {"format": "ray_worker", "pid": int(m["pid"]), "worker_id": m["wid"], "job_id": m["job"]}
    m = _CORE_FILE.search(path)
    if m:
        return {"format": "ray_core_worker", "pid": int(m["pid"]), "worker_id": m["wid"]}
    m = _EVENT_FILE.search(path)
    if m:
        return {"format": "ray_events", "pid": int(m["pid"]) if m["pid"] else None}
    m = _DAEMON_FILE.search(path)
    if m:
        return {"format": f"ray_{m['name']}", "actor": m["name"]}
    return {}


def annotate(df: pl.DataFrame, ctx: FileContext) -> tuple[pl.DataFrame, dict]:
    df = apply_header(df, PY, "ray_py", {
        "ts": parse_ts(g("ts")),
        "ts_quality": pl.lit("full"),
        "level": normalise_level(g("level")),
        "logger": g("logger"),
    }, prefilter=pl.col("message").str.contains("\t", literal=True))
    df = apply_header(df, CPP, "ray_cpp", {
        "ts": parse_ts(g("ts")),
        "ts_quality": pl.lit("full"),
        "level": normalise_level(g("level")),
        "logger": g("logger"),
        "pid": coalesce_into("pid", g("pid").cast(pl.Int64)),
        "tid": g("tid").cast(pl.Int64),
        "actor": coalesce_into("actor", g("comp")),
    }, prefilter=pl.col("message").str.starts_with("[2"))
    if (df.get_column("_fmt") == "ray_worker").any():
        df = _worker_markers(df, ctx)
    return df, {}


def _worker_markers(df: pl.DataFrame, ctx) -> pl.DataFrame:
    """``:actor_name:X`` / ``:task_name:X`` set the actor of the lines that follow it in
    a worker file (until the next marker; a big file carries it across chunks)."""
    m = df.get_column("message").str.extract_groups(_MARKER)
    kind, value = m.struct.field("1"), m.struct.field("2")
    is_worker = pl.col("_fmt") == "ray_worker"
    carried = {fid: ctx.state.get(("ray_actor", fid)) for fid in ctx.files}
    prev = pl.col("file_id").replace_strict(carried, default=None, return_dtype=pl.String)
    owner = value.zip_with(kind.is_in(["actor_name", "task_name"]).fill_null(False), pl.Series([None] * len(value), dtype=pl.String))
    df = df.with_columns(owner.alias("_owner"), kind.is_not_null().alias("_mk"))
    df = df.with_columns(
        pl.when(is_worker).then(pl.coalesce(pl.col("_owner").forward_fill().over("file_id"), prev)).alias("_owner")
    )
    last = df.filter(is_worker).group_by("file_id").agg(pl.col("_owner").drop_nulls().last())
    for fid, owner in last.iter_rows():
        if owner is not None:
            ctx.state[("ray_actor", fid)] = owner
    return df.with_columns(
        pl.coalesce(pl.col("_owner"), pl.col("actor")).alias("actor"),
        pl.when(pl.col("_mk") & is_worker).then(pl.lit("ray_marker")).otherwise(pl.col("header")).alias("header"),
    ).drop("_owner", "_mk")


def process_hints(path: str) -> dict:
    """What a Ray session file's name says about its process (whatever the file's format)."""
    hints = file_hints(path)
    return {"pid": hints.get("pid"), "actor": hints.get("actor")}


def _named(fmt: str) -> Sniff:
    # Ray's file names are exact: they decide among text logs (below the binary check)
    return Sniff(400, lambda h: h.of(file_hints).get("format") == fmt)


# Every record of a Ray daemon's or core worker's log starts with a header; a worker's
# stdout (anything the user printed) and the event files do not.
_HEADED = ("ray_core_worker", *(f"ray_{d}" for d in DAEMONS))
# one process's own output: a worker's stdout/stderr file, the daemons that own a node
_OWN = ("ray_worker", "ray_raylet", "ray_gcs_server", "ray_monitor")

FORMATS = (
    LineFormat("ray_logs", 30, annotate),
    *(Format(fmt, "text", sniff=_named(fmt), hints=process_hints, headed=fmt in _HEADED, own_output=fmt in _OWN,
             software="ray")
      for fmt in ("ray_worker", "ray_core_worker", "ray_events", *(f"ray_{d}" for d in DAEMONS))),
)
