"""Ingest: line accounting, provenance, idempotency, bundles, bad files."""
from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path

import duckdb
import pytest

from forensics import pipeline

from .conftest import FIXTURES, corpus_cases

FOUNDATION = FIXTURES / "foundation"


def physical_lines(path: Path) -> int:
    data = path.read_bytes()
    if not data:
        return 0
    return data.count(b"\n") + (0 if data.endswith(b"\n") else 1)


def rows(db: Path, sql: str, params=None):
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(sql, params or []).fetchall()
    finally:
        con.close()


@pytest.fixture(scope="module")
def fixture_db(tmp_path_factory) -> Path:
    db = tmp_path_factory.mktemp("fx") / "fx.duckdb"
    pipeline.ingest([str(FOUNDATION)], str(db), workers=1)
    return db


def check_line_accounting(root: Path, db: Path) -> int:
    """files.lines == physical lines == rows in `lines`, for every text file."""
    checked = 0
    for path, kind, lines, n_rows in rows(db, """
            SELECT f.path, f.kind, f.lines, (SELECT count(*) FROM lines l WHERE l.file_id = f.file_id)
            FROM files f"""):
        if kind != "text":
            continue
        expected = physical_lines(root / path)
        assert lines == expected, f"{path}: files.lines={lines}, file has {expected}"
        assert n_rows == expected, f"{path}: {n_rows} rows in lines, file has {expected}"
        checked += 1
    # and line numbers are exactly 1..N per file
    bad = rows(db, """SELECT file_id FROM lines GROUP BY file_id
                      HAVING min(line_no) <> 1 OR max(line_no) <> count(*) OR count(DISTINCT line_no) <> count(*)""")
    assert not bad
    return checked


def test_fixture_line_accounting(fixture_db):
    assert check_line_accounting(FOUNDATION, fixture_db) >= 8


def test_long_text_columns_are_stored_with_zstd(fixture_db):
    from forensics.store import COLUMN_COMPRESSION, all_tables

    columns = {(t.name, c.name) for t in all_tables() for c in t.columns}
    assert set(COLUMN_COMPRESSION) <= columns
    con = duckdb.connect(str(fixture_db), read_only=True)
    used = dict(con.execute("""SELECT column_name, string_agg(DISTINCT compression, ',')
                               FROM pragma_storage_info('lines') WHERE segment_type = 'VARCHAR' GROUP BY 1""").fetchall())
    assert used["text"] == used["_message"] == "ZSTD"  # message: stored once, in its hidden column
    assert used["actor"] != "ZSTD"  # the others keep DuckDB's choice


def test_fixture_formats(fixture_db):
    fmts = dict(rows(fixture_db, "SELECT path, format FROM files"))
    assert fmts["driver.log"] == "driver"
    assert fmts["metrics.jsonl"] == "metrics_jsonl"
    assert fmts["dmesg.txt"] == "kernel"
    assert fmts["ray_logs/node-b/raylet.out"] == "ray_raylet"
    assert fmts["empty.log"] == "empty"
    assert fmts["torchrun_logs/run1/attempt_0/0/stderr.log"] == "torchrun_rank"


def test_driver_prefixes(fixture_db):
    got = rows(fixture_db, """SELECT line_no, actor, pid, node, rank, repeat, header, message FROM log
                              WHERE path = 'driver.log' ORDER BY line_no""")
    by_line = {r[0]: r[1:] for r in got}
    assert by_line[3][:2] == ("TaskRunner", 4101)
    assert by_line[3][-1] == "TaskRunner hostname: node-a, PID: 4101"  # ANSI and prefix gone
    assert by_line[5][:3] == ("WorkerDict", 5300, "10.0.0.2")
    assert by_line[5][5] == "nccl"
    assert by_line[6][3] == 0  # [rank0]: after the Ray prefix
    assert by_line[6][5] == "glog"
    assert by_line[8][4] == 2  # [repeated 2x across cluster]
    assert "repeated" not in by_line[8][6]
    assert by_line[9][0] == "raylet" and by_line[9][2] == "10.0.0.2" and by_line[9][5] == "ray_cpp"
    # a \r progress bar: the message is the last state
    assert by_line[10][6].startswith("Training Progress:  20%")
    # the traceback is one event, ending at the exception line
    tb = [r for r in got if r[0] in (11, 12, 13, 14)]
    assert {r for r in rows(fixture_db, "SELECT event_line FROM log WHERE path='driver.log' AND line_no BETWEEN 11 AND 14")} == {(11,)}
    assert tb
    assert rows(fixture_db, "SELECT event_line FROM log WHERE path='driver.log' AND line_no = 15") == [(None,)]


def test_timestamps(fixture_db):
    got = dict(rows(fixture_db, "SELECT line_no, strftime(ts, '%Y-%m-%d %H:%M:%S') || ' ' || ts_quality FROM log WHERE path='driver.log'"))
    assert got[2] == "2025-03-14 10:02:11 full"
    # vLLM prints no year: taken from the file's own full stamps
    assert got[4] == "2025-03-14 10:02:40 year_inferred"
    assert got[3].endswith("inherited")
    # glog (torch c10d) month without leading zero
    assert got[6] == "2025-03-14 10:03:01 year_inferred"
    # dmesg -T has a full date
    assert rows(fixture_db, "SELECT strftime(ts, '%Y-%m-%d %H:%M:%S') FROM log WHERE path='dmesg.txt' AND line_no=2") == [("2025-03-14 10:05:00",)]
    # a file with only year-less stamps gets the run's year
    assert rows(fixture_db, "SELECT year(ts), ts_quality FROM log WHERE path LIKE 'torchrun_logs/%/0/stderr.log'") == [(2025, "year_inferred")]


def test_ray_worker_file(fixture_db):
    got = rows(fixture_db, "SELECT line_no, actor, pid, node, header FROM log WHERE path LIKE 'ray_logs/%worker-%' ORDER BY line_no")
    assert [r[1] for r in got] == ["WorkerDict"] * 4 or [r[1] for r in got][1:] == ["WorkerDict"] * 3
    assert all(r[2] == 5300 and r[3] == "node-b" for r in got)
    assert got[0][4] == "ray_marker"


def test_raylet_continuation(fixture_db):
    got = rows(fixture_db, "SELECT line_no, header, event_line FROM log WHERE path LIKE '%raylet.out' ORDER BY line_no")
    assert got == [(1, "ray_cpp", None), (2, None, 1), (3, None, 1), (4, "ray_cpp", None)]


def test_torchrun_rank_from_path(fixture_db):
    got = rows(fixture_db, "SELECT path, rank FROM log WHERE path LIKE 'torchrun_logs/%' ORDER BY path, line_no")
    assert {(p.split('/')[3], r) for p, r in got} == {("0", 0), ("1", 1)}


def test_metrics_console_and_jsonl(fixture_db):
    got = rows(fixture_db, "SELECT source, step, key, value FROM metrics ORDER BY source, step, key")
    import math

    def val(source, step, key):
        hits = [r[3] for r in got if r[0] == source and r[1] == step and r[2] == key]
        assert len(hits) == 1, (source, step, key, hits)
        return hits[0]

    assert val("console", 1, "actor/entropy") == pytest.approx(0.647955)
    assert math.isnan(val("console", 1, "actor/grad_norm"))
    assert val("console", 1, "timing_s/gen") == 12.5
    assert val("console", 1, "perf/total_num_tokens") == 4096
    assert val("console", 2, "actor/pg_loss") == math.inf
    assert val("console", 2, "critic/score/mean") == 0.5
    assert val("jsonl", 1, "actor/pg_loss") == 0.5
    assert math.isnan(val("jsonl", 1, "actor/grad_norm"))
    assert val("jsonl", 2, "actor/pg_loss") == math.inf
    assert val("jsonl", 2, "critic/score/mean") == 0.25
    # the broken JSONL line is reported, the rest loaded
    assert rows(fixture_db, "SELECT count(*) FROM problems p JOIN files f USING (file_id) WHERE f.path = 'metrics.jsonl'")[0][0] == 1


def test_undecodable_bytes_reported(fixture_db):
    status, errors, lines = rows(fixture_db, "SELECT status, parse_errors, lines FROM files WHERE path = 'latin1.log'")[0]
    assert lines == 2 and errors == 1
    assert rows(fixture_db, "SELECT message FROM log WHERE path='latin1.log' AND line_no=1")[0][0] == "caf\ufffd latin-1 byte"


def test_reingest_is_idempotent(tmp_path):
    db = tmp_path / "x.duckdb"
    first = pipeline.ingest([str(FOUNDATION)], str(db), workers=1)
    before = pipeline.Store(str(db)).table_counts()
    assert first.rows_added["files"] == before["files"] == first.files_seen  # loaded and skipped ones
    assert first.rows_added.get("problems", 0) == before["problems"] > 0
    s = pipeline.ingest([str(FOUNDATION)], str(db), workers=2)
    assert s.files_loaded == 0 and s.files_unchanged == s.files_seen
    assert s.rows_total == before
    assert not any(s.rows_added.values())


def test_grown_file_gets_only_new_lines(tmp_path):
    root = tmp_path / "logs"
    root.mkdir()
    log = root / "train.log"
    log.write_bytes(b"2025-01-01 00:00:00,000 INFO a - one\n2025-01-01 00:00:01,000 INFO a - two\npartial")
    db = tmp_path / "g.duckdb"
    pipeline.ingest([str(root)], str(db), workers=1)
    assert rows(db, "SELECT lines, ends_with_newline FROM files") == [(3, False)]
    with open(log, "ab") as fh:
        fh.write(b" line done\nthree\nfour\n")
    s = pipeline.ingest([str(root)], str(db), workers=1)
    assert s.files_grown == 1
    got = rows(db, "SELECT line_no, text FROM lines ORDER BY line_no")
    assert got == [(1, "2025-01-01 00:00:00,000 INFO a - one"), (2, "2025-01-01 00:00:01,000 INFO a - two"),
                   (3, "partial line done"), (4, "three"), (5, "four")]
    assert rows(db, "SELECT lines FROM files") == [(5,)]
    with open(log, "ab") as fh:
        fh.write(b"five\n")
    pipeline.ingest([str(root)], str(db), workers=1)
    assert rows(db, "SELECT count(*), max(line_no) FROM lines") == [(6, 6)]
    assert check_line_accounting(root, db) == 1


def test_changed_file_is_reloaded(tmp_path):
    root = tmp_path / "logs"
    root.mkdir()
    (root / "a.log").write_text("one\ntwo\n")
    db = tmp_path / "c.duckdb"
    pipeline.ingest([str(root)], str(db), workers=1)
    (root / "a.log").write_text("uno\n")
    pipeline.ingest([str(root)], str(db), workers=1)
    assert rows(db, "SELECT line_no, text FROM lines") == [(1, "uno")]


def test_two_databases_side_by_side(tmp_path):
    a, b = tmp_path / "a.duckdb", tmp_path / "b.duckdb"
    pipeline.ingest([str(FOUNDATION)], str(a), workers=1)
    pipeline.ingest([str(FOUNDATION / "driver.log")], str(b), workers=1)
    assert rows(b, "SELECT path FROM files") == [("driver.log",)]
    assert rows(a, "SELECT count(*) FROM files")[0][0] > 1


def test_bundle_tar_gz(tmp_path):
    bundle = tmp_path / "run.tar.gz"
    with tarfile.open(bundle, "w:gz") as tf:
        tf.add(FOUNDATION, arcname="run")
        evil = tarfile.TarInfo("../../escaped.txt")
        data = b"should never land outside\n"
        evil.size = len(data)
        import io

        tf.addfile(evil, io.BytesIO(data))
        link = tarfile.TarInfo("run/link_out")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        tf.addfile(link)
    db = tmp_path / "b.duckdb"
    s = pipeline.ingest([str(bundle)], str(db), workers=1)
    assert not (tmp_path.parent / "escaped.txt").exists() and not (tmp_path / "escaped.txt").exists()
    assert any("escaped.txt" in m for m in s.messages)
    assert any("link_out" in m for m in s.messages)
    paths = {r[0] for r in rows(db, "SELECT path FROM files")}
    assert "run/driver.log" in paths
    assert rows(db, "SELECT DISTINCT root FROM files") == [(str(bundle),)]
    # the same accounting as for the folder
    direct = tmp_path / "d.duckdb"
    pipeline.ingest([str(FOUNDATION)], str(direct), workers=1)
    assert rows(db, "SELECT count(*) FROM lines") == rows(direct, "SELECT count(*) FROM lines")


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_bundle_expanding_past_the_limit_stops_cleanly(tmp_path, monkeypatch, kind):
    """A compression bomb (here 8 MB of zeros, 8 KB compressed) stops the extraction with a
    message; the members before it are ingested, the partial member is not left behind."""
    import io
    import zipfile

    monkeypatch.setenv("FORENSICS_MAX_EXTRACT_BYTES", str(4 << 20))
    bundle = tmp_path / f"run.{kind}"
    members = [("run/a.log", b"2025-01-01 00:00:00,000 INFO first file\n"), ("run/bomb.log", bytes(8 << 20)),
               ("run/z.log", b"after the bomb\n")]
    if kind == "zip":
        with zipfile.ZipFile(bundle, "w", zipfile.ZIP_DEFLATED) as zf:
            for name, data in members:
                zf.writestr(name, data)
    else:
        with tarfile.open(bundle, "w:gz") as tf:
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    assert bundle.stat().st_size < 100_000
    db = tmp_path / "b.duckdb"
    s = pipeline.ingest([str(bundle)], str(db), workers=1)
    said = [m for m in s.messages if "extraction stopped" in m]
    assert len(said) == 1 and "run/bomb.log" in said[0] and "FORENSICS_MAX_EXTRACT_BYTES" in said[0], s.messages
    assert rows(db, "SELECT path, lines FROM files") == [("run/a.log", 1)]


def test_bad_files_do_not_stop_ingest(tmp_path, monkeypatch):
    root = tmp_path / "logs"
    shutil.copytree(FOUNDATION, root)
    (root / "core.bin").write_bytes(b"\x7fELF\x02\x01\x01" + bytes(range(256)) * 10)
    secret = root / "secret.log"
    secret.write_text("you cannot read me\n")
    os.chmod(secret, 0)
    if os.geteuid() == 0:
        # root reads files whatever their mode: make the read fail the way it does for users
        from forensics import detect

        real = detect.read_head

        def read_head(path):
            if os.path.basename(path) == "secret.log":
                raise PermissionError(13, "Permission denied", path)
            return real(path)

        monkeypatch.setattr(detect, "read_head", read_head)
    db = tmp_path / "bad.duckdb"
    messages = "\n".join(pipeline.ingest([str(root)], str(db), workers=1).messages)
    assert "secret.log" in messages and "cannot read" in messages
    assert "core.bin" in messages and "binary" in messages
    got = dict(rows(db, "SELECT path, status FROM files"))
    assert got["core.bin"] == "skipped"
    assert got["secret.log"] == "skipped"
    assert got["empty.log"] == "skipped"
    assert got["driver.log"] == "ok"
    check_line_accounting(root, db)


@pytest.mark.parametrize("case", corpus_cases(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_corpus_line_accounting(case, ingested_corpus):
    db = ingested_corpus[case]
    assert check_line_accounting(case, db) > 0
    errors = rows(db, "SELECT path, message FROM files WHERE status = 'error' AND kind = 'text'")
    assert not errors


def test_corpus_ray_workers_have_actor_and_pid(corpus, ingested_corpus):
    seen = 0
    for case, db in ingested_corpus.items():
        for path, pid_file, actor, pids in rows(db, """
                SELECT f.path, f.pid, max(l.actor), list(DISTINCT l.pid)
                FROM files f JOIN lines l USING (file_id)
                WHERE f.format = 'ray_worker' GROUP BY ALL"""):
            text = (case / path).read_text(errors="replace")
            marker = [ln.split(":", 2)[2] for ln in text.splitlines() if ln.startswith((":actor_name:", ":task_name:"))]
            assert pids == [pid_file], path
            if marker:
                assert actor == marker[-1] or actor in marker, path
                seen += 1
    assert seen >= 10


def test_corpus_driver_prefixes(corpus, ingested_corpus):
    checked = 0
    for case, db in ingested_corpus.items():
        # (an NCCL or Ray C++ header names the process that wrote the line; it wins over the relay's pid)
        for text, actor, pid, node in rows(db, """
                SELECT text, actor, pid, node FROM log
                WHERE format = 'driver' AND text LIKE '%pid=%' AND text LIKE '%(%'
                  AND coalesce(header, '') NOT IN ('nccl', 'ray_cpp') LIMIT 200"""):
            import re

            m = re.match(r"^(?:\x1b\[[\d;]*m)*\((?:([\w.<>-]+) )?pid=(\d+)(?:, ip=([^)]+))?\)", text)
            if not m:
                continue
            assert pid == int(m.group(2)), text
            assert actor == m.group(1), text
            if m.group(3):
                assert node == m.group(3), text
            checked += 1
    assert checked > 500


def _console_metrics(path: Path) -> set[tuple[int, str]]:
    import re

    out = set()
    for line in path.read_text(errors="replace").splitlines():
        line = re.sub(r"\x1b\[[\d;]*m", "", line)
        m = re.search(r"(?:^|\) |\]:)step:(\d+) - (.*)$", line)
        if not m:
            continue
        for kv in m.group(2).split(" - "):
            key = kv.rsplit(":", 1)[0]
            out.add((int(m.group(1)), key))
    return out


def test_corpus_metrics_diverge(corpus, ingested_corpus):
    import json
    import math

    case = corpus / "real" / "diverge"
    db = ingested_corpus[case]
    expected = {}
    for line in (case / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        for k, v in rec.get("data", rec).items():
            if k != "step":
                expected[(rec["step"], k)] = v
    got = {(s, k): v for s, k, v in rows(db, "SELECT step, key, value FROM metrics WHERE source = 'jsonl'")}
    assert set(got) == set(expected)
    for key, v in expected.items():
        if isinstance(v, float) and math.isnan(v):
            assert math.isnan(got[key])
        else:
            assert got[key] == pytest.approx(v), key
    console = set(rows(db, "SELECT step, key FROM metrics WHERE source = 'console'"))
    assert console == _console_metrics(case / "console.log") and console


def test_corpus_metrics_ray_runs(corpus, ingested_corpus):
    for case, db in ingested_corpus.items():
        if case.parent.name != "real" or not case.name.startswith("ray-"):
            continue
        got = set(rows(db, "SELECT step, key FROM metrics m JOIN files f USING (file_id) WHERE f.path = 'driver.log'"))
        assert got == _console_metrics(case / "driver.log"), case.name


@pytest.mark.parametrize("env, value", [("FORENSICS_DB_MEMORY", "lots"), ("FORENSICS_DB_THREADS", "x"),
                                        ("FORENSICS_MAX_EXTRACT_BYTES", "1e9")])
def test_bad_settings_are_named(tmp_path, monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    bundle = tmp_path / "b.tar.gz"
    with tarfile.open(bundle, "w:gz") as tf:
        tf.add(FOUNDATION / "driver.log", arcname="driver.log")
    with pytest.raises(pipeline.IngestError, match=env):
        pipeline.ingest([str(bundle)], str(tmp_path / "s.duckdb"), workers=1)


def test_traceback_after_an_interrupted_progress_bar_is_one_event(tmp_path):
    """A crash in the middle of a tqdm bar prints the traceback header on the bar's line
    (after its last ``\\r`` redraw): the traceback is still one event, from that line to
    the exception."""
    log = tmp_path / "run" / "offline.log"
    log.parent.mkdir()
    log.write_bytes(
        b"INFO 11-30 01:07:00 [llm.py:100] Starting\n"
        b"\rRendering prompts:   0%|          | 0/2 [00:00<?, ?it/s]\rRendering prompts:  50%|#####     | 1/2"
        b" [00:00<00:00]Traceback (most recent call last):\n"
        b'  File "/w/off.py", line 10, in <module>\n'
        b"    outs = llm.generate(prompts)\n"
        b"           ^^^^^^^^^^^^^^^^^^^^^\n"
        b"ValueError: prompt is too long\n"
        b"INFO 11-30 01:07:01 [llm.py:120] after\n"
        b"text that merely mentions Traceback (most recent call last): and goes on\n"
    )
    db = tmp_path / "t.duckdb"
    pipeline.ingest([str(tmp_path / "run")], str(db), workers=1)
    got = rows(db, "SELECT line_no, event_line FROM lines ORDER BY line_no")
    assert got == [(1, None), (2, 2), (3, 2), (4, 2), (5, 2), (6, 2), (7, None), (8, None)]


def test_corpus_traceback_after_progress_bar(corpus, ingested_corpus):
    case = corpus / "real" / "vllm-prompt-too-long"
    if case not in ingested_corpus:
        pytest.skip("case absent")
    db = ingested_corpus[case]
    (start,) = rows(db, """SELECT l.line_no FROM lines l JOIN files f USING (file_id)
                          WHERE f.path = 'offline_llm.log' AND l.message LIKE '%Traceback (most recent call last):'""")[0]
    exc = rows(db, """SELECT l.line_no, l.event_line FROM lines l JOIN files f USING (file_id)
                      WHERE f.path = 'offline_llm.log' AND l.line_no > ? AND l.message NOT LIKE ' %'
                      ORDER BY l.line_no LIMIT 1""", [start])[0]
    assert exc[1] == start, "the exception line closes the traceback that began on the progress bar's line"
    assert rows(db, """SELECT count(*) FROM lines l JOIN files f USING (file_id)
                       WHERE f.path = 'offline_llm.log' AND l.line_no BETWEEN ? AND ? AND l.event_line IS DISTINCT FROM ?""",
                [start, exc[0], start]) == [(0,)]
