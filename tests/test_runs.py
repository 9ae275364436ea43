"""Runs kept apart (issue 19): nothing to ingest is an error; a database knows its runs
(table `runs`, `files.run_id`), refuses an unrelated PATH without `--add`, diagnoses each
run on its own (`--run` picks one); archives inside an ingested folder are extracted."""
from __future__ import annotations

import io
import json
import shutil
import tarfile
import zipfile
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from forensics import api, pipeline
from forensics.cli import app

from .conftest import FIXTURES

OOM = FIXTURES / "diag_oom_train_torchrun"
NCCL = FIXTURES / "diag_nccl_conn_refused"
HEALTHY = FIXTURES / "diag_healthy_benign"


def rows(db, sql, params=None):
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(sql, params or []).fetchall()
    finally:
        con.close()


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("expected.json"))
    return dst


def _top_cause(d: dict) -> str | None:
    return d["root_causes"][0]["id"] if d["root_causes"] else None


# -- 1. nothing to ingest ------------------------------------------------------------------

def test_missing_path_is_an_error_and_leaves_no_database(tmp_path):
    db = tmp_path / "x.duckdb"
    res = cli("ingest", tmp_path / "no" / "such" / "path", "--db", db)
    assert res.exit_code == 2, res.output
    assert res.output.count("error:") == 1 and "nothing to ingest" in res.output and "no such file or folder" in res.output
    assert not db.exists() and not Path(f"{db}.wal").exists()


def test_empty_folder_is_an_error_and_leaves_no_database(tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    db = tmp_path / "x.duckdb"
    res = cli("ingest", tmp_path / "empty", "--db", db)
    assert res.exit_code == 2 and "nothing to ingest" in res.output and "no file to read" in res.output, res.output
    assert not db.exists()
    # everything excluded is nothing to ingest too
    (tmp_path / "empty" / "a.log").write_text("hello\n")
    res = cli("ingest", tmp_path / "empty", "--db", db, "-x", "*.log")
    assert res.exit_code == 2 and "every file excluded" in res.output and not db.exists()


def test_nothing_to_ingest_keeps_a_database_that_existed(tmp_path):
    db = tmp_path / "x.duckdb"
    pipeline.ingest([str(NCCL)], str(db), workers=1)
    before = rows(db, "SELECT count(*) FROM lines")
    (tmp_path / "empty").mkdir()
    with pytest.raises(pipeline.NothingToIngest):
        pipeline.ingest([str(tmp_path / "empty")], str(db), workers=1, add=True)
    assert db.exists() and rows(db, "SELECT count(*) FROM lines") == before
    assert rows(db, "SELECT count(*) FROM runs") == [(1,)]


# -- 2. runs kept apart --------------------------------------------------------------------

def test_an_unrelated_path_is_refused_without_add(tmp_path):
    a, b = _copy(OOM, tmp_path / "runA"), _copy(NCCL, tmp_path / "runB")
    db = tmp_path / "forensics.duckdb"
    assert cli("ingest", a, "--db", db, "-q").exit_code == 0
    lines_before = rows(db, "SELECT count(*) FROM lines")
    res = cli("ingest", b, "--db", db, "-q")
    assert res.exit_code == 2, res.output
    said = res.output.replace("\n", " ")
    assert "already holds run 'runA'" in said and str(a) in said and "--db" in said and "--add" in said
    assert rows(db, "SELECT count(*) FROM lines") == lines_before
    # the same PATH again is fine, and adds nothing
    again = cli("ingest", a, "--db", db, "--json")
    assert again.exit_code == 0 and json.loads(again.output)["files_loaded"] == 0
    # opted in: two runs, each path starts with its PATH's name
    assert cli("ingest", b, "--db", db, "--add", "-q").exit_code == 0
    assert rows(db, "SELECT name, kind, path_prefix FROM runs ORDER BY run_id") == [
        ("runA", "path", "runA"), ("runB", "path", "runB")]
    paths = [p for (p,) in rows(db, "SELECT path FROM files")]
    assert paths and all(p.startswith(("runA/", "runB/")) for p in paths)
    assert rows(db, "SELECT count(*) FROM files WHERE run_id IS NULL") == [(0,)]
    # a re-ingest of the first PATH still knows its files under their prefixed paths
    assert pipeline.ingest([str(a)], str(db), workers=1).files_unchanged == len([p for p in paths if p.startswith("runA/")])


def test_each_run_is_diagnosed_on_its_own(tmp_path):
    """Two runs in one database: one block each, with the cause each has alone."""
    a, b = _copy(OOM, tmp_path / "runA"), _copy(NCCL, tmp_path / "runB")
    alone = {}
    for p in (a, b):
        pipeline.ingest([str(p)], str(tmp_path / f"{p.name}.duckdb"), workers=1)
        alone[p.name] = api.diagnose(tmp_path / f"{p.name}.duckdb").to_dict()
    db = tmp_path / "both.duckdb"
    pipeline.ingest([str(a), str(b)], str(db), workers=1)
    res = cli("diagnose", "--db", db, "--json")
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert [r["run"] for r in got["runs"]] == ["runA", "runB"]
    for r in got["runs"]:
        want = alone[r["run"]]
        assert r["verdict"] == want["verdict"] and _top_cause(r) == _top_cause(want)
        ev, want_ev = r["root_causes"][0]["evidence"][0], want["root_causes"][0]["evidence"][0]
        assert ev["file"] == f"{r['run']}/{want_ev['file']}" and ev["line"] == want_ev["line"]
    assert _top_cause(got["runs"][0]) != _top_cause(got["runs"][1])
    text = cli("diagnose", "--db", db)
    assert text.exit_code == 0 and "== run runA" in text.output and "== run runB" in text.output
    # --run picks one: the one-run shape of contract.md
    one = json.loads(cli("diagnose", "--db", db, "--json", "--run", "runB").output)
    assert "runs" not in one and _top_cause(one) == _top_cause(alone["runB"])
    by_id = json.loads(cli("diagnose", "--db", db, "--json", "--run", got["runs"][0]["run_id"]).output)
    assert _top_cause(by_id) == _top_cause(alone["runA"])
    bad = cli("diagnose", "--db", db, "--run", "nope")
    assert bad.exit_code == 2 and "no run 'nope'" in bad.output and "runA" in bad.output


def test_a_folder_of_bundles_is_a_folder_of_runs(tmp_path):
    root = tmp_path / "many"
    _copy(OOM, root / "case-oom")
    _copy(NCCL, root / "case-nccl")
    _copy(HEALTHY, root / "case-ok")
    (root / "README.md").write_text("three runs, one folder each\n")
    db = tmp_path / "m.duckdb"
    pipeline.ingest([str(root)], str(db), workers=1)
    assert rows(db, "SELECT rel, kind FROM runs WHERE parent_id IS NOT NULL ORDER BY rel") == [
        ("case-nccl", "bundle"), ("case-ok", "bundle"), ("case-oom", "bundle")]
    # the README belongs to the PATH, which holds the runs and is not diagnosed itself
    assert rows(db, "SELECT r.kind FROM files f JOIN runs r USING (run_id) WHERE f.path = 'README.md'") == [("path",)]
    d = api.diagnose(db)
    by_run = {r.name: one for r, one, _ in d.runs}
    assert set(by_run) == {"many/case-oom", "many/case-nccl", "many/case-ok"}
    assert by_run["many/case-ok"].verdict == "healthy"
    assert by_run["many/case-oom"].root_causes[0].id != by_run["many/case-nccl"].root_causes[0].id
    assert by_run["many/case-oom"].root_causes[0].evidence[0].file.startswith("case-oom/")
    # the ingest's headline names each run
    headline = api.open(db).headline()
    assert headline.startswith("3 runs") and "many/case-ok: healthy" in headline


def test_report_needs_run_when_there_are_several(tmp_path):
    a, b = _copy(OOM, tmp_path / "runA"), _copy(NCCL, tmp_path / "runB")
    db = tmp_path / "both.duckdb"
    pipeline.ingest([str(a), str(b)], str(db), workers=1)
    res = cli("report", "--db", db, "-o", tmp_path / "r.html")
    assert res.exit_code == 2 and "--run" in res.output and "runA" in res.output, res.output
    res = cli("report", "--db", db, "-o", tmp_path / "r.html", "--run", "runA")
    assert res.exit_code == 0, res.output
    page = (tmp_path / "r.html").read_text()
    assert "runA/" in page and "runB/" not in page


def test_reingest_keeps_runs_and_a_grown_file_adds_its_new_lines(tmp_path):
    root = _copy(NCCL, tmp_path / "run")
    db = tmp_path / "r.duckdb"
    pipeline.ingest([str(root)], str(db), workers=1)
    n = rows(db, "SELECT count(*) FROM lines")[0][0]
    with open(root / "driver.log", "a") as fh:
        fh.write("a new line\nand another\n")
    s = pipeline.ingest([str(root)], str(db), workers=1)
    assert s.files_grown == 1 and rows(db, "SELECT count(*) FROM lines")[0][0] == n + 2
    assert rows(db, "SELECT count(*), count(DISTINCT run_id) FROM runs") == [(1, 1)]


def test_a_database_from_before_runs_gets_them(tmp_path):
    root = _copy(NCCL, tmp_path / "run")
    db = tmp_path / "r.duckdb"
    pipeline.ingest([str(root)], str(db), workers=1)
    con = duckdb.connect(str(db))
    con.execute("DELETE FROM runs")
    con.execute("UPDATE files SET run_id = NULL")
    con.close()
    assert api.diagnose(db).verdict == "failed"  # read whole, as before
    pipeline.ingest([str(root)], str(db), workers=1)
    assert rows(db, "SELECT name, kind FROM runs") == [("run", "path")]
    assert rows(db, "SELECT count(*) FROM files WHERE run_id IS NULL") == [(0,)]


# -- what a run is ------------------------------------------------------------------------

def find_runs(files, pids=None):
    from forensics.runs import find_runs as find  # here: the other tests run (and fail) on a tree without runs

    return find(files, pids)


def _runs(files):
    found, rest = find_runs(files)
    return sorted((r.rel, r.kind) for r in found), sorted(rest)


def test_ray_sessions_are_runs_of_their_own():
    files = [("session_2025-01-01_10-00-00_1/logs/raylet.out", "ray_raylet"),
             ("session_2025-01-01_10-00-00_1/logs/worker-1.out", "ray_worker"),
             ("session_2025-01-02_11-00-00_2/logs/raylet.out", "ray_raylet")]
    assert _runs(files) == ([("session_2025-01-01_10-00-00_1", "ray_session"), ("session_2025-01-02_11-00-00_2", "ray_session")], [])
    # one session beside its driver log: one run
    assert _runs(files[:2] + [("driver.log", "driver")]) == ([("", "path")], [])
    # two sessions and a driver log beside them: the driver log is a run of the folder's own
    assert _runs(files + [("driver.log", "driver")])[0][0] == ("", "path")


def test_parts_of_one_run_stay_one_run():
    nodes = [("node_a/dmesg.log", "kernel"), ("node_b/dmesg.log", "kernel")]
    assert _runs(nodes) == ([("", "path")], [])
    roles = [("head_node/driver.log", "driver"), ("worker_node/ray_start.log", "text")]
    assert _runs(roles) == ([("", "path")], [])
    # a bundle with logs of its own at its top and subfolders: one run
    assert _runs([("driver.log", "driver"), ("a/x.log", "text"), ("b/y.log", "text")]) == ([("", "path")], [])


def test_driver_logs_alone_in_a_folder_are_runs_each():
    def runs(files, pids):
        found, rest = find_runs(files, pids)
        return sorted((r.rel, r.kind) for r in found), sorted(rest)

    drivers = [("a.log", "driver"), ("b.log", "driver"), ("c.err", "empty")]
    assert runs(drivers, {"a.log": {11, 12}, "b.log": {21}}) == ([("a.log", "driver_log"), ("b.log", "driver_log")], ["c.err"])
    # the head and the tail of one console (the same workers): one run
    assert runs(drivers, {"a.log": {11, 12}, "b.log": {12}}) == ([("", "path")], [])
    # beside other files they are parts of one bundle
    assert runs([*drivers[:2], ("client.log", "text")], {"a.log": {1}, "b.log": {2}}) == ([("", "path")], [])


def test_driver_logs_of_separate_runs_are_told_apart_by_their_processes(tmp_path):
    root = tmp_path / "consoles"
    root.mkdir()
    prefix = "(WorkerDict pid={pid}) step {i} done\n"
    (root / "monday.log").write_text("".join(prefix.format(pid=100, i=i) for i in range(5)))
    (root / "tuesday.log").write_text("".join(prefix.format(pid=200, i=i) for i in range(5)))
    db = tmp_path / "c.duckdb"
    pipeline.ingest([str(root)], str(db), workers=1)
    assert rows(db, "SELECT rel, kind FROM runs WHERE parent_id IS NOT NULL ORDER BY rel") == [
        ("monday.log", "driver_log"), ("tuesday.log", "driver_log")]
    # a console cut in two (the same worker goes on in the second file) is one run
    (root / "tuesday.log").write_text("".join(prefix.format(pid=100, i=i) for i in range(5, 9)))
    pipeline.ingest([str(root)], str(db), workers=1)
    assert rows(db, "SELECT rel, kind FROM runs") == [("", "path")]
    assert rows(db, "SELECT count(*) FROM files WHERE run_id IS DISTINCT FROM 1") == [(0,)]


def test_sibling_folders_with_logs_of_their_own_are_runs_without_any_label():
    files = [("x/train.log", "text"), ("y/train.log", "text"), ("notes.txt", "text")]
    assert _runs(files) == ([("x", "bundle"), ("y", "bundle")], ["notes.txt"])


# -- 3. archives inside an ingested folder ----------------------------------------------

def _tar(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def _zip(path: Path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)


def test_archives_inside_a_folder_are_extracted(tmp_path):
    root = _copy(OOM, tmp_path / "run")
    stamp = b"2025-01-01 00:00:0%d,000 INFO line %d of a node\n"
    _tar(root / "node2_logs.tar.gz", {"node2/worker.log": b"".join(stamp % (i, i) for i in range(3))})
    inner = io.BytesIO()
    _tar(Path(tmp_path / "inner.tar.gz"), {"deep.log": b"deep inside\n"})
    _zip(root / "ray_logs.zip", {"raylet.out": b"[2025-01-01 00:00:00,000 I 1 1] raylet started\n",
                                 "more/inner.tar.gz": (tmp_path / "inner.tar.gz").read_bytes()})
    del inner
    db = tmp_path / "r.duckdb"
    s = pipeline.ingest([str(root)], str(db), workers=1)
    got = dict(rows(db, "SELECT path, lines FROM files WHERE path LIKE '%.tar.gz/%' OR path LIKE '%.zip/%'"))
    assert got == {"node2_logs.tar.gz/node2/worker.log": 3, "ray_logs.zip/raylet.out": 1,
                   "ray_logs.zip/more/inner.tar.gz/deep.log": 1}, (got, s.messages)
    assert not [m for m in s.messages if "binary" in m]
    # idempotent: the members are known again by their paths
    again = pipeline.ingest([str(root)], str(db), workers=1)
    assert again.files_loaded == 0 and again.files_unchanged == s.files_seen


def test_a_bomb_inside_a_folder_stops_with_a_message_and_the_rest_is_ingested(tmp_path, monkeypatch):
    root = tmp_path / "run"
    root.mkdir()
    (root / "driver.log").write_text("2025-01-01 00:00:00,000 INFO start\n")
    _zip(root / "bomb.zip", {"a.log": b"first member\n", "zeros.log": bytes(80 << 20), "z.log": b"after\n"})
    assert (root / "bomb.zip").stat().st_size < 200_000
    _tar(root / "many.tar.gz", {f"m{i}.log": b"x\n" for i in range(30)})
    monkeypatch.setenv("FORENSICS_MAX_EXTRACT_MEMBERS", "10")
    db = tmp_path / "r.duckdb"
    s = pipeline.ingest([str(root)], str(db), workers=1)
    ratio = [m for m in s.messages if m.startswith("bomb.zip:")]
    assert len(ratio) == 1 and "zeros.log" in ratio[0] and "FORENSICS_MAX_EXTRACT_RATIO" in ratio[0], s.messages
    many = [m for m in s.messages if m.startswith("many.tar.gz:")]
    assert len(many) == 1 and "FORENSICS_MAX_EXTRACT_MEMBERS" in many[0], s.messages
    paths = {p for (p,) in rows(db, "SELECT path FROM files")}
    assert {"driver.log", "bomb.zip/a.log"} <= paths and "bomb.zip/zeros.log" not in paths
    assert len([p for p in paths if p.startswith("many.tar.gz/")]) == 10


def test_a_file_named_like_an_archive_that_is_none_is_read_as_a_file(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.tar.gz").write_text("not an archive at all\n")
    pipeline.ingest([str(tmp_path / "run")], str(tmp_path / "r.duckdb"), workers=1)
    assert rows(tmp_path / "r.duckdb", "SELECT path, lines FROM files") == [("notes.tar.gz", 1)]
