"""PyTorch's C++ (c10 / glog-style) log lines, where ProcessGroupNCCL speaks.

Header styles by torch era:

* >= 2.4: ``[E1130 00:33:22.797275109 ProcessGroupNCCL.cpp:616] msg`` (level letter,
  month without leading zero + 2-digit day, nanoseconds; no year), usually behind a
  ``[rankN]:`` prefix that :mod:`parsers.torchrun` strips;
* 2.2/2.3: ``[E ProcessGroupNCCL.cpp:563] msg`` behind ``[rankN]:``;
* <= 2.1: ``[E ProcessGroupNCCL.cpp:475] msg``;
* python logging of torch.distributed.elastic: ``W0314 10:02:11.123000 140234 torch/distributed/run.py:793] msg``.
"""
from __future__ import annotations

import polars as pl

from .base import FileContext
from .text import YEARLESS, apply_header, coalesce_into, g, normalise_level

GLOG_BRACKET = r"^(?P<h>\[(?P<level>[IWEF])(?P<md>\d{3,4}) (?P<time>\d{2}:\d{2}:\d{2}\.\d+)(?: (?P<pid>\d+))? (?P<logger>[\w./<>-]+:\d+)\] ?)"
GLOG_BRACKET_NOTIME = r"^(?P<h>\[(?P<level>[IWEF]) (?P<logger>[\w./<>-]+:\d+)\] ?)"
GLOG = r"^(?P<h>(?P<level>[IWEF])(?P<md>\d{4}) (?P<time>\d{2}:\d{2}:\d{2}\.\d+) +(?P<pid>\d+) (?P<logger>[\w./<>-]+:\d+)\] ?)"


def glog_ts(md: pl.Expr, time: pl.Expr) -> pl.Expr:
    """glog prints ``<month><dd>`` (month may lack its leading zero) and no year."""
    month = md.str.slice(0, md.str.len_chars() - 2).str.zfill(2)
    day = md.str.slice(-2, 2)
    frac = time.str.slice(0, 15)  # HH:MM:SS.micro (drop nanoseconds)
    return pl.concat_str([pl.lit(f"{YEARLESS}-"), month, pl.lit("-"), day, pl.lit(" "), frac]).str.to_datetime(
        "%Y-%m-%d %H:%M:%S%.f", strict=False, time_unit="us"
    )


def annotate(df: pl.DataFrame, ctx: FileContext) -> tuple[pl.DataFrame, dict]:
    msg = df.get_column("message")
    if msg.str.contains(r"^\[[IWEF]", literal=False).any():
        df = apply_header(df, GLOG_BRACKET, "glog", {
            "ts": glog_ts(g("md"), g("time")),
            "ts_quality": pl.lit("no_year"),
            "level": normalise_level(g("level")),
            "logger": g("logger"),
            "pid": coalesce_into("pid", g("pid").cast(pl.Int64)),
        })
        df = apply_header(df, GLOG_BRACKET_NOTIME, "glog", {
            "level": normalise_level(g("level")),
            "logger": g("logger"),
        })
    if df.get_column("message").str.contains(r"^[IWEF]\d{4} ").any():
        df = apply_header(df, GLOG, "glog", {
            "ts": glog_ts(g("md"), g("time")),
            "ts_quality": pl.lit("no_year"),
            "level": normalise_level(g("level")),
            "logger": g("logger"),
            "pid": coalesce_into("pid", g("pid").cast(pl.Int64)),
        })
    return df, {}
