"""Desync analysis: which rank of a hung collective is behind, missing or waiting.

The work is done by the SQL views ``collective_progress`` and ``desync``
(the SQL module ``forensics/sql/desync.sql``); this module reads them for Python callers and puts
the result in words::

    from forensics.desync import desync, suspects, describe
    df = desync(con)                 # one row per (process group, expected rank)
    print(describe(con))             # "pg 0 (default_pg, 2 ranks): ... rank 1 missing ..."
"""
from __future__ import annotations

import os

import duckdb
import polars as pl

from .database import connect

Connection = duckdb.DuckDBPyConnection

COLUMNS = (
    "pg", "pg_desc", "world_size", "rank", "status", "source", "last_enqueued", "last_started",
    "last_completed", "stuck_seq", "stuck_op", "wait_seq", "wait_op", "reason",
)
SUSPECT = ("missing", "behind")


def _connect(con: Connection | str | os.PathLike) -> tuple[Connection, bool]:
    if isinstance(con, (str, os.PathLike)):
        return connect(str(con), read_only=True), True
    return con, False


def desync(con: Connection | str | os.PathLike) -> pl.DataFrame:
    """The ``desync`` view, ordered by process group and rank.

    ``con`` is an open DuckDB connection to a forensics database (or its path)."""
    con, own = _connect(con)
    try:
        return con.sql(f"SELECT {', '.join(COLUMNS)} FROM desync ORDER BY pg, rank").pl()
    finally:
        if own:
            con.close()


def suspects(con: Connection | str | os.PathLike) -> pl.DataFrame:
    """Ranks that are ``missing`` (no dump, no timeout line) or ``behind``."""
    return desync(con).filter(pl.col("status").is_in(SUSPECT))


def describe(con: Connection | str | os.PathLike) -> str:
    """One paragraph per process group: the collective the group waits in and who is
    missing, behind or stuck elsewhere."""
    df = desync(con)
    if df.is_empty():
        return "no collective progress evidence (no Flight Recorder dump, watchdog line or NCCL COLL line)"
    out = []
    for (pg,), group in df.group_by(["pg"], maintain_order=True):
        first = group.row(0, named=True)
        desc = f" ({first['pg_desc']})" if first["pg_desc"] else ""
        head = f"process group {pg}{desc}, {first['world_size']} ranks"
        if first["wait_seq"] is not None:
            op = f" {first['wait_op']}" if first["wait_op"] else ""
            head += f": ranks wait in collective #{first['wait_seq']}{op}"
        parts = [head]
        for status in ("missing", "behind", "waiting_elsewhere"):
            ranks = group.filter(pl.col("status") == status).get_column("rank").to_list()
            if ranks:
                parts.append(f"{status}: {_ranks(ranks)}")
        for status in ("waiting", "ok"):
            n = group.filter(pl.col("status") == status).height
            if n:
                parts.append(f"{n} rank(s) {status}")
        out.append("; ".join(parts))
    return "\n".join(out)


def _ranks(ranks: list[int]) -> str:
    return "rank " + str(ranks[0]) if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)
