"""NCCL debug output (NCCL_DEBUG=INFO/WARN, NCCL_DEBUG_FILE files, or behind Ray prefixes).

Line styles:

* ``<host>:<pid>:<tid> [<cudaDev>] NCCL INFO <msg>``
* ``<host>:<pid>:<tid> [<cudaDev>] <src file>:<line> NCCL WARN <msg>``
* newer NCCL adds a timestamp: ``[YYYY-MM-DD HH:MM:SS] <host>:<pid>:<tid> [<dev>] ...``
* the un-prefixed banner ``NCCL version 2.21.5+cuda12.4``.

``[<cudaDev>]`` is the local CUDA device, not the global rank.
"""
from __future__ import annotations

import polars as pl

from .base import FileContext
from .text import apply_header, g, normalise_level, parse_ts

HEADER = (
    r"^(?P<h>(?:\[(?P<ts>\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:\.\d+)?)\] )?"
    r"(?P<host>[\w.\-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] (?:(?P<src>[\w./-]+:\d+) )?NCCL (?P<level>INFO|WARN|TRACE|ABORT|ERROR)\b ?)"
)


def annotate(df: pl.DataFrame, ctx: FileContext) -> tuple[pl.DataFrame, dict]:
    if not df.get_column("message").str.contains("NCCL", literal=True).any():
        return df, {}
    df = apply_header(df, HEADER, "nccl", {
        "ts": parse_ts(g("ts")),
        "ts_quality": pl.when(g("ts").is_not_null()).then(pl.lit("full")),
        "level": normalise_level(g("level")),
        "logger": g("src"),
        "node": pl.coalesce(pl.col("node"), g("host")),
        "pid": g("pid").cast(pl.Int64),
        "tid": g("tid").cast(pl.Int64),
    })
    return df, {}
