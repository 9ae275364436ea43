"""vLLM / SGLang engine lines: statistics and capacity into metrics, sleep/wake and
failures into engine_events."""
from __future__ import annotations

import io
from pathlib import Path

import polars as pl
import pytest

from forensics.parsers.base import FileContext
from forensics.parsers import text
from forensics.parsers.lines import vllm

from .conftest import FIXTURES

ENGINE_LOG = FIXTURES / "vllm" / "engine.log"
DRIVER_LOG = FIXTURES / "vllm" / "driver.log"


def parse(path: Path) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """(lines, engine metrics, engine_events) of one text file."""
    data = path.read_bytes()
    ctx = FileContext(file_id=1, path=path.name, size=len(data), fmt="text")
    frames: dict[str, list[pl.DataFrame]] = {}
    for name, frame in text.parse_text(io.BytesIO(data), ctx):
        frames.setdefault(name, []).append(frame)
    metrics = pl.concat(frames.get("metrics", []), how="diagonal_relaxed") if "metrics" in frames else pl.DataFrame(
        schema={"key": pl.String, "source": pl.String, "value": pl.Float64})
    events = pl.concat(frames["engine_events"]) if "engine_events" in frames else vllm.ENGINE_EVENTS.empty()
    return pl.concat(frames["lines"]), metrics.filter(pl.col("source").is_in(["vllm", "sglang"])), events


def values(metrics: pl.DataFrame, key: str) -> list:
    return metrics.filter(pl.col("key") == key).sort("line_no")["value"].to_list()


def test_statistics_lines():
    lines, m, _ = parse(ENGINE_LOG)
    # V0: one line with swapped/pending, the prefix-cache line alone and appended
    assert values(m, "vllm/prompt_throughput") == [0.0, 10.5, 1605.4]
    assert values(m, "vllm/gen_throughput") == [50.4, 50.4, 1006.9]
    assert values(m, "vllm/running") == [1, 3, 32] and values(m, "vllm/waiting") == [16]
    assert values(m, "vllm/swapped") == [0, 0] and values(m, "vllm/pending") == [0, 2]
    assert values(m, "vllm/gpu_kv_cache_usage") == [0.3, 1.3, 10.9]
    assert values(m, "vllm/cpu_kv_cache_usage") == [0.0, 0.0]  # the first ends with "0.0%."
    assert values(m, "vllm/gpu_prefix_cache_hit_rate") == [12.5, 25.0]
    assert values(m, "vllm/prefix_cache_hit_rate") == [0.0]
    first = m.filter(pl.col("key") == "vllm/gen_throughput").sort("line_no").row(0, named=True)
    assert first["value_text"] == "50.4 tokens/s" and first["line_no"] == 1 and first["step"] is None
    # the V1 line of an engine-core process keeps the process prefix's pid / actor
    v1 = m.filter((pl.col("key") == "vllm/running") & (pl.col("value") == 32)).row(0, named=True)
    assert (v1["pid"], v1["actor"]) == (123, "EngineCore_0")
    # SGLang prefill and decode batches (with DP tags and a non-numeric "cuda graph")
    assert values(m, "sglang/new_token") == [7] and values(m, "sglang/gen_throughput") == [5.31]
    assert values(m, "sglang/running_req") == [0, 1] and values(m, "sglang/token_usage") == [0.0, 0.0]
    assert "sglang/cuda_graph" not in set(m["key"])
    assert set(m["source"]) == {"vllm", "sglang"}
    assert lines.filter(pl.col("header") == "sglang").height == 5


def test_capacity_sleep_wake_and_failures():
    _, m, ev = parse(ENGINE_LOG)
    kinds = ev.sort("line_no").select("line_no", "engine", "kind", "seconds").rows()
    assert kinds == [
        (5, "vllm", "kv_capacity", None),
        (6, "vllm", "wake", 0.523841),
        (7, "vllm", "wake", 0.1),
        (8, "vllm", "sleep", 2.000001),
        (9, "vllm", "wake", 1.5),
        (12, "sglang", "kv_capacity", None),
        (13, "sglang", "kv_capacity", None),
        (14, "sglang", "engine_error", None),
        (15, "vllm", "engine_dead", None),
    ]
    wake = ev.filter(pl.col("line_no") == 6).row(0, named=True)
    assert wake["detail"] == "['weights']" and (wake["pid"], wake["node"], wake["actor"]) == (5, "10.0.0.2", "WorkerDict")
    assert wake["ts"] is not None and wake["ts"].second == 2
    assert values(m, "vllm/kv_cache_memory_gib") == [60.51]
    assert values(m, "sglang/kv_cache_tokens") == [565678] and values(m, "sglang/k_size_gb") == [3.02]
    assert values(m, "sglang/max_running_requests") == [2049] and values(m, "sglang/context_len") == [32768]


def test_driver_prefixed_lines_and_look_alikes():
    _, m, ev = parse(DRIVER_LOG)
    assert ev.sort("line_no")["kind"].to_list() == ["sleep", "sleep_memory", "kv_capacity", "kv_capacity", "engine_dead", "engine_error"]
    assert ev.filter(pl.col("kind") == "sleep")["seconds"].to_list() == [1.021354]
    assert values(m, "vllm/sleep_freed_gib") == [58.21] and values(m, "vllm/sleep_in_use_gib") == [9.73]
    assert values(m, "vllm/gpu_blocks") == [41132] and values(m, "vllm/cpu_blocks") == [6150]
    kv = m.filter(pl.col("key") == "vllm/kv_cache_tokens").row(0, named=True)
    assert kv["value"] == 262144 and kv["value_text"] == "262,144 tokens (CPU)"
    assert values(m, "vllm/max_concurrency") == [64.0]
    # Ray's "The actor died unexpectedly" and a metric line that mentions a stats label are not engine lines
    assert ev.filter(pl.col("line_no") >= 7).height == 0 and m.filter(pl.col("line_no") >= 7).height == 0


def test_lines_without_engine_text_yield_nothing():
    frame = pl.DataFrame({"message": ["plain text", "INFO all good"]})
    assert not frame["message"].str.contains_any(vllm._ANCHORS).any()


# -- the corpus -----------------------------------------------------------------------

def test_real_vllm_logs(corpus):
    _, m, ev = parse(corpus / "real" / "vllm-healthy" / "vllm_serve.log")
    assert len(values(m, "vllm/prompt_throughput")) >= 5
    assert len(values(m, "vllm/cpu_kv_cache_usage")) == len(values(m, "vllm/prompt_throughput"))
    assert values(m, "vllm/kv_cache_tokens") and values(m, "vllm/max_concurrency")
    assert "kv_capacity" in set(ev["kind"])
    _, _, ev = parse(corpus / "real" / "vllm-engine-core-killed" / "vllm_serve.log")
    assert {"engine_dead"} <= set(ev["kind"])
    _, _, ev = parse(corpus / "real" / "vllm-kv-cache-too-small" / "console.log")
    errors = ev.filter(pl.col("kind") == "engine_error")["detail"].to_list()
    assert any("EngineCore failed to start" in d for d in errors)
    assert any("larger than the available KV cache memory" in d for d in errors)


@pytest.mark.parametrize("case, kinds, keys", [
    ("oom-gen-vllm-wakeup-cumem", {"sleep", "sleep_memory", "engine_error", "kv_capacity"}, {"vllm/sleep_freed_gib", "vllm/kv_cache_tokens"}),
    ("rank-hang-multiturn-tool-sandbox", {"kv_capacity"}, {"sglang/running_req", "sglang/gen_throughput", "sglang/kv_cache_tokens"}),
    ("oom-train-critic-gae-old-torch", {"kv_capacity"}, {"vllm/gpu_blocks", "vllm/cpu_blocks"}),
])
def test_corpus_cases(corpus, case, kinds, keys):
    folder = corpus / "cases" / case
    found_kinds, found_keys = set(), set()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "label.json"):
        _, m, ev = parse(path)
        found_kinds |= set(ev["kind"])
        found_keys |= set(m["key"])
    assert kinds <= found_kinds and keys <= found_keys
