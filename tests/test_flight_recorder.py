"""Flight Recorder dumps: plain-data loading, refusal of anything else, truncation."""
from __future__ import annotations

import io
import os
import pickle

import polars as pl
import pytest

from forensics.parsers.base import FileContext
from forensics.parsers.flight_recorder import parse_dump, rank_from_name, salvage

from .test_nccl import _count, _db, ingest


def entry(record_id: int, seq: int, state: str, op: str = "nccl:all_reduce", pg=("0", "default_pg")) -> dict:
    done = state == "completed"
    return {
        "frames": [
            {"name": "all_reduce", "filename": "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", "line": 2501},
            {"name": "train_step", "filename": "/home/me/train.py", "line": 88},
        ],
        "record_id": record_id, "pg_id": 0, "process_group": pg,
        "thread_name": "pt_autograd_0", "thread_id": "140000000000001",
        "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
        "profiling_name": op, "time_created_ns": 1_700_000_000_000_000_000 + record_id * 1_000_000,
        "input_sizes": [[1024]], "input_dtypes": ["Float"], "output_sizes": [[1024]], "output_dtypes": ["Float"],
        "state": state, "time_discovered_started_ns": None,
        "time_discovered_completed_ns": 1_700_000_000_500_000_000 + record_id if done else None,
        "retired": done, "timeout_ms": 600000, "is_p2p": False,
    }


def dump(last_completed: int, n: int, ranks: str = "[0, 1]") -> dict:
    return {
        "version": "2.10",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": ranks}},
        "comm_lib_version": "2.21.5",
        "pg_status": {"0": {"last_enqueued_collective": n, "last_started_collective": -1, "last_completed_collective": last_completed}},
        "entries": [entry(i, i + 1, "completed" if i + 1 <= last_completed else "scheduled") for i in range(n)],
    }


def load(data: bytes, path: str = "dumps/nccl_trace_rank_1", rank: int | None = None) -> tuple[dict[str, pl.DataFrame], FileContext]:
    ctx = FileContext(file_id=7, path=path, size=len(data), fmt="flight_recorder", rank=rank)
    out = {name: frame for name, frame in parse_dump(io.BytesIO(data), ctx)}
    return out, ctx


def test_plain_dump():
    t, ctx = load(pickle.dumps(dump(11, 13)))
    assert not ctx.problems and not ctx.truncated
    d = t["fr_dumps"].row(0, named=True)
    assert (d["rank"], d["status"], d["version"], d["comm_lib_version"], d["n_entries"]) == (1, "ok", "2.10", "2.21.5", 13)
    assert '"default_pg"' in d["pg_config"] and '"last_completed_collective": 11' in d["pg_status"]
    g = t["fr_groups"].row(0, named=True)
    assert (g["pg_id"], g["pg_name"], g["pg_desc"], g["ranks"], g["size"]) == (0, "0", "default_pg", [0, 1], 2)
    assert (g["last_enqueued"], g["last_started"], g["last_completed"]) == (13, -1, 11)
    e = t["fr_entries"].sort("record_id")
    assert e.height == 13
    stuck = e.filter(pl.col("state") != "completed").row(0, named=True)
    assert (stuck["collective_seq_id"], stuck["op"], stuck["retired"], stuck["time_discovered_completed"]) == (12, "nccl:all_reduce", False, None)
    first = e.row(0, named=True)
    assert first["input_sizes"] == "[[1024]]" and first["input_dtypes"] == '["Float"]'
    assert str(first["time_created"]) == "2023-11-14 22:13:20"
    assert first["user_frame"] == "train_step (/home/me/train.py:88)"
    assert first["frames"].splitlines()[0].startswith("all_reduce (")
    assert (first["pg_name"], first["pg_desc"], first["thread_name"], first["timeout_ms"]) == ("0", "default_pg", "pt_autograd_0", 600000)


def test_rank_comes_from_the_path_or_the_file_name():
    assert rank_from_name("x/nccl_trace_rank_12") == 12
    assert rank_from_name("fr/trace_3.pkl") == 3
    assert rank_from_name("dump") is None
    t, _ = load(pickle.dumps(dump(1, 2)), path="attempt_0/5/nccl_trace_rank_0", rank=5)
    assert t["fr_entries"].get_column("rank").unique().to_list() == [5]
    t, ctx = load(pickle.dumps(dump(1, 2)), path="flightrecorder.dump")
    assert t["fr_dumps"].row(0, named=True)["rank"] is None
    assert any("no rank" in p.message for p in ctx.problems)


class _RunsCommand:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class _WritesFile:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class _PersistentPickler(pickle.Pickler):
    def persistent_id(self, obj):
        return "tensor-storage-0" if isinstance(obj, bytearray) else None


@pytest.mark.parametrize("how", ["os_system", "open_file", "inside_entry", "persistent_id", "protocol_2"])
def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path, how):
    marker = tmp_path / "pwned"
    if how == "os_system":
        data = pickle.dumps(_RunsCommand(f"touch {marker}"))
    elif how == "open_file":
        data = pickle.dumps(_WritesFile(str(marker)))
    elif how == "inside_entry":
        d = dump(1, 2)
        d["entries"][1]["frames"] = [_RunsCommand(f"touch {marker}")]
        data = pickle.dumps(d)
    elif how == "protocol_2":
        data = pickle.dumps({"entries": [_WritesFile(str(marker))]}, protocol=2)
    else:
        buf = io.BytesIO()
        _PersistentPickler(buf).dump({"entries": [bytearray(b"x")]})
        data = buf.getvalue()
    t, ctx = load(data)
    assert not marker.exists()
    assert set(t) == {"fr_dumps"}
    assert t["fr_dumps"].row(0, named=True)["status"] == "refused"
    assert len(ctx.problems) == 1 and ctx.problems[0].kind == "error"
    message = ctx.problems[0].message
    assert "refused" in message
    if how in ("os_system", "inside_entry"):
        assert "system" in message  # names what it asked for: posix.system
    if how == "persistent_id":
        assert "persistent id" in message


def test_the_reference_unpickler_would_have_run_it(tmp_path):
    """The malicious pickle of the test above is real: plain pickle.loads runs it."""
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(_WritesFile(str(marker)))).close()
    assert marker.exists()


@pytest.mark.parametrize("keep", [0.05, 0.3, 0.6, 0.9, 0.999])
def test_truncated_dump_keeps_complete_entries(keep):
    data = pickle.dumps(dump(30, 40))
    cut = data[: int(len(data) * keep)]
    t, ctx = load(cut)
    assert ctx.truncated
    assert t["fr_dumps"].row(0, named=True)["status"] == "truncated"
    truncations = [p for p in ctx.problems if p.kind == "truncated"]
    assert truncations and f"after {len(cut)} bytes" in truncations[0].message
    if "fr_entries" in t:
        e = t["fr_entries"]
        assert e.height < 40
        # entries kept are whole: every field that the writer set is there
        assert e.get_column("collective_seq_id").to_list() == list(range(1, e.height + 1))
        assert e.get_column("is_p2p").null_count() == 0
        assert t["fr_groups"].row(0, named=True)["last_completed"] == 30
    if keep >= 0.3:
        assert "fr_entries" in t


@pytest.mark.parametrize("size", [1, 2, 3, 11])
def test_dump_of_a_few_bytes(size):
    t, ctx = load(pickle.dumps(dump(1, 3))[:size])
    assert t["fr_dumps"].row(0, named=True)["status"] == "truncated"
    assert set(t) == {"fr_dumps"}
    assert ctx.truncated and [p.kind for p in ctx.problems] == ["truncated"]


def test_corrupt_and_unexpected_pickles():
    body = b"}\x94\xfe\xfd garbage."  # a dict, then a byte that is no opcode
    t, ctx = load(b"\x80\x04\x95" + len(body).to_bytes(8, "little") + body)
    assert t["fr_dumps"].row(0, named=True)["status"] == "corrupt"
    assert ctx.problems[0].message.startswith("not a readable pickle")
    t, ctx = load(pickle.dumps([1, 2, 3]))
    assert t["fr_dumps"].row(0, named=True)["status"] == "unexpected"
    assert "top level: list" in ctx.problems[0].message
    d = dump(1, 2)
    d["entries"].append("not a dict")
    t, ctx = load(pickle.dumps(d) + b"trailing")
    assert t["fr_entries"].height == 2
    assert sorted(p.message for p in ctx.problems) == [
        "1 of 3 entries are not dicts: skipped", "8 byte(s) after the end of the pickle ignored",
    ]


def test_shared_reference_bomb_is_bounded():
    layer: list = ["x"]
    for _ in range(40):  # 2**40 leaves when expanded, a few hundred bytes pickled
        layer = [layer, layer]
    d = dump(1, 2)
    d["nccl_comm_state"] = layer
    t, ctx = load(pickle.dumps(d))
    assert t["fr_dumps"].row(0, named=True)["status"] == "corrupt"
    assert "not loaded" in ctx.problems[0].message


def test_salvage_only_knows_container_opcodes():
    obj, open_ids, reason = salvage(pickle.dumps({"a": [1, 2.5, None, True, "s", b"b", (1, 2)]}))
    assert obj == {"a": [1, 2.5, None, True, "s", b"b", (1, 2)]} and not open_ids and reason == "complete"
    obj, _, reason = salvage(pickle.dumps(_RunsCommand("true")))
    assert "STACK_GLOBAL" in reason and not isinstance(obj, dict)  # it stopped at the global, called nothing


def test_older_key_names():
    d = dump(2, 3)
    for e in d["entries"]:
        e["seq_id"] = e.pop("collective_seq_id")
    d["nccl_version"] = d.pop("comm_lib_version")
    d["pg_status"]["0"] = {k: str(v) for k, v in d["pg_status"]["0"].items()}
    t, _ = load(pickle.dumps(d))
    assert t["fr_entries"].get_column("collective_seq_id").to_list() == [1, 2, 3]
    assert t["fr_dumps"].row(0, named=True)["comm_lib_version"] == "2.21.5"
    assert t["fr_groups"].row(0, named=True)["last_enqueued"] == 3


def test_dump_through_the_pipeline(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "nccl_trace_rank_3").write_bytes(pickle.dumps(dump(5, 7, ranks="[0, 1, 2, 3]")))
    (run / "nccl_trace_rank_2").write_bytes(pickle.dumps(_WritesFile(str(tmp_path / "pwned"))))
    con = ingest(run, tmp_path)
    assert not (tmp_path / "pwned").exists()
    files = dict(con.execute("SELECT path, format FROM files").fetchall())
    assert files == {"nccl_trace_rank_3": "flight_recorder", "nccl_trace_rank_2": "flight_recorder"}
    dumps = con.execute("SELECT rank, status, n_entries FROM fr_dumps ORDER BY rank").fetchall()
    assert dumps == [(2, "refused", None), (3, "ok", 7)]
    assert _count(con, "SELECT count(*) FROM fr_entries WHERE rank = 3") == 7
    assert _count(con, "SELECT count(*) FROM problems WHERE message LIKE 'refused%'") == 1
    assert con.execute("SELECT size, ranks FROM fr_groups").fetchall() == [(4, [0, 1, 2, 3])]


# -- corpus ------------------------------------------------------------------------------

def test_corpus_real_dump(ingested_corpus, corpus):
    con = _db(ingested_corpus, corpus, "real/oom-train-cascade")
    assert con.execute("SELECT rank, status, version, comm_lib_version, n_entries FROM fr_dumps").fetchall() == [
        (0, "ok", "2.10", "2.28.9", 53)
    ]
    assert _count(con, "SELECT count(*) FROM problems p JOIN files f USING (file_id) WHERE f.format = 'flight_recorder'") == 0
    stuck = con.execute(
        "SELECT collective_seq_id, op, state, input_sizes FROM fr_entries WHERE state <> 'completed' ORDER BY collective_seq_id LIMIT 1"
    ).fetchall()
    assert stuck == [(40, "nccl:all_reduce", "scheduled", "[[32768000]]")]
    # the watchdog of the same rank timed out on that very collective
    watchdog = con.execute("SELECT seq, op_type, numel_in FROM pg_events WHERE kind = 'watchdog_timeout' AND rank = 0").fetchall()
    assert watchdog == [(40, "ALLREDUCE", 32768000)]
    group = con.execute("SELECT pg_desc, ranks, last_enqueued, last_completed FROM fr_groups").fetchall()
    assert group == [("default_pg", [0, 1], 53, 39)]
    years = con.execute("SELECT DISTINCT year(time_created) FROM fr_entries").fetchall()
    assert years == [(2026,)]


def test_corpus_real_dump_truncated_anywhere(corpus):
    data = (corpus / "real" / "oom-train-cascade" / "nccl_trace_rank_0").read_bytes()
    kept = []
    for cut in range(0, len(data), 97):
        t, ctx = load(data[:cut], path="nccl_trace_rank_0")
        assert ctx.truncated and t["fr_dumps"].row(0, named=True)["status"] == "truncated"
        kept.append(t["fr_entries"].height if "fr_entries" in t else 0)
    assert kept == sorted(kept) and kept[-1] >= 50
