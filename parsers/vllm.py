"""vLLM and SGLang engine logs.

* vLLM >= 0.8: ``INFO 03-14 10:00:00 [file.py:123] msg``; 0.4-0.7: ``INFO 03-14 10:00:00 file.py:123] msg``
  (no year; the process prefix ``(EngineCore_0 pid=123)`` is handled by :mod:`parsers.ray_driver`).
* SGLang: ``[2025-03-17 10:00:00 TP0] msg``, with data parallelism ``[... DP0 TP0]``.
"""
from __future__ import annotations

import polars as pl

from .base import FileContext
from .text import YEARLESS, apply_header, g, normalise_level, parse_ts

VLLM = r"^(?P<h>(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<md>\d{2}-\d{2}) (?P<time>\d{2}:\d{2}:\d{2})(?:\.\d+)? \[?(?P<logger>[\w./<>-]+:\d+)\] ?)"
SGLANG = r"^(?P<h>\[(?P<ts>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})(?P<tags>(?: (?:DP|TP|PP|EP)\d+)+)\] ?)"


def annotate(df: pl.DataFrame, ctx: FileContext) -> tuple[pl.DataFrame, dict]:
    msg = df.get_column("message")
    if msg.str.contains(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d").any():
        df = apply_header(df, VLLM, "vllm", {
            "ts": pl.concat_str([pl.lit(f"{YEARLESS}-"), g("md"), pl.lit(" "), g("time")]).str.to_datetime(
                "%Y-%m-%d %H:%M:%S", strict=False, time_unit="us"),
            "ts_quality": pl.lit("no_year"),
            "level": normalise_level(g("level")),
            "logger": g("logger"),
        })
    if msg.str.starts_with("[").any():
        df = apply_header(df, SGLANG, "sglang", {
            "ts": parse_ts(g("ts")),
            "ts_quality": pl.lit("full"),
            "logger": g("tags").str.strip_chars(),
        })
    return df, {}
