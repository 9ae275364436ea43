"""Generic timestamped headers that no specific format claimed.

Python ``logging`` in its common shapes and other ISO-stamped lines:

* ``2025-03-14 10:02:11,345 INFO verl.trainer.main_ppo:375 - msg``
* ``2025-03-14 10:02:11,345 - name - INFO - msg``
* ``2025-03-14 10:02:11 ERROR 56542 [file.py:64] msg`` (a format with the process id and
  ``[filename:lineno]`` after the level)
* ``[2025-03-14 10:00:00,123] [INFO] [config.py:1003:print] msg`` (DeepSpeed)
* ``2025-03-14T10:02:11.345Z msg``, ``2025-03-14T18:02:11+08:00 msg``, ``[2025-03-14 10:02:11] msg``
* ``(AReaL) 20260415-06:21:44.507 EngineBP ERROR: msg`` (AReaL's logger: ``%Y%m%d-%H:%M:%S``
  and milliseconds, the logger's name, which may be ``[FSDPEngine Rank 0]``; older releases
  without the ``(AReaL)`` tag; ``merged.log`` puts a fixed-width ``[main]`` source before it)
* without a time: ``[INFO:swift] msg`` (ms-swift's and ModelScope's logger format,
  ``[%(levelname)s:%(name)s]``): the level and the logger only

The timestamp (moved to UTC when it carries an offset), the level and the logger name
or ``file:line`` are taken when present; the rest is the message.
"""
from __future__ import annotations

import polars as pl

from ..base import FileContext, LineFormat
from .common import apply_header, g, normalise_level, parse_ts
from .verl_metrics import STEP_LINE_START

_LEVEL = r"DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL"


def _iso(src: bool) -> str:
    """The header pattern; ``src``: with the optional ``file:line -`` after the level."""
    return (
        r"^(?P<h>\[?(?P<ts>\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[,.]\d{1,9})?)(?:Z|(?P<tzs>[+-])(?P<tzh>\d{2}):?(?P<tzm>\d{2}))?\]?"
        rf"(?:[ \t]+(?:-[ \t]+)?(?:(?P<name>[\w.]+)[ \t]+-[ \t]+)?\[?(?P<level>{_LEVEL})\]?(?::|[ \t]+-)?"
        + (r"(?:[ \t]+(?P<src>[\w.]+:\d+)[ \t]+-|[ \t]+(?:\d+[ \t]+)?\[(?P<srcb>[\w.]+:\d+)\])?" if src else "")
        + r")?[ \t]*)"
    )


ISO = _iso(src=True)
# verl's step line (`step:12 - actor/lr:1e-06 - ...`) printed through Python logging has the
# shape of a `file:line -` source location right after the level: there it is the step
# line's start and stays in the message (parsers/lines/verl_metrics.py reads it).
_ISO_BEFORE_STEP_LINE = _iso(src=False) + STEP_LINE_START.removeprefix("^")


def _utc(ts: pl.Expr) -> pl.Expr:
    """A stamp printed with a UTC offset (``+08:00``) moved to UTC; others as printed."""
    minutes = g("tzh").cast(pl.Int64) * 60 + g("tzm").cast(pl.Int64)
    signed = pl.when(g("tzs") == "-").then(-minutes).otherwise(minutes)
    return ts - pl.duration(minutes=signed.fill_null(0))


def annotate(df: pl.DataFrame, ctx: FileContext) -> tuple[pl.DataFrame, dict]:
    if not df.get_column("message").str.contains(r"^\[?\d{4}-\d{2}-\d{2}").any():
        return df, {}
    fields = {"ts": _utc(parse_ts(g("ts"))), "ts_quality": pl.lit("full"), "level": normalise_level(g("level"))}
    stamped = pl.col("message").str.contains(r"^\[?\d{4}-\d{2}-\d{2}")
    df = apply_header(df, _iso(src=False), "pylog", {**fields, "logger": g("name")},
                      prefilter=stamped & pl.col("message").str.contains(_ISO_BEFORE_STEP_LINE))
    df = apply_header(df, ISO, "pylog", {**fields, "logger": pl.coalesce(g("name"), g("src"), g("srcb"))}, prefilter=stamped)
    return df, {}


_BRACKETED = r"^(?P<h>\[(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL):(?P<name>[\w.-]+)\] ?)"


def annotate_bracketed(df: pl.DataFrame, ctx: FileContext) -> tuple[pl.DataFrame, dict]:
    """``[LEVEL:logger] msg`` on the lines no other header claimed."""
    starts = pl.col("message").str.starts_with("[")
    if not df.select(starts.any()).item():
        return df, {}
    df = apply_header(df, _BRACKETED, "pylog", {"level": normalise_level(g("level")), "logger": g("name")}, prefilter=starts)
    return df, {}


# AReaL's logger (areal/utils/logging.py: `(AReaL) %(asctime)s.%(msecs)03d %(name)s %(levelname)s: `
# with the date format `%Y%m%d-%H:%M:%S`). A paste inside a markdown list keeps the list's margin.
_AREAL = (r"^(?P<h>[ \t]*(?:\[\w+\][ \t]+)?(?:\(AReaL\)[ \t]+)?(?P<ts>\d{8}-\d{2}:\d{2}:\d{2}(?:\.\d{1,6})?)[ \t]+"
          rf"(?P<name>\[[^\]]+\]|[^\s\[\]]+)[ \t]+(?P<level>{_LEVEL}):(?:[ \t]|$))")


def annotate_areal(df: pl.DataFrame, ctx: FileContext) -> tuple[pl.DataFrame, dict]:
    """AReaL's ``(AReaL) YYYYMMDD-HH:MM:SS.mmm name LEVEL: msg`` records."""
    stamped = pl.col("message").str.contains(r"^[ \t]*(?:\[\w+\][ \t]+)?(?:\(AReaL\)[ \t]+)?\d{8}-\d{2}:")
    if not df.select(stamped.any()).item():
        return df, {}
    ts = g("ts").str.to_datetime("%Y%m%d-%H:%M:%S%.f", strict=False, time_unit="us")
    df = apply_header(df, _AREAL, "pylog", {"ts": ts, "ts_quality": pl.lit("full"), "level": normalise_level(g("level")),
                                             "logger": g("name").str.strip_chars("[]")}, prefilter=stamped)
    return df, {}


# After the specific formats: a stamp they recognised is theirs (only unclaimed lines are read here).
FORMATS = (LineFormat("headers", 80, annotate), LineFormat("headers_bracketed", 81, annotate_bracketed),
           LineFormat("headers_areal", 82, annotate_areal))
