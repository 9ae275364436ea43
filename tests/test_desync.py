"""Desync analysis: per process group and rank, how far it got and who is behind or missing."""
from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import duckdb
import polars as pl
import pytest

from forensics import parsers
from forensics import detect
from forensics.desync import describe, desync, suspects
from forensics import sql_modules
from forensics.store import all_tables, ddl, insert_sql
from forensics.parsers.base import FileContext

from .test_flight_recorder import dump
from .test_nccl import RUN, _db, ingest


def _run(tmp_path: Path, dumps: dict[int, dict] | None = None, extra: dict[str, str] | None = None) -> Path:
    """The two-node fixture run (4 ranks; ranks 0, 1 time out in work 12, rank 3 in work 11,
    rank 2 prints nothing), plus Flight Recorder dumps and extra files."""
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    for rank, d in (dumps or {}).items():
        (run / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(d))
    for name, text in (extra or {}).items():
        (run / name).write_text(text)
    return run


def quick_db(run: Path) -> duckdb.DuckDBPyConnection:
    """An in-memory database of ``run`` made by the real detection, parsers and NCCL/desync
    views, without the ingest machinery (whose view set makes each database slow to open)."""
    con = duckdb.connect()
    tables = {t.name: t for t in all_tables()}
    for t in tables.values():
        con.execute(ddl(t))
    files = sorted(p for p in run.rglob("*") if p.is_file())
    for file_id, path in enumerate(files, start=1):
        rel = path.relative_to(run).as_posix()
        found = detect.detect(str(path), rel, path.stat().st_size)
        parse = parsers.parser_for(found.format)
        if parse is None:
            continue
        ctx = FileContext(file_id=file_id, path=rel, size=path.stat().st_size, fmt=found.format,
                          node=found.node, pid=found.pid, rank=found.rank, actor=found.actor)
        with open(path, "rb") as stream:
            for name, frame in parse(stream, ctx):
                con.register("_part", tables[name].conform(frame))
                con.execute(insert_sql(tables[name], "_part"))
                con.unregister("_part")
    sql_modules.create(con, sql_modules.needed(["desync"]))
    return con


def _torch_group(con) -> pl.DataFrame:
    return desync(con).filter(pl.col("pg") == "0")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The fixture run as it is: watchdog and NCCL lines, no dumps."""
    return quick_db(_run(tmp_path_factory.mktemp("plain")))


def test_watchdog_lines_alone(plain):
    df = _torch_group(plain)
    assert df.get_column("world_size").unique().to_list() == [4]  # from the communicators' nranks
    assert df.select("rank", "status", "source").rows() == [
        (0, "waiting", "watchdog"), (1, "waiting", "watchdog"), (2, "missing", None), (3, "behind", "watchdog"),
    ]
    row = df.row(0, named=True)
    assert (row["wait_seq"], row["wait_op"], row["last_completed"], row["stuck_seq"]) == (12, "ALLREDUCE", 11, 12)
    assert df.row(3, named=True)["reason"] == "completed collective 10, others reached 11"
    assert df.row(2, named=True)["reason"].startswith("no Flight Recorder dump, no watchdog line")


def test_flight_recorder_dumps_win_over_watchdog_lines(tmp_path):
    d0 = dump(11, 13, ranks="[0, 1, 2, 3]")
    d1 = dump(11, 12, ranks="[0, 1, 2, 3]")
    con = ingest(_run(tmp_path, {0: d0, 1: d1}), tmp_path)
    df = _torch_group(con)
    assert df.select("rank", "status", "source", "last_enqueued", "last_completed", "stuck_seq").rows() == [
        (0, "waiting", "flight_recorder", 13, 11, 12),
        (1, "waiting", "flight_recorder", 12, 11, 12),
        (2, "missing", None, None, None, None),
        (3, "behind", "watchdog", 11, 10, 11),
    ]
    assert df.get_column("wait_op").unique().to_list() == ["nccl:all_reduce"]
    assert suspects(con).filter(pl.col("pg") == "0").select("rank", "status").rows() == [(2, "missing"), (3, "behind")]
    text = describe(str(tmp_path / "run.duckdb"))  # a path works too
    assert "process group 0 (default_pg), 4 ranks: ranks wait in collective #12 nccl:all_reduce" in text
    assert "missing: rank 2" in text and "behind: rank 3" in text and "2 rank(s) waiting" in text


def test_members_come_from_the_dump_group(tmp_path):
    """A group whose members the dump lists: only those ranks are expected."""
    d = dump(4, 6, ranks="[1, 3]")
    for e in d["entries"]:
        e["process_group"] = ("7", "tp_group")
        e["pg_id"] = 2
    d["pg_config"] = {"7": {"name": "7", "desc": "tp_group", "ranks": "[1, 3]"}}
    d["pg_status"] = {"2": d["pg_status"]["0"]}
    con = quick_db(_run(tmp_path, {1: d}))
    tp = desync(con).filter(pl.col("pg") == "7")
    assert tp.select("rank", "status", "world_size", "pg_desc").rows() == [
        (1, "waiting", 2, "tp_group"), (3, "missing", 2, "tp_group"),
    ]
    assert tp.row(0, named=True)["stuck_seq"] == 5


def test_desync_report_names_a_lagging_rank(tmp_path):
    report = (
        "(WorkerDict pid=2002) [rank1]:[E314 10:41:03.000000001 ProcessGroupNCCL.cpp:1106] [PG ID 0 PG GUID 0(default_pg) Rank 1] "
        "Timeout at NCCL work: 12, last enqueued NCCL work: 12, last completed NCCL work: 11.\n"
        "(WorkerDict pid=2002) \t - To our best knowledge, the lagging/dead/mismatched ranks that caused the desync are:\n"
        "(WorkerDict pid=2002) \t   - [0] joined but didn't finish collective #12 (count from 1)\n"
    )
    con = quick_db(_run(tmp_path, extra={"desync.log": report}))
    df = _torch_group(con)
    row = df.filter(pl.col("rank") == 0).row(0, named=True)
    assert (row["status"], row["reason"]) == ("behind", "named as lagging by a desync report")


def test_collective_lines_alone(plain):
    world = desync(plain).filter(pl.col("pg") == "nccl:0xabc123def4560001")
    # rank 2's debug file shows three calls, ranks 0 and 1 one each, rank 3 none
    assert world.select("rank", "status", "last_enqueued").rows() == [
        (0, "behind", 1), (1, "behind", 1), (2, "ok", 3), (3, "missing", None),
    ]
    assert world.get_column("world_size").unique().to_list() == [4]


def test_no_evidence(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("step:1 - actor/pg_loss:0.1\n")
    con = quick_db(run)
    assert desync(con).is_empty()
    assert describe(con).startswith("no collective progress evidence")


# -- corpus ------------------------------------------------------------------------------

def test_corpus_oom_cascade_names_rank_1(ingested_corpus, corpus):
    con = _db(ingested_corpus, corpus, "real/oom-train-cascade")
    df = desync(con)
    assert df.select("pg", "rank", "status", "source").rows() == [
        ("0", 0, "waiting", "flight_recorder"), ("0", 1, "missing", None),
    ]
    row = df.row(0, named=True)
    assert (row["world_size"], row["wait_seq"], row["wait_op"], row["last_completed"], row["last_enqueued"]) == (
        2, 40, "nccl:all_reduce", 39, 53,
    )
    assert suspects(con).get_column("rank").to_list() == [1]


@pytest.mark.parametrize("case, suspect, world", [
    ("cases/rank-hang-multiturn-tool-sandbox", [6], 8),
    ("cases/nccl-timeout-vllm-gather-torch23", [0], 4),
])
def test_corpus_hangs(ingested_corpus, corpus, case, suspect, world):
    con = _db(ingested_corpus, corpus, case)
    df = desync(con)
    assert df.get_column("world_size").unique().to_list() == [world]
    assert suspects(con).get_column("rank").to_list() == suspect
    waiting = df.filter(pl.col("status") == "waiting")
    assert waiting.height == world - len(suspect)
    assert waiting.get_column("stuck_seq").n_unique() == 1


def test_corpus_healthy_run_has_no_suspects(ingested_corpus, corpus):
    con = _db(ingested_corpus, corpus, "real/healthy-torchrun")
    df = desync(con)
    assert df.height == 2 and df.get_column("source").to_list() == ["nccl_coll", "nccl_coll"]
    assert suspects(con).is_empty()
    assert describe(con).endswith("2 ranks; 2 rank(s) ok")
