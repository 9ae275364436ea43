"""verl training metrics: console lines and JSON Lines files.

* Console (``trainer.logger=console``, verl/utils/logger/aggregate_logger.py):
  ``step:12 - actor/entropy:0.61 - actor/pg_loss:-0.01 - ...``. Values come either
  formatted (``0.610000``) or as reprs (``0.6099812``, ``nan``, ``inf``,
  ``np.float64(0.61)``, ``np.int64(3)``, ``True``).
* JSON Lines: ``{"step": N, "data": {...}}`` (verl's file logger) or flat rows
  ``{"step": N, "actor/pg_loss": ...}`` / wandb exports with ``_step``. Python's json
  writes ``NaN`` / ``Infinity`` literals, which strict JSON parsers refuse.
* The Hugging Face Trainer's console log (TRL's GRPO/PPO/DPO trainers, ms-swift): each
  logging step prints the ``logs`` dict, ``{'loss': 0.0, 'grad_norm': nan, ...,
  'epoch': 0.31}`` (Python's repr: single quotes, bare ``nan`` / ``inf``); it always holds
  ``epoch``. It prints no step: the records are numbered in the order of the file (or
  by their ``step`` / ``global_step`` entry where there is one).
"""
from __future__ import annotations

import json
import math

import orjson
import polars as pl
import pyarrow as pa

from ..base import FILE_ID, LINE_NO, FileContext, Format, LineFormat, Sniff, Table, col

# How a metric's value is usually printed: as Python's repr of a float, which is what
# DuckDB writes for a DOUBLE too (`0.25`, `1e-05`, `12.0`, `nan`, `inf`; 93% of the
# corpus' metric values). Where the printed text is exactly this, the store does not
# keep it twice (parsers.base.Column); `12` printed for 12.0 is kept.
VALUE_AS_TEXT = 'CAST("value" AS VARCHAR)'

METRICS = Table(
    "metrics",
    "One row per (step, metric) reported by the run: verl console/JSONL metrics and "
    "engine statistics (vLLM periodic stats, KV-cache capacity).",
    (
        FILE_ID,
        LINE_NO,
        col("ts", pa.timestamp("us"), "When the value was logged, if known."),
        col("step", pa.int64(), "Training step (null for engine statistics that are not per step)."),
        col("key", pa.string(), "Metric name as logged (`actor/grad_norm`, `timing_s/gen`, `vllm/gen_throughput`)."),
        col("value", pa.float64(), "Numeric value (NaN and +/-Inf kept); null when the value is not numeric."),
        col("value_text", pa.string(), "The value as printed (usually the number as DuckDB and Python print a float).",
            default=VALUE_AS_TEXT),
        col("source", pa.string(), "`console`, `jsonl`, `vllm`, `sglang`."),
        col("rank", pa.int32(), "Rank that logged it, when known."),
        col("pid", pa.int64(), "Process that logged it, when known."),
        col("actor", pa.string(), "Ray actor / process role that logged it, when known."),
    ),
)

STEP_LINE_START = r"^step:\d+ - "  # how a verl console step line starts
_STEP_LINE = r"^step:(\d+) - "
_NUMERIC_WRAPPER = r"^(?:np\.|numpy\.)?(?:float|int|uint|bool_)\d*\((.*)\)$|^tensor\((.*?)(?:, .*)?\)$"


def numeric_value(text: pl.Expr) -> pl.Expr:
    """Parse a printed metric value into a float (NaN/Inf kept, reprs unwrapped)."""
    inner = text.str.strip_chars()
    unwrapped = pl.coalesce(inner.str.extract(_NUMERIC_WRAPPER, 1), inner.str.extract(_NUMERIC_WRAPPER, 2), inner)
    lowered = unwrapped.str.to_lowercase().replace({"true": "1", "false": "0", "infinity": "inf", "-infinity": "-inf"})
    return lowered.cast(pl.Float64, strict=False)


def annotate(df: pl.DataFrame, ctx: FileContext) -> tuple[pl.DataFrame, dict]:
    msg = df.get_column("message")
    hit = msg.str.contains(_STEP_LINE)
    if not hit.any():
        return df, {}
    sub = df.filter(hit).select("file_id", "line_no", "ts", "rank", "pid", "actor", "message")
    pairs = (
        sub.with_columns(pl.col("message").str.extract(_STEP_LINE, 1).cast(pl.Int64).alias("step"))
        .with_columns(pl.col("message").str.strip_chars_end().str.split(" - ").alias("kv"))
        .explode("kv")
        # key:value splits at the last ':' (values never hold one; a few keys do)
        .with_columns((pl.col("kv").str.len_chars() - 1 - pl.col("kv").str.reverse().str.find(":", literal=True)).alias("_c"))
        .with_columns(
            pl.col("kv").str.slice(0, pl.col("_c")).alias("key"),
            pl.col("kv").str.slice(pl.col("_c") + 1).alias("value_text"),
        )
        .drop("_c")
        .filter(pl.col("key").is_not_null() & (pl.col("key") != "step"))
        .with_columns(pl.lit("console").alias("source"))
        .drop("message", "kv")
    )
    return df, {"metrics": pairs.with_columns(numeric_values(pairs.get_column("value_text")).alias("value"))}


# the Trainer's logs dict at the end of a line (alone, or behind a progress bar the `\r`
# of tqdm joined to it): it starts with a quoted key, ends with `}` and holds the
# `'epoch': <number>` entry the Trainer adds to every record
_TRAINER_LOG = r"(?:^|[\r\s])\{'[^']+': .*'epoch': [-+0-9.eE]+\s*(?:,.*)?\}\s*$"
_TRAINER_PAIR = r"'([^']+)': ('[^']*'|[^,{}]+)"


def annotate_trainer_log(df: pl.DataFrame, ctx: FileContext) -> tuple[pl.DataFrame, dict]:
    msg = df.get_column("message")
    if not msg.str.contains("{'", literal=True).any():
        return df, {}
    hit = msg.str.contains(_TRAINER_LOG)
    if not hit.any():
        return df, {}
    sub = df.filter(hit).select("file_id", "line_no", "ts", "rank", "pid", "actor", "message")
    # the records of each file in order: the step (a chunk continues the count of the one before)
    counts = ctx.state.setdefault("trainer_log_records", {})
    order = []
    for file_id in sub.get_column("file_id").to_list():
        counts[file_id] = counts.get(file_id, 0) + 1
        order.append(counts[file_id])
    pairs = (
        sub.with_columns(pl.Series("_n", order, dtype=pl.Int64))
        .with_columns(pl.col("message").str.extract_all(_TRAINER_PAIR).alias("kv"))
        .explode("kv")
        .with_columns(
            pl.col("kv").str.extract(_TRAINER_PAIR, 1).alias("key"),
            pl.col("kv").str.extract(_TRAINER_PAIR, 2).str.strip_chars().str.strip_chars("'").alias("value_text"),
        )
        .filter(pl.col("key").is_not_null())
    )
    own = (pairs.filter(pl.col("key").is_in(["step", "global_step"]))
           .select("file_id", "line_no", pl.col("value_text").cast(pl.Int64, strict=False).alias("_own"))
           .unique(subset=["file_id", "line_no"], keep="first"))
    pairs = (
        pairs.join(own, on=["file_id", "line_no"], how="left")
        .with_columns(pl.coalesce("_own", "_n").alias("step"))
        .filter(~pl.col("key").is_in(["step", "global_step"]))
        .with_columns(pl.lit("console").alias("source"))
        .drop("message", "kv", "_n", "_own")
    )
    return df, {"metrics": pairs.with_columns(numeric_values(pairs.get_column("value_text")).alias("value"))}


def numeric_values(text: pl.Series) -> pl.Series:
    """:func:`numeric_value` of a column, the regexes run only on values that are not
    plain numbers (most are)."""
    value = text.cast(pl.Float64, strict=False)
    idx = pl.select(pl.arg_where(value.is_null() & text.is_not_null())).to_series()
    if idx.is_empty():
        return value
    slow = pl.select(numeric_value(pl.lit(text.gather(idx)))).to_series()
    return value.scatter(idx, slow)


def _json_loads(text: str):
    """One JSON record; Python's ``NaN`` / ``Infinity`` literals accepted (orjson refuses
    them: such records take the slower standard parser)."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text, parse_constant=lambda c: {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[c])


_PLAIN_NUMBERS = {float, int}


def metric_rows(obj: dict, file_id: int, line_no: int, out: dict[str, list] | None = None) -> dict[str, list]:
    """Columns of the ``metrics`` rows for one JSONL record (either layout), appended to
    ``out`` (column name -> list) when given."""
    if out is None:
        out = {k: [] for k in ("file_id", "line_no", "step", "key", "value", "value_text", "source")}
    step = obj.get("step", obj.get("_step", obj.get("global_step")))
    step = step if isinstance(step, int) and not isinstance(step, bool) else None
    data = obj.get("data") if isinstance(obj.get("data"), dict) else obj
    keys = [k for k in data if not (data is obj and k in ("step", "_step", "global_step"))]
    raw = [data[k] for k in keys]
    values, texts = out["value"], out["value_text"]
    if set(map(type, raw)) <= _PLAIN_NUMBERS:  # the usual record: C-level maps, no loop
        values.extend(map(float, raw))
        texts.extend(map(repr, raw))
    else:
        for value in raw:
            if isinstance(value, (bool, int, float)):
                values.append(float(value))
                texts.append(repr(value))
            else:
                values.append(None)
                texts.append(value if isinstance(value, str) else json.dumps(value))
    n = len(keys)
    out["file_id"].extend([file_id] * n)
    out["line_no"].extend([line_no] * n)
    out["step"].extend([step] * n)
    out["key"].extend(map(str, keys))
    out["source"].extend(["jsonl"] * n)
    return out


def annotate_jsonl(df: pl.DataFrame, ctx) -> tuple[pl.DataFrame, dict]:
    """Lines of metrics JSONL files (format ``metrics_jsonl``): each JSON record's line
    gets header ``json`` and its values become ``metrics`` rows; a line that is not
    JSON is reported (the first 20 per file, then a count) and kept as text."""
    is_jsonl = pl.col("_fmt") == "metrics_jsonl"
    if not df.select(is_jsonl.any()).item():
        return df, {}
    cols = metric_rows({}, 0, 0)  # empty columns
    ok: list[tuple[int, int]] = []
    for file_id, line_no, text in df.filter(is_jsonl).select("file_id", "line_no", "text").iter_rows():
        body = text.strip()
        if not body:
            continue
        try:
            obj = _json_loads(body)
        except (ValueError, KeyError) as exc:
            bad = ctx.state.get(("jsonl_bad", file_id), 0) + 1
            ctx.state[("jsonl_bad", file_id)] = bad
            if bad <= 20:
                ctx.problem(file_id, f"line {line_no}: not a JSON record ({exc})", line_no, "warning")
            elif bad == 21:
                ctx.problem(file_id, "more lines are not JSON records (only the first 20 are listed)", line_no, "warning")
            continue
        ok.append((file_id, line_no))
        if isinstance(obj, dict):
            metric_rows(obj, file_id, line_no, cols)
    if ok:
        claimed = pl.DataFrame(ok, schema={"file_id": pl.Int32, "line_no": pl.Int64}, orient="row").with_columns(pl.lit(True).alias("_json"))
        df = df.join(claimed, on=["file_id", "line_no"], how="left", maintain_order="left").with_columns(
            pl.when(pl.col("_json")).then(pl.lit("json")).otherwise(pl.col("header")).alias("header")
        ).drop("_json")
    if not cols["key"]:
        return df, {}
    schema = METRICS.polars_schema
    return df, {"metrics": pl.DataFrame(cols, schema={k: schema[k] for k in cols})}


def _first_line(data: bytes) -> bytes:
    nl = data.find(b"\n")
    return data[:nl] if nl >= 0 else data


def _metric_record(h) -> bool:
    """The first line is one JSON object with a step: a metrics file, whatever its name."""
    first = _first_line(h.stripped)
    return (h.stripped[:1] == b"{" and first.rstrip().endswith(b"}")
            and (b'"step"' in first or b'"_step"' in first or b'"global_step"' in first))


FORMATS = (
    LineFormat("verl_metrics", 90, annotate, tables=(METRICS,)),  # after the headers: the step line is their message
    LineFormat("trainer_log_metrics", 91, annotate_trainer_log, tables=(METRICS,)),  # the Trainer's logs dict, after the headers
    LineFormat("verl_metrics_jsonl", 100, annotate_jsonl, tables=(METRICS,)),
    Format("metrics_jsonl", "text", sniff=(
        Sniff(700, _metric_record),
        # a JSON object that is no trace, named as JSON Lines (the content did not decide)
        Sniff(650, lambda h: h.stripped[:1] == b"{" and h.name.endswith((".jsonl", ".ndjson"))),
    )),
)
