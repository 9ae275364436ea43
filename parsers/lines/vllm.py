"""vLLM and SGLang engine logs: line headers, engine statistics, sleep/wake, engine errors.

Headers:

* vLLM >= 0.8: ``INFO 03-14 10:00:00 [file.py:123] msg``; 0.4-0.7: ``INFO 03-14 10:00:00 file.py:123] msg``
  (no year; the process prefix ``(EngineCore_0 pid=123)`` is handled by :mod:`.ray_driver`).
* SGLang: ``[2025-03-17 10:00:00 TP0] msg``, with data parallelism ``[... DP0 TP0]``.

Messages turned into ``metrics`` rows (``step`` null, ``source`` ``vllm`` / ``sglang``)
and ``engine_events`` rows:

* start-up capacity (``kv_capacity`` events): V1 ``GPU KV cache size: 455,039 tokens``
  (``CPU KV cache size`` on the CPU backend, since 0.11 on one line with
  ``Maximum concurrency for 4,096 tokens per request: 64.00x``),
  ``Available KV cache memory: 60.51 GiB``; V0 ``# GPU blocks: 43872, # CPU blocks: 6475``;
  SGLang ``KV Cache is allocated. #tokens: 565678, K size: 3.0 GB, V size: 3.0 GB`` and
  ``max_total_num_tokens=565678, chunked_prefill_size=8192, ...``.
  Keys: ``vllm/kv_cache_tokens``, ``vllm/max_concurrency``, ``vllm/kv_cache_memory_gib``,
  ``vllm/gpu_blocks``, ``vllm/cpu_blocks``, ``sglang/kv_cache_tokens``, ``sglang/k_size_gb``, ...
* periodic statistics: V1 ``Engine 000: Avg prompt throughput: 1605.4 tokens/s, Avg
  generation throughput: 1006.9 tokens/s, Running: 32 reqs, Waiting: 16 reqs, GPU KV cache
  usage: 10.9%, Prefix cache hit rate: 0.0%`` (``CPU KV cache usage`` on the CPU backend;
  no ``Engine NNN:`` before 0.9); V0 ``... Running: 1 reqs, Swapped: 0 reqs, Pending: 0
  reqs, GPU KV cache usage: 0.3%, CPU KV cache usage: 0.0%`` with optionally ``Prefix cache
  hit rate: GPU: 12.00%, CPU: 0.00%``; SGLang ``Decode batch. #running-req: 3, #token:
  20311, token usage: 0.03, gen throughput (token/s): 88.10, #queue-req: 0`` and ``Prefill
  batch. #new-seq: 1, #new-token: 7, #cached-token: 0, ...``. Keys are the labels in
  snake case: ``vllm/prompt_throughput``, ``vllm/gen_throughput`` (tokens/s),
  ``vllm/running``, ``vllm/waiting`` (requests), ``vllm/gpu_kv_cache_usage``,
  ``vllm/prefix_cache_hit_rate`` (percent, as printed), ``sglang/running_req``,
  ``sglang/token_usage`` (fraction), ``sglang/gen_throughput``, ...
* sleep mode (``sleep`` / ``wake`` events, the phase boundaries of colocated rollout):
  ``It took 1.021354 seconds to fall asleep.``, ``It took 0.52 seconds to wake up tags
  ['weights'].`` (no tags before 0.9), ``Sleep mode freed 58.21 GiB memory, 9.73 GiB memory
  is still in use.`` (``sleep_memory``; ``vllm/sleep_freed_gib``, ``vllm/sleep_in_use_gib``).
* engine failures: ``engine_dead`` (``EngineDeadError``, V0 ``AsyncEngineDeadError``,
  ``engine core exited unexpectedly``) and ``engine_error`` (``EngineCore failed to start``,
  ``Engine core initialization failed``, ``Worker proc VllmWorker-0 died unexpectedly``,
  KV-cache budget errors, SGLang ``Scheduler hit an exception``, ``Received sigquit from a
  child process``, ``Not enough memory ... --mem-fraction-static``, ``Capture cuda graph
  failed``, the sleep-mode ``cumem_allocator`` out of memory).

Every chunk of every text file passes through :func:`annotate`, so one literal
multi-pattern search (Aho-Corasick) picks the few candidate lines before any regex runs.
"""
from __future__ import annotations

import re

import polars as pl
import pyarrow as pa

from ..base import FILE_ID, LINE_NO, Format, LineFormat, Sniff, Table, col
from .common import YEARLESS, apply_header, g, normalise_level, parse_ts
from .verl_metrics import METRICS

ENGINE_EVENTS = Table(
    "engine_events",
    "vLLM / SGLang engine events from their logs: KV-cache capacity at start-up, sleep and "
    "wake-up (the boundaries of weight sync in colocated RL), and engine failures. The "
    "numbers also go to `metrics` (`vllm/...`, `sglang/...` keys).",
    (
        FILE_ID,
        LINE_NO,
        col("ts", pa.timestamp("us"), "When the line was written (the line's `ts`)."),
        col("engine", pa.string(), "`vllm` or `sglang`."),
        col("kind", pa.string(), "`kv_capacity`, `sleep`, `wake`, `sleep_memory`, `engine_dead`, `engine_error`."),
        col("seconds", pa.float64(), "Duration printed by `sleep` (`It took X seconds to fall asleep`) and `wake` lines."),
        col("detail", pa.string(), "The message: what was sized, the wake-up tags, the error text."),
        col("pid", pa.int64(), "Process that wrote the line, when known."),
        col("node", pa.string(), "Host / IP of that process, when known."),
        col("rank", pa.int32(), "Rank of that process, when known."),
        col("actor", pa.string(), "Ray actor / process role (`WorkerDict`, `EngineCore_0`, `APIServer`), when known."),
    ),
)

VLLM = r"^(?P<h>(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<md>\d{2}-\d{2}) (?P<time>\d{2}:\d{2}:\d{2})(?:\.\d+)? \[?(?P<logger>[\w./<>-]+:\d+)\] ?)"
SGLANG = r"^(?P<h>\[(?P<ts>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})(?P<tags>(?: (?:DP|TP|PP|EP)\d+)+)\] ?)"

# Literal fragments of every message handled below: the cheap first pass.
_ANCHORS = [
    "KV cache size:", "Maximum concurrency for", "Available KV cache memory", "# GPU blocks:", "# CPU blocks:",
    "KV Cache is allocated", "max_total_num_tokens=",
    "Avg prompt throughput:", "Prefix cache hit rate: GPU:", "Decode batch", "Prefill batch",
    "to fall asleep", "to wake up", "Sleep mode freed",
    "EngineDeadError", "engine core exited unexpectedly", "EngineCore failed to start",
    "Engine core initialization failed", "died unexpectedly", "No available memory for the cache blocks",
    "larger than the available KV cache memory", "that can be stored in KV cache",
    "Scheduler hit an exception", "Received sigquit from a child process", "--mem-fraction-static",
    "Capture cuda graph failed", "cumem_allocator",
]

_NUM = r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?"
_SLEEP = re.compile(rf"It took (?P<s>{_NUM}) seconds to fall asleep")
_WAKE = re.compile(rf"It took (?P<s>{_NUM}) seconds to wake up(?: tags (?P<tags>.*?))?\.?\s*$")
_FREED = re.compile(rf"Sleep mode freed (?P<freed>{_NUM}) GiB memory, (?P<used>{_NUM}) GiB memory is still in use")
_KV_SIZE = re.compile(rf"(?P<dev>[A-Z]+) KV cache size: (?P<n>{_NUM}) tokens")
_CONCURRENCY = re.compile(rf"Maximum concurrency for (?P<len>{_NUM}) tokens per request: (?P<x>{_NUM})x")
_KV_MEMORY = re.compile(rf"Available KV cache memory: (?P<gib>{_NUM}) GiB")
_BLOCKS = re.compile(rf"# (?P<dev>GPU|CPU) blocks: (?P<n>{_NUM})", re.I)
_SGL_ALLOC = re.compile(rf"KV Cache is allocated\. #tokens: (?P<n>{_NUM})(?:, K size: (?P<k>{_NUM}) GB, V size: (?P<v>{_NUM}) GB)?")
_KEY_EQ = re.compile(rf"(?P<k>[a-z_]+)=(?P<v>{_NUM})(?=[,\s]|$)")
_STATS_V0_PREFIX = re.compile(rf"Prefix cache hit rate: GPU: (?P<gpu>{_NUM})%, CPU: (?P<cpu>{_NUM})%")
# `Label: 12.5 tokens/s` pairs of the periodic statistics lines
_LABEL_NUM = re.compile(rf"(?:^|, |\. )(?P<label>[#A-Za-z][#A-Za-z ()/_-]*?): (?P<v>{_NUM})(?P<unit>%| tokens/s| reqs|x)?(?=,|\.?$|\s)")
_ALIASES = {"generation_throughput": "gen_throughput", "token": "tokens"}

_DEAD = re.compile(r"EngineDeadError|engine core exited unexpectedly")
_ERROR = re.compile(
    r"EngineCore failed to start|Engine core initialization failed|Worker proc \S+ died unexpectedly"
    r"|No available memory for the cache blocks|larger than the available KV cache memory"
    r"|that can be stored in KV cache|Scheduler hit an exception|Received sigquit from a child process"
    r"|Not enough memory\. Please try to increase --mem-fraction-static|Capture cuda graph failed"
    r"|CUDA Error: out of memory at \S*cumem_allocator"
)
_SGLANG_ONLY = re.compile(r"Decode batch|Prefill batch|KV Cache is allocated|max_total_num_tokens=|Scheduler hit an exception"
                          r"|Received sigquit|--mem-fraction-static|Capture cuda graph")


def annotate(df: pl.DataFrame, cctx) -> tuple[pl.DataFrame, dict]:
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
    hit = df.get_column("message").str.contains_any(_ANCHORS)
    if not hit.any():
        return df, {}
    sub = df.filter(hit).select("file_id", "line_no", "ts", "header", "pid", "node", "rank", "actor", "message")
    metrics: list[dict] = []
    events: list[dict] = []
    for row in sub.iter_rows(named=True):
        engine_message(row, metrics, events)
    out = {}
    if metrics:
        out["metrics"] = pl.DataFrame(metrics, schema=_METRIC_SCHEMA)
    if events:
        out["engine_events"] = pl.DataFrame(events, schema=ENGINE_EVENTS.polars_schema)
    return df, out


_METRIC_SCHEMA = {
    "file_id": pl.Int32, "line_no": pl.Int64, "ts": pl.Datetime("us"), "step": pl.Int64, "key": pl.String, "value": pl.Float64,
    "value_text": pl.String, "source": pl.String, "rank": pl.Int32, "pid": pl.Int64, "actor": pl.String,
}


def engine_message(row: dict, metrics: list[dict], events: list[dict]) -> None:
    """Metrics and engine events of one candidate line (``row``: its lines columns)."""
    text = row["message"].strip()
    engine = "sglang" if row["header"] == "sglang" or _SGLANG_ONLY.search(text) else "vllm"
    where = {k: row[k] for k in ("file_id", "line_no", "ts", "rank", "pid", "actor")}

    def metric(key: str, value: str, shown: str | None = None) -> None:
        metrics.append({**where, "step": None, "key": f"{engine}/{key}", "value": _number(value),
                        "value_text": shown if shown is not None else value, "source": engine})

    def event(kind: str, seconds: float | None = None, detail: str | None = None) -> None:
        events.append({**where, "node": row["node"], "engine": engine, "kind": kind, "seconds": seconds,
                       "detail": detail if detail is not None else text})

    if m := _SLEEP.search(text):
        event("sleep", _number(m["s"]))
        return
    if m := _WAKE.search(text):
        event("wake", _number(m["s"]), m["tags"])
        return
    if m := _FREED.search(text):
        metric("sleep_freed_gib", m["freed"])
        metric("sleep_in_use_gib", m["used"])
        event("sleep_memory")
        return
    if _DEAD.search(text):
        event("engine_dead")
        return
    if _ERROR.search(text):
        event("engine_error")
        return
    if any(a in text for a in ("Avg prompt throughput:", "Prefix cache hit rate: GPU:", "Decode batch", "Prefill batch")):
        _stats(text, metric)
        return
    capacity = False
    if m := _KV_SIZE.search(text):
        metric("kv_cache_tokens", m["n"], f"{m['n']} tokens ({m['dev']})")
        capacity = True
    if m := _CONCURRENCY.search(text):
        metric("max_concurrency", m["x"], f"{m['x']}x for {m['len']} tokens per request")
        capacity = True
    if m := _KV_MEMORY.search(text):
        metric("kv_cache_memory_gib", m["gib"])
        capacity = True
    for m in _BLOCKS.finditer(text):
        metric(f"{m['dev'].lower()}_blocks", m["n"])
        capacity = True
    if m := _SGL_ALLOC.search(text):
        metric("kv_cache_tokens", m["n"])
        if m["k"] is not None:
            metric("k_size_gb", m["k"])
            metric("v_size_gb", m["v"])
        capacity = True
    if "max_total_num_tokens=" in text:
        for m in _KEY_EQ.finditer(text):
            metric(m["k"], m["v"])
        capacity = True
    if capacity:
        event("kv_capacity")


def _stats(text: str, metric) -> None:
    """``Label: value unit`` pairs of a vLLM / SGLang periodic statistics line."""
    body = re.sub(r"^Engine \d+: ", "", text)
    if m := _STATS_V0_PREFIX.search(body):  # V0: "Prefix cache hit rate: GPU: x%, CPU: y%"
        metric("gpu_prefix_cache_hit_rate", m["gpu"], m["gpu"] + "%")
        metric("cpu_prefix_cache_hit_rate", m["cpu"], m["cpu"] + "%")
        body = body[: m.start()] + body[m.end():]
    body = re.sub(r"^(?:Decode|Prefill) batch[.,] ", "", body)
    for m in _LABEL_NUM.finditer(body):
        metric(_key(m["label"]), m["v"], m["v"] + (m["unit"] or ""))


def _key(label: str) -> str:
    key = re.sub(r"\([^)]*\)", "", label.lower())
    key = re.sub(r"[^a-z0-9]+", "_", key.replace("#", "")).strip("_")
    key = key.removeprefix("avg_")
    return _ALIASES.get(key, key)


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


# A vLLM header line, bare or behind the engine's process prefix.
VLLM_LINE = re.compile(rb"\n(?:\([\w]+ pid=\d+\) )?(?:INFO|WARNING|ERROR|DEBUG) \d\d-\d\d [\d:]+ \[?[\w.]+\.py:\d+\]")

FORMATS = (
    LineFormat("vllm", 60, annotate, tables=(ENGINE_EVENTS, METRICS)),
    Format("vllm", "text", sniff=Sniff(270, lambda h: h.count(VLLM_LINE) > h.lines * 0.2), own_output=True),
)
