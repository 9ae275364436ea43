"""Kernel logs: ``dmesg``, ``dmesg -T``, ``/var/log/kern.log`` / syslog, ``journalctl -k``.

* ``[12345.678901] msg`` (seconds since boot; no wall clock)
* ``[Sat Jul 12 19:19:21 2025] msg`` (dmesg -T)
* ``Jul 12 19:19:21 <host> kernel: [12345.678901] msg`` (syslog, no year; ``7月 12 19:19:21``
  under a Chinese / Japanese / Korean locale)
* ``2025-07-12T19:19:21.123456+00:00 <host> kernel: msg`` (journalctl -o short-iso / rsyslog ISO)
"""
from __future__ import annotations

import re

import polars as pl

from ..base import FileContext, Format, LineFormat, Sniff
from .common import YEARLESS, apply_header, g, parse_ts

_MON = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"
DMESG_T = rf"^(?P<h>\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (?P<mon>{_MON}) +(?P<day>\d{{1,2}}) (?P<time>\d{{2}}:\d{{2}}:\d{{2}}) (?P<year>\d{{4}})\] ?)"
DMESG = r"^(?P<h>\[ *(?P<up>\d+\.\d+)\] ?)"
# journalctl / syslog under a Chinese, Japanese or Korean locale print the month as a number
# (`6月 10 16:45:05 host bash[107468]: ...`)
SYSLOG = rf"^(?P<h>(?:(?P<mon>{_MON})|(?P<mnum>\d{{1,2}})[月월]) +(?P<day>\d{{1,2}}) (?P<time>\d{{2}}:\d{{2}}:\d{{2}}) (?P<host>[\w.\-]+) (?P<proc>kernel|[\w.\-/]+(?:\[\d+\])?): (?:\[ *\d+\.\d+\] )?)"
JOURNAL_ISO = r"^(?P<h>(?P<ts>\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?)(?:Z|[+-]\d{2}:?\d{2})? (?P<host>[\w.\-]+) (?P<proc>kernel|[\w.\-/]+(?:\[\d+\])?): (?:\[ *\d+\.\d+\] )?)"

_MONTHS = {m: f"{i + 1:02d}" for i, m in enumerate(_MON.split("|"))}


def _mdy(mon: pl.Expr, day: pl.Expr, time: pl.Expr, year: pl.Expr, mnum: pl.Expr | None = None) -> pl.Expr:
    month = mon.replace_strict(_MONTHS, default=None)
    if mnum is not None:
        month = pl.coalesce(month, mnum.str.zfill(2))
    return pl.concat_str([year, pl.lit("-"), month, pl.lit("-"), day.str.zfill(2), pl.lit(" "), time]).str.to_datetime(
        "%Y-%m-%d %H:%M:%S", strict=False, time_unit="us"
    )


def annotate(df: pl.DataFrame, ctx: FileContext) -> tuple[pl.DataFrame, dict]:
    msg = df.get_column("message")
    if msg.str.starts_with("[").any():
        df = apply_header(df, DMESG_T, "kernel", {
            "ts": _mdy(g("mon"), g("day"), g("time"), g("year")),
            "ts_quality": pl.lit("full"),
            "logger": pl.lit("kernel"),
        }, prefilter=pl.col("message").str.starts_with("["))
        df = apply_header(df, DMESG, "kernel", {"logger": pl.lit("kernel")}, prefilter=pl.col("message").str.starts_with("["))
    if msg.str.contains(r"^(?:[A-Z][a-z]{2}|\d{1,2}[月월]) +\d").any():
        df = apply_header(df, SYSLOG, "kernel", {
            "ts": _mdy(g("mon"), g("day"), g("time"), pl.lit(str(YEARLESS)), g("mnum")),
            "ts_quality": pl.lit("no_year"),
            "node": pl.coalesce(pl.col("node"), g("host")),
            "logger": g("proc"),
        })
    if msg.str.contains(r"^\d{4}-\d{2}-\d{2}T").any():
        df = apply_header(df, JOURNAL_ISO, "kernel", {
            "ts": parse_ts(g("ts")),
            "ts_quality": pl.lit("full"),
            "node": pl.coalesce(pl.col("node"), g("host")),
            "logger": g("proc"),
        })
    return df, {}


# A dmesg (-T) or syslog kernel line.
KERNEL_LINE = re.compile(rb"\n(?:\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) \w{3} +\d+ [\d:]+ \d{4}\]|\[ *\d+\.\d+\]"
                         rb"|(?:\w{3}|\d{1,2}(?:" + "月|월".encode() + rb")) +\d+ [\d:]+ \S+ kernel:)")

FORMATS = (
    LineFormat("kernel", 70, annotate),
    Format("kernel", "text", sniff=Sniff(290, lambda h: h.count(KERNEL_LINE) > h.lines * 0.5), own_output=True),
)
