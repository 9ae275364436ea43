"""The Ray engine (``forensics ingest --engine ray``, ``forensics collect``).

The fast tests run the node side (:func:`forensics.distributed.node_ingest`) in this
process and load what it yields the way the driver does, against the local engine on
the same folders. The slow ones start a local Ray cluster (a head and two nodes of one
CPU each, each with a Ray temporary folder and a ``forensics-node`` label of its own:
nodes of a local cluster share one filesystem) once per test session, and an S3 API on
the loopback address (moto) for ``--parts s3://...``.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import duckdb
import pytest

from forensics import api, pipeline
from forensics import distributed as D
from forensics.store import Store, all_tables

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_NODES = ROOT / "sample_logs" / "ray_logs"  # one folder per node: gpu-a, gpu-b
MARK = "forensics-ray-test-marker"


# -- helpers ---------------------------------------------------------------------------

def rows_by_file(con, table: str, where_files: str = "true", below_path: bool = False) -> list[tuple]:
    """A table's rows with (root, path) of their file instead of file_id, sorted; node
    and bookkeeping times left out (the Ray engine sets node from the node that read), a
    file's run by its name. ``below_path``: paths below their PATH and runs by their
    folder, for databases given the same PATHs in another order (with several PATHs a
    stored path starts with its PATH's name, made unique in the order they came).
    ``where_files`` reads ``t.root`` and ``t._path`` (the path as compared)."""
    # the declared columns: a loaded table also has the hidden columns of stored-once values
    cols = [c.name for t in all_tables() if t.name == table for c in t.columns]
    drop = {"file_id", "node", "ingested_at", "run_id"}
    path = ("CASE WHEN p.path_prefix IS NULL THEN f.path ELSE substr(f.path, length(p.path_prefix) + 2) END"
            if below_path else "f.path")
    run = "r.rel || ':' || r.kind" if below_path else "r.name"
    ff = (f"(SELECT f.*, {path} AS _path, {run} AS _run FROM files f "
          "LEFT JOIN runs p ON p.parent_id IS NULL AND p.root = f.root LEFT JOIN runs r ON r.run_id = f.run_id)")
    if table == "files":
        keep = ", ".join("t._path" if c == "path" else f't."{c}"' for c in cols if c not in drop)
        sql = f"SELECT {keep}, t._run FROM {ff} t WHERE {where_files}"
    else:
        keep = ", ".join(f't."{c}"' for c in cols if c not in drop)
        sql = (f"SELECT f.root, f._path, {keep} FROM \"{table}\" t JOIN {ff} f ON f.file_id = t.file_id "
               f"WHERE {where_files.replace('t.', 'f.')}")
    return sorted(con.execute(sql).fetchall(), key=repr)


def file_tables(con) -> list[str]:
    # the tables of rows per file (the runs table has none: its ids differ between databases)
    return [t.name for t in all_tables() if t.name == "files" or any(c.name == "file_id" for c in t.columns)]


def assert_same_rows(db_a: str, db_b: str, where_files: str = "true", below_path: bool = False) -> None:
    with duckdb.connect(db_a, read_only=True) as a, duckdb.connect(db_b, read_only=True) as b:
        for con in (a, b):
            D.attach_parts(con)  # views over parts on S3 read them through fsspec (api.open does it too)
        for table in file_tables(a):
            assert rows_by_file(a, table, where_files, below_path) == rows_by_file(b, table, where_files, below_path), table


def node_copies(tmp: Path) -> Path:
    """sample_logs' two node folders, copied: data/gpu-a, data/gpu-b."""
    data = tmp / "data"
    shutil.copytree(SAMPLE_NODES, data)
    return data


def in_process(paths, db: str, names=("gpu-a", "gpu-b"), dest: str | None = None, workers: int = 1) -> pipeline.IngestSummary:
    """The Ray engine's node side and driver side, without Ray: each named node's job
    run here, what it yields loaded as the driver does."""
    store = pipeline.open_writer(db, defer_views=False)
    batch = pipeline._Batch(store)
    summary = pipeline.IngestSummary(db=db)
    try:
        known, offsets, first = D._known_by_node(store), D._last_line_offsets(store), store.next_file_id()
        nodes = [D.Node(f"id-{n}", n, None, 1) for n in names]
        for _, job in D._node_jobs(nodes, paths, known, offsets, first, [], workers, False, dest, D._run_id()):
            for item in D.node_ingest(job):
                D._load_item(store, batch, item, summary, False, None, 0, 0)
        batch.close()
        D._record_runs(store)  # as the driver does once every node's rows are loaded
        if dest:
            D._remove_spool(dest, job.ingest)
    finally:
        store.close()
    return summary


def in_process_views(paths, db: str, dest: str, names=("gpu-a", "gpu-b")) -> None:
    known, top = D._known_from_parts(dest)
    nodes = [D.Node(f"id-{n}", n, None, 1) for n in names]
    for _, job in D._node_jobs(nodes, paths, known, {}, top + 1, [], 1, False, dest, D._run_id()):
        job.views_only = True
        for _ in D.node_ingest(job):
            pass
    with duckdb.connect(db) as con:
        D.make_views(con, dest)


# -- fast: no cluster --------------------------------------------------------------------

def test_without_ray_the_engine_says_how_to_install(tmp_path):
    code = (
        "import sys; sys.modules['ray'] = None\n"  # import ray fails as when it is not installed
        "import forensics.api, forensics.distributed\n"  # the package imports without it
        "from forensics.cli import app\n"
        "app(['ingest', '--engine', 'ray', '--db', sys.argv[1]])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.duckdb")], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'forensics[ray]'" in proc.stderr
    code_collect = code.replace("['ingest', '--engine', 'ray', '--db', sys.argv[1]]", "['collect', sys.argv[1]]")
    proc = subprocess.run([sys.executable, "-c", code_collect, str(tmp_path / "out")], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "pip install 'forensics[ray]'" in proc.stderr


def test_node_side_loads_the_local_engines_rows_with_the_reading_node(tmp_path):
    data = node_copies(tmp_path)
    ray_db, local_db = str(tmp_path / "ray.duckdb"), str(tmp_path / "local.duckdb")
    summary = in_process([str(data / "{node}")], ray_db)
    pipeline.ingest([str(data / "gpu-a"), str(data / "gpu-b")], local_db, workers=1)
    assert summary.files_loaded == 4 and not summary.messages
    assert_same_rows(ray_db, local_db)
    with duckdb.connect(ray_db, read_only=True) as con:
        nodes = con.execute("SELECT root, node FROM files").fetchall()
        assert {os.path.basename(root) for root, _ in nodes} == {"gpu-a", "gpu-b"}
        assert all(os.path.basename(root) == node for root, node in nodes)
        # lines without a host of their own carry the node that read their file
        assert con.execute("SELECT count(*) FROM lines l JOIN files f USING (file_id) "
                           "WHERE l.node IS DISTINCT FROM f.node").fetchone()[0] == 0


def test_a_node_with_cpus_parses_in_a_process_pool(tmp_path):
    data = node_copies(tmp_path)
    for i in range(3):  # several jobs: files over a MB are parsed alone
        line = b"[2025-03-01 10:00:00,000 I 100 100] node_manager.cc:1: heartbeat\n"
        (data / "gpu-a" / f"big-{i}.log").write_bytes(line * (1_100_000 // len(line)))
    ray_db, local_db = str(tmp_path / "ray.duckdb"), str(tmp_path / "local.duckdb")
    summary = in_process([str(data / "{node}")], ray_db, workers=2)
    assert summary.files_loaded == 7 and not summary.messages
    pipeline.ingest([str(data / "gpu-a"), str(data / "gpu-b")], local_db, workers=1)
    assert_same_rows(ray_db, local_db)


def test_a_big_files_parts_are_read_piece_by_piece_as_they_are_loaded(tmp_path, monkeypatch):
    data = node_copies(tmp_path)
    line = b"[2025-03-01 10:00:00,000 I 100 100] node_manager.cc:1: heartbeat from a node\n"
    (data / "gpu-a" / "big.log").write_bytes(line * ((5 << 20) // len(line)))  # 5 MB
    monkeypatch.setattr(pipeline, "PIECE_BYTES", 1 << 20)  # several transactions for big.log
    from forensics.parsers import text

    monkeypatch.setattr(text.parse_text, "__defaults__", (1 << 20,))  # big.log parsed in 1 MB chunks: a part each
    reads, inserting = [], []
    real_read, real_insert = D.Part.read, Store.insert_parts

    def read(self):
        assert inserting, "a part read before its piece is inserted: a big file's rows would all be in memory"
        reads.append(self.path)
        return real_read(self)

    def insert_parts(self, parts, con=None):
        inserting.append(1)
        try:
            return real_insert(self, parts, con)
        finally:
            inserting.pop()

    monkeypatch.setattr(D.Part, "read", read)
    monkeypatch.setattr(Store, "insert_parts", insert_parts)
    ray_db, local_db = str(tmp_path / "ray.duckdb"), str(tmp_path / "local.duckdb")
    in_process([str(data / "{node}")], ray_db, dest=str(tmp_path / "spool"))
    assert len(reads) == len(set(reads))  # every part read once, when its piece is inserted
    assert len([r for r in reads if "table=lines/ray_node=gpu-a/" in r]) >= 5
    pipeline.ingest([str(data / "gpu-a"), str(data / "gpu-b")], local_db, workers=1)
    assert_same_rows(ray_db, local_db)
    with duckdb.connect(ray_db, read_only=True) as con:
        assert con.execute("SELECT count(*) FROM meta WHERE key = 'loading_file'").fetchone()[0] == 0


def test_node_side_is_idempotent_per_node_and_path_and_reads_grown_files_from_their_end(tmp_path):
    data = node_copies(tmp_path)
    (data / "gpu-b" / "raylet.out").write_bytes((data / "gpu-a" / "raylet.out").read_bytes())  # one path, two nodes
    db = str(tmp_path / "ray.duckdb")
    first = in_process([str(data / "{node}")], db)
    again = in_process([str(data / "{node}")], db)
    assert first.files_loaded == 4 and again.files_loaded == 0 and again.files_unchanged == 4
    assert sum(again.rows_added.values()) == 0
    with open(data / "gpu-a" / "raylet.out", "ab") as fh:
        fh.write(b"[2025-03-01 10:00:00,000 I 100 100] grown line\n")
    grown = in_process([str(data / "{node}")], db)
    assert grown.files_grown == 1 and grown.rows_added.get("lines") == 1
    local_db = str(tmp_path / "local.duckdb")
    pipeline.ingest([str(data / "gpu-a"), str(data / "gpu-b")], local_db, workers=1)
    assert_same_rows(db, local_db)


def test_parts_folder_loaded_and_views_only_answer_the_same_queries(tmp_path):
    data = node_copies(tmp_path)
    loaded, views = str(tmp_path / "loaded.duckdb"), str(tmp_path / "views.duckdb")
    in_process([str(data / "{node}")], loaded, dest=str(tmp_path / "spool"))
    assert (tmp_path / "spool" / "_spool").is_dir() and not list((tmp_path / "spool").rglob("*.parquet"))  # removed once loaded
    in_process_views([str(data / "{node}")], views, str(tmp_path / "parts"))
    assert list((tmp_path / "parts").glob("table=lines/ray_node=gpu-b/ingest=*/*.parquet"))
    assert_same_rows(loaded, views)
    with api.open(loaded) as a, api.open(views) as b:
        q = "SELECT path, line_no, level, message FROM error_lines ORDER BY ALL"
        assert a.sql(q).rows() == b.sql(q).rows() and a.sql(q).height > 0
        assert a.headline() == b.headline()
    # again with one file grown: the views show its new version only, once
    with open(data / "gpu-a" / "raylet.out", "ab") as fh:
        fh.write(b"[2025-03-01 10:00:00,000 I 100 100] grown line\n")
    in_process_views([str(data / "{node}")], views, str(tmp_path / "parts"))
    local_db = str(tmp_path / "local.duckdb")
    pipeline.ingest([str(data / "gpu-a"), str(data / "gpu-b")], local_db, workers=1)
    assert_same_rows(views, local_db)
    with pytest.raises(api.ForensicsError, match="views over the parts"):  # not a database to load rows into
        api.ingest([str(data)], views)


def test_paths_on_no_node_and_a_dead_nodes_files_are_named():
    states = {"a": D._NodeState("a", planned=[("/r", "x.log"), ("/r", "y.log")], loaded={("/r", "x.log")},
                                absent=["/nowhere", "/data/a"], error="NodeDiedError: node a died"),
              "b": D._NodeState("b", planned=[], absent=["/nowhere"]),
              "c": D._NodeState("c", error="WorkerCrashedError: gone")}
    summary = pipeline.IngestSummary()
    D.report_nodes(states, ["/nowhere", "/data/{node}"], summary, shared=False)
    text = "\n".join(summary.messages)
    assert "node a failed (NodeDiedError: node a died): 1 of its file(s) not loaded: y.log" in text
    assert "x.log" not in text
    assert "node c failed before it listed its files" in text
    assert "/nowhere: no such file or folder on any node" in text and "/data/{node}" not in text


def test_views_give_yearless_stamps_the_runs_year_as_loading_does(tmp_path):
    vllm = ROOT / "tests" / "fixtures" / "vllm"  # driver.log has full stamps, engine.log none
    (tmp_path / "gpu-a").mkdir()
    (tmp_path / "gpu-b").mkdir()
    shutil.copy(vllm / "driver.log", tmp_path / "gpu-a")
    shutil.copy(vllm / "engine.log", tmp_path / "gpu-b")
    views, local_db = str(tmp_path / "views.duckdb"), str(tmp_path / "local.duckdb")
    in_process_views([str(tmp_path / "{node}")], views, str(tmp_path / "parts"))
    pipeline.ingest([str(tmp_path / "gpu-a"), str(tmp_path / "gpu-b")], local_db, workers=1)
    with duckdb.connect(local_db, read_only=True) as con:
        assert con.execute("SELECT count(*) FROM lines WHERE ts_quality = 'year_inferred'").fetchone()[0] > 0
    assert_same_rows(views, local_db)


# -- slow: a local Ray cluster -------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3():
    """An S3 API on the loopback address (moto's server) with a bucket; the endpoint and
    dummy credentials are in the environment before the cluster starts, so its workers
    have them too."""
    pytest.importorskip("moto")
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import boto3

    boto3.client("s3").create_bucket(Bucket="forensics-test")
    yield "s3://forensics-test"
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class LocalCluster:
    def __init__(self, base: Path):
        from ray.cluster_utils import Cluster

        self.base = base
        self.cluster = Cluster(initialize_head=True, head_node_args=self._args("head"))
        self.nodes = {"head": self.cluster.head_node}
        for name in ("a", "b"):
            self.add(name)

    def _args(self, name: str) -> dict:
        return {"num_cpus": 1, "temp_dir": str(self.base / name), "labels": {D.NODE_LABEL: name}}

    def add(self, name: str) -> None:
        self.nodes[name] = self.cluster.add_node(**self._args(name))
        self.cluster.wait_for_nodes()

    def remove(self, name: str) -> None:
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)


@pytest.fixture(scope="session")
def cluster(s3):
    ray = pytest.importorskip("ray")
    base = Path(tempfile.mkdtemp(prefix="fr-ray-"))  # short: Ray's socket paths must fit 107 bytes
    os.environ["RAY_TMPDIR"] = str(base / "default")  # where Ray notes the cluster's address
    (base / "default" / "ray").mkdir(parents=True)
    c = LocalCluster(base)
    ray.init(address=c.cluster.address, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.cluster.shutdown()
        shutil.rmtree(base, ignore_errors=True)


def _write_worker_logs(ray) -> None:
    """A small job: one task on each node prints lines, one of them a traceback."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def work(i: int) -> str:
        import traceback

        print(f"{MARK} step {i}: rollout done", flush=True)
        try:
            {}["missing_key"]
        except KeyError:
            traceback.print_exc()
        return ray.get_runtime_context().get_node_id()

    refs = [work.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False)).remote(i)
            for i, n in enumerate(D.alive_nodes(ray))]
    ray.get(refs)
    import time

    time.sleep(1.5)  # worker output reaches its file


@pytest.mark.slow
def test_cluster_each_node_reads_its_own_session_logs(cluster, tmp_path):
    import ray

    _write_worker_logs(ray)
    db = str(tmp_path / "ray.duckdb")
    run = api.ingest_ray(None, db)
    messages = run.last_ingest.messages
    run.close()
    roots = {n: D.session_log_dirs(str(cluster.base / n)) for n in ("head", "a", "b")}
    local_db = str(tmp_path / "local.duckdb")
    pipeline.ingest([r for rs in roots.values() for r in rs], local_db, workers=1)
    with duckdb.connect(db, read_only=True) as con:
        files = con.execute("SELECT root, path, node FROM files").fetchall()
        assert len(files) == len(set((r, p) for r, p, _ in files)), "a file read by two nodes"
        for root, _, node in files:
            assert root in roots[node], (root, node)
        marked = con.execute(f"SELECT DISTINCT f.node FROM lines l JOIN files f USING (file_id) "
                             f"WHERE l.text LIKE '%{MARK}%'").fetchall()
        assert {n for (n,) in marked} == {"head", "a", "b"}, messages
    # files that did not change between the two ingests (Ray keeps writing its own logs) give the same rows
    rel = ("SELECT f.root, CASE WHEN p.path_prefix IS NULL THEN f.path ELSE substr(f.path, length(p.path_prefix) + 2) END, "
           "f.sha256 FROM files f LEFT JOIN runs p ON p.parent_id IS NULL AND p.root = f.root")
    with duckdb.connect(local_db, read_only=True) as con:
        local_sha = {(r, p): s for r, p, s in con.execute(rel).fetchall()}
    with duckdb.connect(db, read_only=True) as con:
        same = [(r, p) for r, p, s in con.execute(rel).fetchall() if s and local_sha.get((r, p)) == s]
    assert any("worker-" in p for _, p in same)
    keys = " OR ".join(f"(t.root = '{r}' AND t._path = '{p}')" for r, p in same)
    assert_same_rows(db, local_db, keys, below_path=True)


def _node_data(tmp_path: Path, big_files_on_b: int = 0) -> Path:
    """data/<node>/ for each node of the cluster: sample logs, and on b ``big_files_on_b``
    logs over a MB each (one parse job each)."""
    data = tmp_path / "data"
    for name, sample in (("head", "gpu-a"), ("a", "gpu-b"), ("b", "gpu-a")):
        shutil.copytree(SAMPLE_NODES / sample, data / name)
    line = b"[2025-03-01 10:00:00,000 I 100 100] node_manager.cc:1: heartbeat from a node that is still alive\n"
    for i in range(big_files_on_b):
        (data / "b" / f"big-{i:02d}.log").write_bytes(line * (1_200_000 // len(line)) + f"end {i}\n".encode())
    return data


@pytest.mark.slow
def test_cluster_paths_per_node_match_the_local_engine(cluster, tmp_path):
    data = _node_data(tmp_path)
    db, local_db = str(tmp_path / "ray.duckdb"), str(tmp_path / "local.duckdb")
    run = api.ingest_ray([str(data / "{node}")], db)
    assert run.last_ingest.files_loaded == 5 and not run.last_ingest.messages
    run.close()
    pipeline.ingest([str(data / n) for n in ("head", "a", "b")], local_db, workers=1)
    assert_same_rows(db, local_db)
    with duckdb.connect(db, read_only=True) as con:
        assert all(os.path.basename(r) == n for r, n in con.execute("SELECT root, node FROM files").fetchall())
    # the command line, on the same database: nothing to add
    import json

    from typer.testing import CliRunner

    from forensics.cli import app

    res = CliRunner().invoke(app, ["ingest", "--engine", "ray", str(data / "{node}"), "--db", db, "--json"])
    assert res.exit_code == 0, res.output
    again = json.loads(res.stdout)
    assert again["files_loaded"] == 0 and again["files_unchanged"] == 5 and sum(again["rows_added"].values()) == 0
    # a driver of its own, connecting by --address
    other = str(tmp_path / "other.duckdb")
    proc = subprocess.run([sys.executable, "-m", "forensics", "ingest", "--engine", "ray", "--address",
                           cluster.cluster.address, str(data / "{node}"), "--db", other, "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["files_loaded"] == 5
    assert_same_rows(other, local_db)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["folder", "s3"])
def test_cluster_parts_destination_loaded_and_views_only(cluster, s3, tmp_path, where):
    data = _node_data(tmp_path)
    dest = str(tmp_path / "parts") if where == "folder" else f"{s3}/{tmp_path.name}"
    loaded, views, local_db = (str(tmp_path / f"{n}.duckdb") for n in ("loaded", "views", "local"))
    api.ingest_ray([str(data / "{node}")], loaded, parts=dest).close()
    run = api.ingest_ray([str(data / "{node}")], views, parts=dest, views_only=True)
    assert run.tables() and run.sql("SELECT count(*) AS n FROM lines")["n"][0] > 0
    q = "SELECT path, line_no, message FROM error_lines ORDER BY ALL"
    with api.open(loaded) as full:
        assert run.sql(q).rows() == full.sql(q).rows()
    run.close()
    # the commands that open the database themselves read the parts too (on S3 through fsspec)
    assert api.diagnose(views).headline() == api.diagnose(loaded).headline()
    assert api.report(views, str(tmp_path / "views.html"), run="b").bytes > 0  # one run of the three (PATHs)
    pipeline.ingest([str(data / n) for n in ("head", "a", "b")], local_db, workers=1)
    assert_same_rows(loaded, local_db)
    assert_same_rows(views, local_db)
    if where == "folder":
        assert list((tmp_path / "parts").glob("table=lines/ray_node=b/ingest=*/*.parquet"))
        assert not (tmp_path / "parts" / "_spool").exists() or not list((tmp_path / "parts" / "_spool").rglob("*.parquet"))
    again = api.ingest_ray([str(data / "{node}")], views, parts=dest, views_only=True)
    assert again.last_ingest.files_loaded == 0
    again.close()
    assert_same_rows(views, local_db)


@pytest.mark.slow
def test_cluster_shared_folder_and_url_split_across_cpus(cluster, s3, tmp_path):
    import pyarrow.fs as pafs

    data = node_copies(tmp_path)
    local_db = str(tmp_path / "local.duckdb")
    pipeline.ingest([str(data)], local_db, workers=1)
    db = str(tmp_path / "shared.duckdb")
    run = api.ingest_ray([str(data)], db, shared=True)
    assert run.last_ingest.files_loaded == 4
    run.close()
    assert_same_rows(db, local_db)
    fs, base = pafs.FileSystem.from_uri(f"{s3}/logs-{tmp_path.name}")
    for p in data.rglob("*"):
        if p.is_file():
            with fs.open_output_stream(f"{base}/{p.relative_to(data).as_posix()}") as out:
                out.write(p.read_bytes())
    url_db = str(tmp_path / "url.duckdb")
    run = api.ingest_ray([f"{s3}/logs-{tmp_path.name}"], url_db)
    assert run.last_ingest.files_loaded == 4, run.last_ingest.messages
    run.close()
    with duckdb.connect(url_db, read_only=True) as a, duckdb.connect(local_db, read_only=True) as b:
        for table in ("lines", "fatal_events"):
            strip = lambda rows: [r[1:] for r in rows]  # noqa: E731 - the root differs (URL vs folder)
            assert strip(rows_by_file(a, table)) == strip(rows_by_file(b, table))


@pytest.mark.slow
def test_cluster_collect_then_ingest(cluster, tmp_path):
    import ray

    _write_worker_logs(ray)
    out = tmp_path / "collected"
    result = api.collect(str(out))
    assert set(result["nodes"]) == {"head", "a", "b"} and all(result["nodes"].values()), result["messages"]
    run = api.ingest([str(out)], str(tmp_path / "c.duckdb"), workers=1)
    marked = run.sql(f"SELECT DISTINCT f.node FROM lines l JOIN files f USING (file_id) WHERE l.text LIKE '%{MARK}%'")
    assert set(marked["node"].to_list()) == {"head", "a", "b"}
    run.close()


@pytest.mark.slow
def test_cluster_node_killed_mid_ingest_names_its_missing_files_and_a_rerun_completes(cluster, tmp_path):
    data = _node_data(tmp_path, big_files_on_b=10)
    db = str(tmp_path / "ray.duckdb")
    killed = []

    def progress(done, total, rel):
        if rel.startswith("big-") and not killed:
            killed.append(rel)
            cluster.remove("b")

    try:
        run = api.ingest_ray([str(data / "{node}")], db, progress=progress)
    finally:
        if "b" not in cluster.nodes:
            cluster.add("b")
    summary = run.last_ingest
    run.close()
    assert killed
    (message,) = [m for m in summary.messages if "node b failed" in m]
    with duckdb.connect(db, read_only=True) as con:
        have = {(n, p.rsplit("/", 1)[-1]) for n, p in con.execute("SELECT node, path FROM files").fetchall()}  # past the PATH's name
    planned_b = {f.name for f in (data / "b").iterdir()}
    missing = {p for p in planned_b if ("b", p) not in have}
    assert missing and all(p in message for p in missing)
    assert {p for n, p in have if n != "b"} >= {f.name for f in (data / "head").iterdir()} | {f.name for f in (data / "a").iterdir()}
    rerun = api.ingest_ray([str(data / "{node}")], db)
    assert rerun.last_ingest.files_loaded == len(missing), rerun.last_ingest.messages
    rerun.close()
    local_db = str(tmp_path / "local.duckdb")
    pipeline.ingest([str(data / n) for n in ("head", "a", "b")], local_db, workers=1)
    assert_same_rows(db, local_db)
