"""ProcessGroupNCCL / DistBackendError lines into `pg_events`, in every torch era."""
from __future__ import annotations

import duckdb
import polars as pl
import pytest

from .conftest import FIXTURES
from .test_nccl import RUN, _count, _db, ingest, parse_file

DIST = FIXTURES / "torch_dist"


def events(name: str, **hints) -> pl.DataFrame:
    return parse_file(DIST / name, **hints)["pg_events"].sort("line_no")


def test_torch24_watchdog_block():
    ev = events("torch24_rank2.log")
    assert ev.get_column("kind").to_list() == [
        "watchdog_timeout", "work_status", "dump_signal", "dump_signal", "dump_signal", "abort", "abort",
        "watchdog_terminated", "heartbeat", "heartbeat", "dist_backend_error", "watchdog_terminated",
    ]
    first = ev.row(0, named=True)
    assert (first["rank"], first["group_rank"], first["seq"], first["op_type"]) == (2, 2, 40, "ALLREDUCE")
    assert (first["numel_in"], first["numel_out"], first["timeout_ms"], first["ran_for_ms"]) == (32768000, 32768000, 30000, 30080)
    # the timeout line names no group: it takes the group of the next line about work 40
    assert (first["pg_id"], first["pg_name"], first["pg_desc"]) == (0, "0", "default_pg")
    status = ev.row(1, named=True)
    assert (status["seq"], status["last_enqueued"], status["last_completed"]) == (40, 53, 39)
    dump = ev.filter(pl.col("detail").str.contains("Received a dump signal")).row(0, named=True)
    assert (dump["last_enqueued"], dump["last_completed"]) == (53, 39)
    assert ev.get_column("rank").to_list()[:-2] == [2] * 10
    # glog stamps have no year: the line's stamp, year left for the run to decide
    assert str(first["ts"]) == "2000-11-30 00:33:22.797275"


def test_torch23_group_from_the_next_line():
    ev = events("torch23_vllm.log")
    assert ev.select("kind", "rank", "pg_id", "seq").rows() == [
        ("watchdog_timeout", 1, 1, 158046), ("work_status", 1, 1, 158046), ("abort", 1, None, None),
        ("watchdog_terminated", 1, 1, 158046),
    ]
    assert ev.get_column("pid").unique().to_list() == [132111]
    assert ev.row(1, named=True)["last_completed"] == 158045
    assert ev.row(0, named=True)["numel_out"] == 0 and ev.row(0, named=True)["op_type"] == "GATHER"


def test_legacy_format_without_rank_prefix():
    ev = events("legacy_rank3.err")
    assert ev.select("kind", "rank", "seq", "op_type", "timeout_ms", "pg_id").rows() == [
        ("watchdog_timeout", 3, 469508, "BROADCAST", 1800000, None),
        ("abort", None, None, None, None, None),
        ("abort", None, None, None, None, None),
        ("watchdog_timeout", 3, 469508, "BROADCAST", 1800000, None),
    ]
    assert ev.row(0, named=True)["numel_in"] is None


def test_the_rank_prefix_wins_over_the_group_rank():
    ev = events("legacy_rank3.err", rank=7)  # e.g. a per-rank file of rank 7
    first = ev.row(0, named=True)
    assert (first["rank"], first["group_rank"]) == (7, 3)


def test_desync_report():
    ev = events("desync_report.log")
    kinds = ev.select("kind", "ranks", "seq").rows()
    assert kinds == [
        ("work_status", None, 12),
        ("desync_lagging", [2, 5], None),
        ("desync_started", [3], 12),
        ("desync_not_joined", [0, 1], 12),
    ]
    # the report lines have no prefix of their own
    assert ev.get_column("rank").to_list() == [0, None, None, None]


def test_python_side_errors():
    ev = events("python_errors.log")
    assert ev.select("kind", "error", "rank").rows() == [
        ("dist_backend_error", "unhandled system error", None),
        ("nccl_error", "ncclSystemError", None),
        ("watchdog_terminated", "remote process exited or there was a network error", 11),
        ("nccl_error", "ncclRemoteError", None),
        ("dist_backend_error", "internal error - please report this issue to the NCCL developers", None),
    ]
    assert ev.filter(pl.col("kind") == "watchdog_terminated").row(0, named=True)["pg_desc"] == "default_pg"


def test_nccl_lines_are_not_pg_events():
    t = parse_file(RUN / "driver.log")
    ev = t["pg_events"]
    assert ev.filter(pl.col("detail").str.contains("NCCL INFO|socketProgress")).height == 0
    assert sorted(set(ev.get_column("rank").to_list())) == [0, 1, 3]


def test_stamps_follow_the_lines_after_ingest(tmp_path):
    (tmp_path / "run").mkdir()
    for name in ("torch24_rank2.log", "torch23_vllm.log"):
        (tmp_path / "run" / name).write_bytes((DIST / name).read_bytes())
    (tmp_path / "run" / "driver.log").write_text("2026-11-30 00:30:00,000\tINFO worker.py:1841 -- Started a local Ray instance.\n")
    con = ingest(tmp_path / "run", tmp_path)
    mismatched = _count(con, "SELECT count(*) FROM pg_events p JOIN lines l USING (file_id, line_no) WHERE p.ts IS DISTINCT FROM l.ts")
    assert mismatched == 0
    years = con.execute("SELECT DISTINCT year(ts) FROM pg_events WHERE ts IS NOT NULL").fetchall()
    assert years == [(2026,)]


# -- corpus ------------------------------------------------------------------------------

WATCHDOG_CASES = (
    "real/oom-train-cascade", "cases/nccl-timeout-allreduce-2node", "cases/nccl-timeout-broadcast-legacy-format",
    "cases/nccl-timeout-vllm-gather-torch23", "cases/oom-gen-vllm-sampler-cascade",
    "cases/oom-train-optimizer-cascade-2node", "cases/rank-hang-multiturn-tool-sandbox", "cases/gpu-hw-ecc-dbe-xid48",
)


@pytest.mark.parametrize("case", WATCHDOG_CASES)
def test_corpus_every_watchdog_timeout_is_an_event(ingested_corpus, corpus, case):
    con = _db(ingested_corpus, corpus, case)
    printed = _count(con, "SELECT count(*) FROM lines WHERE message LIKE '%Watchdog caught collective operation timeout: WorkNCCL(SeqNum=%'")
    assert printed > 0
    parsed = _count(con, "SELECT count(*) FROM pg_events WHERE op_type IS NOT NULL AND seq IS NOT NULL AND timeout_ms IS NOT NULL")
    assert parsed == printed
    # every timeout of a rank is about one work item of one group
    per_rank = con.execute(
        "SELECT rank, count(DISTINCT seq), count(DISTINCT coalesce(pg_name, pg_id::VARCHAR, '?')) FROM pg_events "
        "WHERE kind = 'watchdog_timeout' GROUP BY rank"
    ).fetchall()
    assert per_rank and all(r is not None and s == 1 and g == 1 for r, s, g in per_rank)


def test_corpus_real_watchdog_and_dump_signal(ingested_corpus, corpus):
    con = _db(ingested_corpus, corpus, "real/oom-train-cascade")
    rows = con.execute(
        "SELECT kind, rank, pg_id, pg_desc, seq, op_type, last_enqueued, last_completed, year(ts) FROM pg_events "
        "WHERE kind IN ('watchdog_timeout', 'work_status') ORDER BY line_no"
    ).fetchall()
    assert rows == [
        ("watchdog_timeout", 0, 0, "default_pg", 40, "ALLREDUCE", None, None, 2026),
        ("work_status", 0, 0, "default_pg", 40, None, 53, 39, 2026),
    ]
    assert _count(con, "SELECT count(*) FROM pg_events WHERE kind = 'dump_signal' AND last_enqueued = 53") == 1


def test_corpus_network_error_strings(ingested_corpus, corpus):
    con = _db(ingested_corpus, corpus, "cases/nccl-net-ib-completion-err12")
    errors = {e for (e,) in con.execute("SELECT DISTINCT error FROM pg_events WHERE error IS NOT NULL").fetchall()}
    assert {"remote process exited or there was a network error", "ncclRemoteError"} <= errors
    con = _db(ingested_corpus, corpus, "real/nccl-bad-iface")
    errors = {e for (e,) in con.execute("SELECT DISTINCT error FROM pg_events WHERE kind = 'dist_backend_error'").fetchall()}
    assert errors == {"invalid usage"}


def test_corpus_legacy_ranks_from_the_message(ingested_corpus, corpus):
    con = _db(ingested_corpus, corpus, "cases/nccl-timeout-broadcast-legacy-format")
    ranks = con.execute("SELECT DISTINCT rank FROM pg_events WHERE kind = 'watchdog_timeout' ORDER BY 1").fetchall()
    assert ranks == [(0,), (3,), (5,)]
    assert isinstance(con, duckdb.DuckDBPyConnection)
