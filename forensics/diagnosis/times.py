"""When a failure happened: the one time estimate of an event (or of one line) that the
diagnosis orders events by, prints beside its evidence, writes into ``--json`` and the
notes, and that the HTML report draws (it reads the evidence's ``ts``/``ts_hi``).

A line with a stamp of its own happened then. A line without one (a traceback's frames, a
``.err`` file's exception) inherited the previous stamp of its file at ingest: it happened
at or after that stamp, and before the next stamped line of the file, when there is one.
An event seen in several files is the intersection: the latest of those lower bounds, the
earliest of the upper bounds (the earliest printed stamp when any line has one).

Stamps printed without a year carry the placeholder year of the parsers when the run had
no full stamp to take the year from; they are never shown with it: the year of the file's
modification time is taken instead (a log is written before it is last modified), and
said, or, without one, the year is left out and said unknown.
"""
from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Iterable

import duckdb

from ..parsers.conventions import YEARLESS
from .model import FILE_MTIME, PRECISE, PRINTED, UNKNOWN, Evidence, Hit, When, _placeholder, of_hits

__all__ = ["When", "of_hits", "attach_ts_hi", "with_year", "evidence"]

def attach_ts_hi(con: duckdb.DuckDBPyConnection, hits: list[Hit], keyed_rows) -> None:
    """Each unstamped hit's upper bound: the next stamped line of its file."""
    need = [(h.file_id, h.line_no) for h in hits if h.ts_quality not in PRECISE and h.line_no is not None]
    if not need:
        return
    rows = keyed_rows("_diag_need", need, "line_no",
                      """SELECT n.file_id, n.line_no, s.ts FROM _diag_need n ASOF LEFT JOIN
                         (SELECT file_id, line_no, ts FROM lines WHERE ts_quality IN ('full', 'year_inferred', 'no_year')) s
                         ON n.file_id = s.file_id AND s.line_no >= n.line_no""")
    nxt = {(a, b): c for a, b, c in rows}
    for h in hits:
        if h.ts_quality not in PRECISE:
            h.ts_hi = nxt.get((h.file_id, h.line_no))


def with_year(con: duckdb.DuckDBPyConnection, when: When, hits: Iterable[Hit]) -> When:
    """``when`` without the placeholder year: the year of the file's modification time (the
    year before, when the date would fall after it), else the year left out."""
    hits = [h for h in hits if _placeholder(h) or (h.ts_hi is not None and h.ts_hi.year == YEARLESS)]
    if not hits or (when.lo is not None and when.lo.year != YEARLESS and (when.hi is None or when.hi.year != YEARLESS)):
        return when
    row = con.execute("SELECT mtime FROM files WHERE file_id = ?", [hits[0].file_id]).fetchone()
    mtime = row[0] if row else None
    if mtime is None:
        return replace(when, year=UNKNOWN)

    def shift(t: datetime | None) -> datetime | None:
        if t is None or t.year != YEARLESS:
            return t
        for year in (mtime.year, mtime.year - 1):
            try:
                moved = t.replace(year=year)
            except ValueError:  # 29 February in a year without one
                continue
            if moved <= mtime or year != mtime.year:
                return moved
        return None

    lo, hi = shift(when.lo), shift(when.hi)
    if (when.lo is not None and lo is None) or (when.hi is not None and hi is None):
        return replace(when, year=UNKNOWN)
    return replace(when, lo=lo, hi=hi, year=FILE_MTIME)


def evidence(con: duckdb.DuckDBPyConnection, h: Hit, when: When | None = None) -> Evidence:
    """The evidence of one line, its time the estimate ``when`` (default: the line's own)."""
    when = with_year(con, when or of_hits([h]), [h])
    e = h.evidence()
    e.ts = when.iso(when.lo) if when.lo is not None else None
    e.ts_hi = None if when.stamped else when.iso(when.hi)
    e.when = when.text()
    e.year = None if when.year == PRINTED else when.year
    return e
