"""NCCL debug output: header, communicators, topology, env echoes, WARN trails, COLL lines,
and the mapping of processes to ranks."""
from __future__ import annotations

import io
import re
from pathlib import Path

import duckdb
import polars as pl
import pytest

from forensics import pipeline
from forensics.parsers.base import FileContext
from forensics.parsers.text import CHUNK_BYTES, parse_text

from .conftest import FIXTURES

RUN = FIXTURES / "nccl_two_nodes"


def parse_file(path: Path | str, chunk_bytes: int = CHUNK_BYTES, **hints) -> dict[str, pl.DataFrame]:
    """Run the text pipeline over one file; {table: rows}."""
    data = Path(path).read_bytes()
    ctx = FileContext(file_id=1, path=Path(path).name, size=len(data), fmt="text", **hints)
    out: dict[str, list[pl.DataFrame]] = {}
    for name, frame in parse_text(io.BytesIO(data), ctx, chunk_bytes=chunk_bytes):
        out.setdefault(name, []).append(frame)
    assert not [p for p in ctx.problems if p.kind == "error"], ctx.problems
    return {k: pl.concat(v, how="diagonal_relaxed") for k, v in out.items()}


def ingest(folder: Path, tmp_path: Path) -> duckdb.DuckDBPyConnection:
    db = tmp_path / "run.duckdb"
    pipeline.ingest([str(folder)], str(db), workers=1)
    return duckdb.connect(str(db), read_only=True)


@pytest.fixture(scope="module")
def driver() -> dict[str, pl.DataFrame]:
    return parse_file(RUN / "driver.log")


def test_headers_and_banner(driver):
    lines = driver["lines"]
    nccl = lines.filter(pl.col("header") == "nccl")
    banner = nccl.filter(pl.col("message").str.starts_with("NCCL version"))
    assert banner.height == 4  # one per process, un-prefixed behind the Ray prefix
    warn = nccl.filter(pl.col("level") == "WARNING").row(0, named=True)
    assert (warn["node"], warn["pid"], warn["tid"], warn["logger"]) == ("10.0.0.2", 3002, 3170, "misc/socket.cc:49")
    assert str(warn["ts"]) == "2026-03-14 10:40:00"
    assert warn["message"].startswith("socketProgress: Connection closed")


def test_communicators(driver):
    comms = driver["nccl_comms"]
    first = comms.filter((pl.col("pid") == 2001) & (pl.col("comm") == "0x55d0a0")).sort("line_no")
    assert first.get_column("event").to_list() == ["init_start", "info", "init_complete"]
    start = first.row(0, named=True)
    assert start["api"] == "ncclCommInitRank"
    assert (start["rank"], start["nranks"], start["cuda_dev"], start["nvml_dev"], start["bus_id"]) == (0, 4, 0, 0, "18000")
    assert start["comm_id"] == "0xabc123def4560001"
    assert start["host"] == "node-a" and start["dev"] == 0
    info = first.row(1, named=True)
    assert (info["n_nodes"], info["local_ranks"], info["local_rank"]) == (2, 2, 0)
    assert comms.get_column("nccl_version").unique().to_list() == ["2.21.5+cuda12.4"]
    world = comms.filter(pl.col("nranks") == 4).group_by("pid").agg(pl.col("rank").first()).sort("pid")
    assert world.rows() == [(2001, 0), (2002, 1), (3001, 2), (3002, 3)]


def test_line_ranks_come_from_the_largest_communicator(driver):
    lines = driver["lines"].filter(pl.col("header") == "nccl")
    by_pid = lines.filter(pl.col("message").str.contains("opCount|Init COMPLETE")).group_by("pid").agg(
        pl.col("rank").unique()
    ).sort("pid")
    # pid 2002 is rank 0 of a 2-rank group but rank 1 of the 4-rank world
    assert [(p, sorted(r)) for p, r in by_pid.rows()] == [(2001, [0]), (2002, [1]), (3001, [2]), (3002, [3])]
    other = driver["lines"].filter(pl.col("message").str.contains("Started a local Ray instance"))
    assert other.get_column("rank").to_list() == [None]


def test_collectives(driver):
    colls = driver["nccl_colls"].sort("line_no")
    assert colls.get_column("op").to_list() == ["AllReduce", "AllReduce", "Broadcast", "AllGather"]
    first = colls.row(0, named=True)
    assert (first["op_count"], first["count"], first["dtype"], first["redop"], first["nranks"]) == (26, 1024, "float32", "sum", 4)
    assert (first["comm"], first["stream"], first["rank"]) == ("0x55d0a0", "0x55e000", 0)
    # the broadcast of pid 2002 runs on its 2-rank communicator, where it is rank 0
    bcast = colls.filter(pl.col("op") == "Broadcast").row(0, named=True)
    assert (bcast["pid"], bcast["rank"], bcast["dtype"], bcast["op_count"]) == (2002, 0, "bfloat16", 3)
    assert colls.filter(pl.col("op") == "AllReduce").get_column("rank").to_list() == [0, 1]


def test_topology(driver):
    topo = driver["nccl_topology"]
    rings = topo.filter(pl.col("kind") == "ring")
    assert rings.select("channel", "n_channels", "peers").rows() == [(0, 2, "0 1 2 3"), (1, 2, "0 1 2 3")]
    tree = topo.filter(pl.col("kind") == "tree").row(0, named=True)
    assert tree["peers"] == "[0] 1/2/-1->0->-1 [1] 1/-1/-1->0->2"
    transports = topo.filter(pl.col("kind") == "transport").select("channel", "src_rank", "dst_rank", "transport").rows()
    assert transports == [(0, 0, 1, "P2P/IPC/read"), (0, 3, 0, "NET/IB/0/GDRDMA [receive]")]
    boot = topo.filter(pl.col("kind") == "bootstrap").row(0, named=True)
    assert (boot["interface"], boot["address"], boot["rank"]) == ("eth0", "10.0.0.1", 0)
    ib = topo.filter(pl.col("kind") == "net_if").row(0, named=True)
    assert (ib["transport"], ib["interface"], ib["address"]) == ("IB", "mlx5_0:1/IB,mlx5_1:1/IB", "10.0.0.1")
    assert topo.filter(pl.col("kind") == "network").get_column("transport").to_list() == ["IB"]
    assert topo.filter(pl.col("kind") == "channels").get_column("n_channels").to_list() == [2]
    assert topo.filter(pl.col("kind") == "connected").height == 1
    assert topo.filter(pl.col("kind") == "net").get_column("detail").to_list() == ["NET/Plugin: No plugin found (libnccl-net.so)"]


def test_env_echoes(driver):
    env = driver["nccl_env"].select("var", "value", "pid").rows()
    assert env == [("NCCL_SOCKET_IFNAME", "eth0", 2001), ("NCCL_IB_GID_INDEX", "3", 2001)]


def test_warn_with_its_trail(driver):
    errors = driver["nccl_errors"].sort("line_no")
    warn = errors.filter(pl.col("kind") == "warn").row(0, named=True)
    assert warn["src"] == "misc/socket.cc:49"
    assert warn["trail"] == "misc/socket.cc:752 -> 6; transport/net_socket.cc:474 -> 6"
    assert (warn["rc"], warn["rc_name"], warn["rank"]) == (6, "ncclRemoteError", 3)
    trail = errors.filter(pl.col("kind") == "rc")
    assert trail.get_column("first_line").unique().to_list() == [warn["line_no"]]
    assert trail.get_column("thread_tag").to_list() == [None, "Proxy Thread"]


def test_debug_file_without_prefixes():
    t = parse_file(RUN / "nccl_debug" / "node-b.3001.log")
    lines = t["lines"]
    assert lines.filter(pl.col("header") == "nccl").height == lines.height
    assert lines.get_column("rank").unique().to_list() == [2]
    comms = t["nccl_comms"]
    assert comms.get_column("event").to_list() == ["init_start", "abort_complete"]
    assert comms.get_column("nccl_version").to_list() == ["2.21.5+cuda12.4"] * 2
    sock = t["nccl_topology"].filter(pl.col("kind") == "net_if").row(0, named=True)
    assert (sock["transport"], sock["interface"], sock["address"]) == ("Socket", "eth0,eth1", "10.0.0.2")
    shm = t["nccl_topology"].filter(pl.col("kind") == "transport").get_column("transport").to_list()
    assert shm == ["SHM/direct/direct", "NET/Socket/1 [receive]"]
    colls = t["nccl_colls"].sort("line_no")
    assert colls.select("op", "op_count", "redop", "root", "recvbuff", "rank").rows() == [
        ("AllGather", 26, "sum", 0, "0x7f2100000000", 2),
        ("AllReduce", 27, "max", 0, "0x7f2200000000", 2),
        ("Send", 0, "sum", 3, "(nil)", 2),
    ]
    warn = t["nccl_errors"].filter(pl.col("kind") == "warn").row(0, named=True)
    assert warn["message"].startswith("[Proxy Service 2] Failed to execute operation Connect from rank 3")
    assert (warn["trail"], warn["rc"]) == ("proxy.cc:1645 -> 6", 6)


def test_rank_needs_the_init_line_in_the_same_chunk():
    """With tiny chunks the init line and later lines part: the chunk without the init
    line leaves ranks empty (the SQL view fills them from any file)."""
    t = parse_file(RUN / "nccl_debug" / "node-b.3001.log", chunk_bytes=600)
    colls = t["nccl_colls"]
    assert colls.height == 3
    assert colls.get_column("rank").null_count() > 0


def test_lines_without_nccl_are_untouched():
    text = b"plain line\nstep:1 - actor/pg_loss:0.1\nanother NCCL word in prose\n"
    ctx = FileContext(file_id=1, path="x.log", size=len(text), fmt="text")
    out = dict(parse_text(io.BytesIO(text), ctx))
    assert out["lines"].get_column("header").to_list()[0] is None
    assert not any(name.startswith("nccl_") for name in out)


def test_views_map_processes_to_ranks(tmp_path):
    con = ingest(RUN, tmp_path)
    rank_map = con.execute("SELECT host, pid, rank, nranks, communicators FROM nccl_rank_map ORDER BY pid").fetchall()
    assert rank_map == [
        ("node-a", 2001, 0, 4, 1), ("node-a", 2002, 1, 4, 2), ("node-b", 3001, 2, 4, 2), ("node-b", 3002, 3, 4, 1),
    ]
    nodes = con.execute("SELECT nodes FROM nccl_rank_map WHERE pid = 3001").fetchall()[0][0]
    assert sorted(nodes) == ["10.0.0.2", "node-b"]
    calls = con.execute(
        "SELECT rank, comm_id, count(*), max(call_no) FROM nccl_collectives GROUP BY ALL ORDER BY ALL"
    ).fetchall()
    assert calls == [
        (0, "0x5e5e5e5e00000002", 1, 1), (0, "0xabc123def4560001", 1, 1), (1, "0xabc123def4560001", 1, 1),
        (2, "0xabc123def4560001", 4, 3),
    ]


# -- corpus ------------------------------------------------------------------------------

NCCL_CASES = (
    "real/oom-train-cascade", "real/nccl-bad-iface", "real/healthy-torchrun", "real/healthy-ncclfile",
    "cases/nccl-net-docker0-conn-refused", "cases/nccl-net-ib-completion-err12", "cases/nccl-net-no-socket-interface",
    "cases/nccl-timeout-allreduce-2node", "cases/nccl-timeout-broadcast-legacy-format",
    "cases/nccl-timeout-vllm-gather-torch23", "cases/oom-gen-vllm-sampler-cascade",
    "cases/oom-train-optimizer-cascade-2node", "cases/rank-hang-multiturn-tool-sandbox",
)


# NCCL fails before a communicator exists: no init lines
INIT_FAILS = ("real/nccl-bad-iface", "cases/nccl-net-docker0-conn-refused", "cases/nccl-net-no-socket-interface")


def _db(ingested_corpus, corpus, case: str) -> duckdb.DuckDBPyConnection:
    return duckdb.connect(str(ingested_corpus[corpus / case]), read_only=True)


def _count(con, sql: str) -> int:
    return int(con.execute(sql).fetchall()[0][0])


@pytest.mark.parametrize("case", NCCL_CASES)
def test_corpus_every_nccl_line_is_recognised(ingested_corpus, corpus, case):
    con = _db(ingested_corpus, corpus, case)
    shape = r"regexp_matches(text, '[\w.-]+:\d+:\d+ \[\d+\] ([\w./-]+:\d+ )?NCCL (INFO|WARN)')"
    printed = _count(con, f"SELECT count(*) FROM lines WHERE {shape}")
    assert printed > 0
    assert _count(con, f"SELECT count(*) FROM lines WHERE header = 'nccl' AND {shape}") == printed
    warns = _count(con, "SELECT count(*) FROM lines WHERE header = 'nccl' AND level = 'WARNING'")
    assert _count(con, "SELECT count(*) FROM nccl_errors WHERE kind = 'warn'") == warns
    inits = _count(con, "SELECT count(*) FROM lines WHERE header = 'nccl' AND regexp_matches(message, '^nccl\\w+ comm 0x')")
    assert _count(con, "SELECT count(*) FROM nccl_comms WHERE api IS NOT NULL") == inits
    if case not in INIT_FAILS:
        assert inits > 0
        assert _count(con, "SELECT count(*) FROM nccl_rank_map") > 0


@pytest.mark.parametrize("case", ["real/oom-train-cascade", "real/healthy-torchrun", "real/healthy-ncclfile"])
def test_corpus_ranks_agree_with_the_per_rank_files(ingested_corpus, corpus, case):
    """Where a file belongs to one rank (torchrun's attempt_0/<rank>/, worker-rank<N>.out),
    the communicator lines in it name that rank, and the NCCL lines carry it."""
    con = _db(ingested_corpus, corpus, case)
    rows = con.execute(
        "SELECT f.path, c.rank, c.nranks FROM nccl_comms c JOIN files f USING (file_id) WHERE c.event = 'init_start'"
    ).fetchall()
    assert rows
    checked = 0
    for path, rank, nranks in rows:
        m = re.search(r"attempt_\d+/(\d+)/|worker-rank(\d+)\.", path)
        if m:
            assert rank == int(m.group(1) or m.group(2)), path
            checked += 1
        assert nranks == 2
    ranks = con.execute("SELECT pid, rank FROM nccl_rank_map ORDER BY rank").fetchall()
    assert [r for _, r in ranks] == [0, 1]
    # every NCCL line of a mapped process carries its rank
    unranked = _count(con, "SELECT count(*) FROM lines l JOIN nccl_rank_map m USING (pid) WHERE l.header = 'nccl' AND l.rank IS DISTINCT FROM m.rank")
    assert unranked == 0
    if case != "real/healthy-ncclfile":
        assert checked > 0


def test_corpus_collectives_of_healthy_torchrun(ingested_corpus, corpus):
    con = _db(ingested_corpus, corpus, "real/healthy-torchrun")
    per_file = con.execute(
        "SELECT f.path, c.rank, count(*) FROM nccl_colls c JOIN files f USING (file_id) GROUP BY ALL ORDER BY ALL"
    ).fetchall()
    # the console interleaves both ranks (tee'd [default0]:/[default1]:), each rank file holds its own
    rank_files = [(p, r, n) for p, r, n in per_file if "/attempt_" in p]
    assert [(re.search(r"attempt_\d+/(\d+)/", p).group(1), r) for p, r, _ in rank_files] == [("0", 0), ("1", 1)]
    console = {r: n for p, r, n in per_file if p == "console.log"}
    assert console == {r: n for _, r, n in rank_files}
    mismatched = _count(con, "SELECT count(*) FROM nccl_colls c JOIN lines l USING (file_id, line_no) WHERE l.local_rank IS NOT NULL AND l.local_rank <> c.rank")
    assert mismatched == 0
    ops = dict(con.execute("SELECT op, count(*) FROM nccl_colls GROUP BY op").fetchall())
    assert set(ops) == {"AllReduce", "AllGather", "Broadcast"}
    assert con.execute("SELECT DISTINCT dtype FROM nccl_colls ORDER BY 1").fetchall() == [("float32",), ("int32",), ("int64",)]


def test_corpus_bad_interface(ingested_corpus, corpus):
    con = _db(ingested_corpus, corpus, "real/nccl-bad-iface")
    env = con.execute("SELECT DISTINCT var, value FROM nccl_env").fetchall()
    assert env == [("NCCL_SOCKET_IFNAME", "ib_missing0")]
    warn = con.execute(
        "SELECT f.path, e.src, e.message, e.trail, e.rc_name, e.rank FROM nccl_errors e JOIN files f USING (file_id) WHERE e.kind = 'warn' ORDER BY 1"
    ).fetchall()
    assert {w[1:5] for w in warn} == {("bootstrap.cc:114", "Bootstrap : no socket interface found", "init.cc:126 -> 5; init.cc:160 -> 5", "ncclInvalidUsage")}
    by_path = {w[0]: w[5] for w in warn}
    assert by_path["torchrun_logs/none_fomsi6ia/attempt_0/0/stdout.log"] == 0


def test_corpus_chosen_interfaces(ingested_corpus, corpus):
    con = _db(ingested_corpus, corpus, "cases/nccl-net-docker0-conn-refused")
    chosen = con.execute("SELECT DISTINCT kind, interface FROM nccl_topology WHERE kind IN ('bootstrap', 'net_if') ORDER BY 1").fetchall()
    assert chosen == [("bootstrap", "docker0"), ("net_if", "docker0")]
    warn = con.execute("SELECT host, pid, rc_name, trail FROM nccl_errors WHERE kind = 'warn'").fetchall()
    assert len(warn) == 1 and warn[0][:3] == ("ml-h100-15", 65077, "ncclSystemError")
    assert warn[0][3].endswith("group.cc:64 -> 2; group.cc:418 -> 2; init.cc:1929 -> 2")


# (cases/nccl-net-ib-completion-err12 is left out: its authored logs disagree, pid 381093
# is rank 9 in its communicator lines but prints `[rank11]:`)
@pytest.mark.parametrize("case", [
    "cases/gpu-hw-ecc-dbe-xid48", "cases/nccl-timeout-allreduce-2node", "cases/nccl-timeout-vllm-gather-torch23",
    "cases/oom-gen-vllm-sampler-cascade", "cases/oom-train-optimizer-cascade-2node", "cases/rank-hang-multiturn-tool-sandbox",
])
def test_corpus_communicator_ranks_agree_with_rank_prefixes(ingested_corpus, corpus, case):
    """A process that prints `[rankN]:` lines and NCCL communicator lines holds the same
    rank in both: the mapping (host, pid) -> rank is right where it can be checked."""
    con = _db(ingested_corpus, corpus, case)
    pairs = con.execute(
        "SELECT p.pid, p.rank, m.rank FROM (SELECT DISTINCT pid, rank FROM lines WHERE rank IS NOT NULL "
        "AND header IS DISTINCT FROM 'nccl' AND pid IS NOT NULL) p JOIN nccl_rank_map m USING (pid)"
    ).fetchall()
    assert pairs
    assert [(pid, a, b) for pid, a, b in pairs if a != b] == []


def test_collective_line_layouts():
    text = (
        "h:1:1 [0] NCCL INFO ncclCommInitRank comm 0x9 rank 5 nranks 8 cudaDev 0 busId 1000 - Init COMPLETE\n"
        # no [nranks=N]
        "h:1:1 [0] NCCL INFO AllReduce: opCount 5 sendbuff 0x1 recvbuff 0x1 count 8 datatype 7 op 0 root 0 comm 0x9 stream 0x2\n"
        # fields after the stream
        "h:1:1 [0] NCCL INFO ReduceScatter: opCount 6 sendbuff 0x1 recvbuff 0x2 count 4 datatype 9 op 4 root 0 comm 0x9 [nranks=8] stream 0x3 task 0\n"
        # words in other places: read by the regex
        "h:1:1 [0] NCCL INFO Recv: opCount 7 sendbuff (nil) recvbuff 0x4 count 2 datatype 2 op 0 root 3 peer 3 comm 0x9 [nranks=8] stream 0x3\n"
        # not a COLL line although it names the word
        "h:1:1 [0] NCCL INFO opCount tracing enabled\n"
    )
    ctx = FileContext(file_id=1, path="c.log", size=len(text), fmt="nccl_debug")
    colls = dict(parse_text(io.BytesIO(text.encode()), ctx))["nccl_colls"].sort("line_no")
    assert colls.select("op", "op_count", "count", "dtype", "redop", "root", "comm", "nranks", "stream", "rank").rows() == [
        ("AllReduce", 5, 8, "float32", "sum", 0, "0x9", None, "0x2", 5),
        ("ReduceScatter", 6, 4, "bfloat16", "avg", 0, "0x9", 8, "0x3", 5),
        ("Recv", 7, 2, "int32", "sum", 3, "0x9", 8, "0x3", 5),
    ]
    assert colls.row(2, named=True)["sendbuff"] == "(nil)"
