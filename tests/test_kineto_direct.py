"""Kineto traces loaded by DuckDB's JSON reader (the direct path of the ingest) give the
same rows as the parser's own decoder, or are handed back to it."""
from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import duckdb
import pytest

from forensics import pipeline, store
from forensics.store import JsonRowsRefused, Store

from .conftest import FIXTURES

TRACES = FIXTURES / "kineto"
TINY = TRACES / "rank3.tiny.pt.trace.json"


@pytest.fixture
def outcomes(monkeypatch):
    """What each direct load came to: 'loaded' or 'refused' (wraps Store.insert_json_rows)."""
    seen: list[str] = []
    lock = threading.Lock()
    real = Store.insert_json_rows

    def watched(self, handed, con):
        try:
            n = real(self, handed, con)
        except JsonRowsRefused:
            with lock:
                seen.append("refused")
            raise
        with lock:
            seen.append("loaded")
        return n

    monkeypatch.setattr(Store, "insert_json_rows", watched)
    return seen


@pytest.fixture
def typed_reads(monkeypatch):
    """The ``typed`` of every SELECT the direct path made (wraps kineto.events_select)."""
    from forensics.parsers import kineto

    seen: list[bool] = []
    real = kineto.events_select

    def watched(array_path, lines_path, st, typed=False):
        seen.append(typed)
        return real(array_path, lines_path, st, typed)

    monkeypatch.setattr(kineto, "events_select", watched)
    return seen


def ingest_both(folder: Path, tmp_path: Path, monkeypatch, workers: int = 2) -> tuple[str, str]:
    """The folder ingested with the direct path and without it: the two databases."""
    dbs = []
    for mode in ("1", "0"):
        monkeypatch.setenv("FORENSICS_DIRECT", mode)
        db = tmp_path / f"direct{mode}.duckdb"
        pipeline.ingest([str(folder)], str(db), workers=workers)
        dbs.append(str(db))
    monkeypatch.delenv("FORENSICS_DIRECT")
    return dbs[0], dbs[1]


def differences(direct_db: str, usual_db: str) -> dict[str, int]:
    """Rows that differ between the two databases, per table (``args`` compared as JSON
    values: the direct path stores DuckDB's compact rendering)."""
    con = duckdb.connect(direct_db, read_only=True)
    con.execute(f"ATTACH '{usual_db}' AS u (READ_ONLY)")
    cols = [c for (c,) in con.execute(
        "SELECT column_name FROM duckdb_columns() WHERE database_name = 'u' AND table_name = 'trace_events' "
        "ORDER BY column_index").fetchall()]
    same = " AND ".join(f"d.{c} IS NOT DISTINCT FROM u.{c}" for c in cols if c != "args")
    out = {"trace_events": con.execute(
        f"""SELECT count(*) FROM trace_events d FULL JOIN u.trace_events u ON d.file_id = u.file_id AND d.seq = u.seq
            WHERE NOT ({same} AND json(d.args) IS NOT DISTINCT FROM json(u.args))""").fetchone()[0]}
    for table, drop in (("trace_meta", ""), ("problems", ""), ("files", " EXCLUDE (ingested_at)")):
        out[table] = con.execute(
            f"SELECT count(*) FROM ((SELECT *{drop} FROM {table} EXCEPT ALL SELECT *{drop} FROM u.{table}) "
            f"UNION ALL (SELECT *{drop} FROM u.{table} EXCEPT ALL SELECT *{drop} FROM {table}))").fetchone()[0]
    con.close()
    return out


NO_DIFFERENCE = {"trace_events": 0, "trace_meta": 0, "problems": 0, "files": 0}


def trace_with(events: list[dict] | None = None, *, text: bytes | None = None, name: str = "rank3.x.pt.trace.json",
               folder: Path) -> Path:
    """The tiny fixture trace with its events replaced (by ``events`` written the way
    Kineto writes them, or by ``text`` as it is)."""
    data = TINY.read_bytes()
    start = data.index(b"[", data.index(b'"traceEvents"'))
    end = data.rindex(b"]", 0, data.rindex(b'"traceName"'))
    if events is not None:
        text = b",\n  ".join(json.dumps(e).encode() for e in events)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(data[: start + 1] + b"\n  " + text + b"\n  " + data[end:])
    return path


def tiny_events() -> list[dict]:
    return json.loads(TINY.read_bytes())["traceEvents"]


def test_fixture_traces_load_directly_with_the_decoders_rows(tmp_path, monkeypatch, outcomes):
    folder = tmp_path / "prof"
    folder.mkdir()
    for f in (TINY, TRACES / "prof_rank-2.json"):
        shutil.copy(f, folder / f.name)
    direct_db, usual_db = ingest_both(folder, tmp_path, monkeypatch)
    assert outcomes == ["loaded", "loaded"]
    assert differences(direct_db, usual_db) == NO_DIFFERENCE
    con = duckdb.connect(direct_db, read_only=True)
    # old Kineto's "external id", epoch timestamps, GPU device/stream from pid/tid, line numbers
    assert con.execute("SELECT count(*) FROM trace_events WHERE external_id IS NOT NULL AND rank = 2").fetchone()[0] == 2
    assert con.execute("SELECT count(*) FROM trace_events WHERE line_no IS NULL").fetchone()[0] == 0
    assert con.execute("SELECT sum(event_count) FROM trace_meta").fetchone()[0] == 15 + 3


def test_the_switch_turns_the_direct_path_off(tmp_path, monkeypatch, outcomes):
    monkeypatch.setenv("FORENSICS_DIRECT", "0")
    pipeline.ingest([str(TINY)], str(tmp_path / "x.duckdb"), workers=1)
    assert outcomes == []


@pytest.mark.parametrize("layout, outcome", [
    ("minified", "loaded"),
    # events separated by `}, {`, which one event's name also holds: one start too many
    ("one line", "refused"),
    ("brackets after the events", "loaded"),
])
def test_other_layouts(layout, outcome, tmp_path, monkeypatch, outcomes):
    folder = tmp_path / "prof"
    folder.mkdir()
    doc = json.loads(TINY.read_bytes())
    if layout == "minified":
        text = json.dumps(doc, separators=(",", ":"))
    elif layout == "one line":
        text = json.dumps(doc)
    else:  # keys with `]` and `}` in them and in their values after the event array
        doc["traceName"] = "/runs/a]b}/rank3.pt.trace.json"
        doc["late"] = [1, {"x": "]}"}, []]
        text = json.dumps(doc, indent=2)
    (folder / "rank3.pt.trace.json").write_text(text)
    direct_db, usual_db = ingest_both(folder, tmp_path, monkeypatch)
    assert outcomes == [outcome]
    assert differences(direct_db, usual_db) == NO_DIFFERENCE


FINE = {"ph": "X", "cat": "cpu_op", "name": "fine", "pid": 1, "tid": 2, "ts": 1.0, "dur": 2.0, "args": {"External id": 1}}


# Events that the direct path must load with the decoder's rows ("loaded"), or hand back
# to it ("refused"). typed: whether the top-level fields can still be read with their own
# types (TypedFields); when not, the SELECT's checks find the odd field.
@pytest.mark.parametrize("event, typed, outcome", [
    ({"ph": "X", "ts": "1.5"}, False, "refused"),  # a number as text
    ({"ph": "X", "dur": True}, False, "refused"),
    ({"ph": "X", "ts": None, "dur": "x"}, False, "refused"),
    ({"ph": "X", "id": 1.0}, True, "refused"),  # a fraction for an integer
    ({"ph": "X", "id": 1e3}, True, "refused"),
    ({"ph": "X", "args": {"External id": 5.5}}, True, "refused"),
    ({"ph": "X", "args": {"External id": "5"}}, True, "refused"),
    ({"ph": "X", "args": {"device": 2 ** 31}}, True, "refused"),  # beyond 32 bits
    ({"ph": "X", "args": {"correlation": 2 ** 63}}, True, "refused"),  # beyond 64 bits
    ({"ph": "X", "args": {"Collective name": 5}}, True, "refused"),
    ({"ph": "X", "args": {"external id": 2.5}}, True, "refused"),
    ({"ph": "X", "args": [1]}, True, "refused"),
    ({"ph": "X", "name": 3}, False, "refused"),
    ({"ph": "X", "name": ["a"]}, False, "refused"),
    ({"ph": "X", "cat": {"a": 1}}, False, "refused"),
    ({"ph": 1}, False, "refused"),
    ({"ph": "X", "pid": True}, False, "refused"),
    ({"ph": "X", "pid": 1.5}, False, "refused"),  # fine for the decoder, written as it writes it
    ({"ph": "X", "tid": 1e3}, False, "refused"),
    ({"ph": "X", "tid": 2 ** 63}, False, "refused"),
    ({"ph": "X", "pid": -0.0}, False, "refused"),
    ({}, True, "refused"),  # nothing the reader reads: cannot be told from a missing row
    ({"s": "g"}, True, "refused"),
    ({"ph": "X", "name": None, "cat": None, "ts": None, "dur": None, "pid": None, "tid": None}, True, "loaded"),
    ({"ph": "X", "name": "", "pid": "Spans", "tid": "PyTorch Profiler", "ts": -1.5, "dur": 0}, True, "loaded"),
    ({"ph": "X", "cat": "kernel", "pid": 0, "tid": 7, "ts": 1.5e3, "dur": 12, "name": "ncclDevKernel_AllReduce"}, True, "loaded"),
    ({"ph": "X", "cat": "kernel", "pid": "3", "tid": "stream 7", "ts": 2, "name": "k"}, True, "loaded"),
    ({"ph": "X", "cat": "kernel", "pid": -1, "tid": -2, "ts": 2, "name": "Activity Buffer Request"}, True, "loaded"),
    ({"ph": "X", "cat": "cpu_op", "pid": "-4", "tid": -999999999999999999, "ts": 2}, True, "loaded"),
    ({"ph": "X", "cat": "gpu_memcpy", "pid": 10 ** 17, "tid": 999999999999999999, "ts": 123456789012.125}, True, "loaded"),
    ({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}}, True, "loaded"),
    ({"ph": "f", "id": 7, "pid": 1, "tid": 2, "ts": 3.25, "cat": "ac2g", "name": "ac2g", "bp": "e"}, True, "loaded"),
])
def test_events_of_every_type_give_the_decoders_rows(event, typed, outcome, tmp_path, monkeypatch, outcomes, typed_reads):
    trace_with([FINE, event, FINE], folder=tmp_path / "prof")
    direct_db, usual_db = ingest_both(tmp_path / "prof", tmp_path, monkeypatch)
    assert typed_reads == [typed]
    assert outcomes == [outcome]
    assert differences(direct_db, usual_db) == NO_DIFFERENCE


@pytest.mark.parametrize("text, typed", [
    (b'{"ph": "X", "name": "a", "ts": 1.5, "pid": 1, "tid": "t"}', True),
    (b'{"ph":"X","name":"a","ts":1.5,"pid":1}', True),  # minified
    (b'{"ph": "X", "name": null, "ts": null, "pid": null}', True),
    (b'{"ph": "X", "name" : "a"}', False),  # white space before a colon
    (b'{"ph": "X", "name":  "a"}', False),  # more than one space after it
    (b'{"ph": "X", "name":\n "a"}', False),
    (b'{"ph": "X", "name": nul}', False),
    (b'{"ph": "X", "name": "a\\u0062"}', False),  # any backslash
    (b'{"ph": "X", "ts": -Infinity}', False),
    (b'{"ph": "X", "ts": NaN}', False),
    (b'{"ph": "X", "ts": true}', False),
    (b'{"ph": "X", "dur": "1"}', False),
    (b'{"ph": "X", "pid": 12.0}', False),
    (b'{"ph": "X", "tid": 1E3}', False),
    (b'{"ph": "X", "pid": 1234567890123456789}', False),
    (b'{"ph": "X", "pid": -1, "tid": -123}', True),  # Kineto's pid of its "Activity Buffer Request" events
    (b'{"ph": "X", "pid": -0}', False),
    (b'{"ph": "X", "pid": -a}', False),
    (b'{"ph": "X", "tid": -1.5}', False),
    (b'{"ph": "X", "tid": -1234567890123456789}', False),
    (b'{"ph": "X", "cat": false}', False),
    (b'{"ph": "X", "name"' + b" " * 70 + b': 5}', False),  # a long run of white space, wherever the cut
    (b'{"ph": "X", "args": {"name": 5}}', False),  # nested keys count too (only costs the typed read)
    (b'{"ph": "X", "args": {"Collective name": 5, "graph": 1, "cats": 2}}', True),  # other keys do not
])
def test_typed_fields_are_told_from_the_bytes_at_any_cut(text, typed):
    from forensics.parsers.kineto import TypedFields

    doc = b"[\n  " + b",\n  ".join([text] * 3) + b"\n]"
    for cut in range(len(doc) + 1):
        check = TypedFields()
        check.feed(doc[:cut])
        check.feed(memoryview(doc)[cut:])
        assert check.close() is typed, (cut, doc)
    check = TypedFields()
    for i in range(len(doc)):  # a byte at a time
        check.feed(doc[i:i + 1])
    assert check.close() is typed


def test_typed_fields_give_up_on_white_space_they_cannot_keep():
    from forensics.parsers.kineto import TypedFields

    check = TypedFields()
    check.feed(b'[{"ph": "X", "name"' + b" " * 5000)  # the colon may come in the next piece
    check.feed(b': 5}]')
    assert check.close() is False


@pytest.mark.parametrize("text", [
    b'{"ph": "X", "name": "a"},\n  null,\n  {"ph": "X", "name": "b"}',  # an element that is not an object
    b'{"ph": "X", "name": "a"},\n  7,\n  {"ph": "X", "name": "b"}',
    b'{"ph": "X", "name": "a"},{"ph": "X", "name": "b"},\n  {"ph": "X", "name": "c"}',  # separators that differ
    b'{"ph": "X", "name": "a", "name": "b"}',  # a key twice
    b'{"ph": "X", "name": "caf\xe9"}',  # not UTF-8
    b'{"ph": "X", "ts": NaN, "name": "nan"},\n  {"ph": "X", "name": "b"}',
])
def test_what_the_reader_cannot_count_goes_back_to_the_decoder(text, tmp_path, monkeypatch, outcomes):
    trace_with(text=text, folder=tmp_path / "prof")
    direct_db, usual_db = ingest_both(tmp_path / "prof", tmp_path, monkeypatch)
    assert differences(direct_db, usual_db) == NO_DIFFERENCE
    assert outcomes in (["refused"], ["loaded"])  # loaded only when the rows came out the same (NaN)


def test_escapes_and_unicode_load_directly(tmp_path, monkeypatch, outcomes):
    events = [FINE, {"ph": "X", "name": "naïve \"quoted\" \\ tab\t ✓", "cat": "user_annotation", "pid": "Spans",
                     "tid": "PyTorch Profiler", "ts": 3.5, "args": {"note": "é", "Process Group Description": "dp ✓"}}]
    path = trace_with(events, folder=tmp_path / "prof")
    path.write_bytes(path.read_bytes().replace(b'"ph": "X", "name": "fine"', b'"\\u0070h": "X", "name": "fine"', 1))
    direct_db, usual_db = ingest_both(tmp_path / "prof", tmp_path, monkeypatch)
    assert outcomes == ["loaded"]
    assert differences(direct_db, usual_db) == NO_DIFFERENCE


@pytest.mark.parametrize("cut", [0.3, 0.999])
def test_a_trace_cut_off_goes_to_the_decoder_whole(cut, tmp_path, monkeypatch, outcomes):
    data = TINY.read_bytes()
    folder = tmp_path / "prof"
    folder.mkdir()
    (folder / "rank3.cut.pt.trace.json").write_bytes(data[: int(len(data) * cut)])
    direct_db, usual_db = ingest_both(folder, tmp_path, monkeypatch)
    assert outcomes == []  # the parser saw the cut itself and decoded the copy
    assert differences(direct_db, usual_db) == NO_DIFFERENCE
    con = duckdb.connect(direct_db, read_only=True)
    assert con.execute("SELECT truncated FROM files").fetchone()[0] is True
    assert list(Path(tmp_path).glob("**/events-*")) == []


def test_many_traces_and_text_files_together(tmp_path, monkeypatch, outcomes):
    folder = tmp_path / "run"
    (folder / "prof").mkdir(parents=True)
    for i in range(5):
        shutil.copy(TINY, folder / "prof" / f"rank{i}.{i}.pt.trace.json")
    for i in range(3):
        (folder / f"worker-{i}.log").write_text(f"INFO step {i}\nERROR something {i}\n")
    direct_db, usual_db = ingest_both(folder, tmp_path, monkeypatch, workers=2)
    assert outcomes == ["loaded"] * 5
    assert differences(direct_db, usual_db) == NO_DIFFERENCE
    con = duckdb.connect(direct_db, read_only=True)
    assert con.execute("SELECT count(*), count(DISTINCT rank) FROM trace_events").fetchone() == (75, 1)
    assert con.execute("SELECT count(*) FROM lines").fetchone()[0] == 6


def test_a_parser_failure_on_the_direct_path_fails_only_that_file(tmp_path, monkeypatch):
    from forensics.parsers import kineto

    def broken(*args, **kwargs):
        raise RuntimeError("spool bug")

    monkeypatch.setattr(kineto, "spool_events", broken)
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copy(TINY, folder / TINY.name)
    (folder / "app.log").write_text("hello\n")
    summary = pipeline.ingest([str(folder)], str(tmp_path / "x.duckdb"), workers=1)
    con = duckdb.connect(str(tmp_path / "x.duckdb"), read_only=True)
    assert con.execute("SELECT path, status FROM files ORDER BY path").fetchall() == [
        ("app.log", "ok"), (TINY.name, "error")]
    assert any("spool bug" in m for m in summary.messages)


def test_reingesting_a_changed_trace_replaces_its_rows(tmp_path, monkeypatch, outcomes):
    folder = tmp_path / "prof"
    path = trace_with(tiny_events(), folder=folder)
    db = str(tmp_path / "x.duckdb")
    pipeline.ingest([str(folder)], db, workers=1)
    trace_with(tiny_events()[:4], folder=folder, name=path.name)
    pipeline.ingest([str(folder)], db, workers=1)
    con = duckdb.connect(db, read_only=True)
    assert con.execute("SELECT count(*) FROM trace_events").fetchone()[0] == 4
    assert con.execute("SELECT count(*) FROM files").fetchone()[0] == 1
    assert outcomes == ["loaded"]  # the second time through the decoder: the old rows go in the same transaction


# -- new databases start from a cached empty one --------------------------------------------

def _views(db: str) -> list[tuple]:
    con = duckdb.connect(db, read_only=True)
    try:
        return con.execute("SELECT view_name, sql FROM duckdb_views() WHERE NOT internal ORDER BY view_name").fetchall()
    finally:
        con.close()


def test_new_database_is_a_copy_of_the_cached_empty_one(tmp_path, monkeypatch):
    monkeypatch.setenv("FORENSICS_CACHE", str(tmp_path / "cache"))
    Store(str(tmp_path / "a.duckdb")).close()
    template = Path(store.template_path())
    assert template.is_file() and template.parent == tmp_path / "cache"
    built = template.stat().st_mtime_ns
    Store(str(tmp_path / "b.duckdb")).close()
    assert template.stat().st_mtime_ns == built  # used, not built again
    Store(str(tmp_path / "c.duckdb"), _template=False).close()
    assert _views(str(tmp_path / "b.duckdb")) == _views(str(tmp_path / "c.duckdb")) != []
    assert list((tmp_path / "cache").iterdir()) == [template]  # no leftovers of the build


def test_building_a_cached_copy_prunes_old_ones(tmp_path, monkeypatch):
    """Other schemas' and DuckDB versions' empty databases: the newest few are kept, and a
    build left by a process that died long ago is removed; a recent build is not."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("FORENSICS_CACHE", str(cache))
    now = time.time()
    old = []
    for i in range(store.KEEP_TEMPLATES + 2):  # empty-0 is the newest
        p = cache / f"empty-{i:020d}-duckdb0.{i}.duckdb"
        p.write_bytes(b"x")
        os.utime(p, (now - 100 * (i + 1), now - 100 * (i + 1)))
        old.append(p)
    dead, busy = cache / "empty-dead.duckdb.1.2.tmp", cache / "empty-busy.duckdb.3.4.tmp"
    for p, age in ((dead, 2 * store._STALE_BUILD_S), (busy, 10)):
        p.write_bytes(b"x")
        os.utime(p, (now - age, now - age))
    unrelated = cache / "notes.txt"
    unrelated.write_text("mine")
    Store(str(tmp_path / "a.duckdb")).close()
    left = {p.name for p in cache.iterdir()}
    assert left == {Path(store.template_path()).name, busy.name, unrelated.name,
                    *(p.name for p in old[: store.KEEP_TEMPLATES - 1])}
    Store(str(tmp_path / "b.duckdb")).close()  # a copy made from the cache prunes nothing
    assert {p.name for p in cache.iterdir()} == left


def test_a_cache_that_cannot_be_written_only_costs_time(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("FORENSICS_CACHE", str(blocker / "cache"))
    Store(str(tmp_path / "a.duckdb")).close()
    Store(str(tmp_path / "b.duckdb"), _template=False).close()
    assert _views(str(tmp_path / "a.duckdb")) == _views(str(tmp_path / "b.duckdb")) != []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.duckdb", "b.duckdb", "not-a-folder"]
    # the views are then made while traces load on other cursors
    folder = tmp_path / "prof"
    folder.mkdir()
    for i in range(3):
        shutil.copy(TINY, folder / f"rank{i}.pt.trace.json")
    pipeline.ingest([str(folder)], str(tmp_path / "c.duckdb"), workers=2)
    assert _views(str(tmp_path / "c.duckdb")) == _views(str(tmp_path / "a.duckdb"))
    con = duckdb.connect(str(tmp_path / "c.duckdb"), read_only=True)
    assert con.execute("SELECT count(*) FROM trace_events").fetchone()[0] == 45
    assert con.execute("SELECT count(*) FROM _phase_trace").fetchone()[0] == 45  # a view over the loaded rows


def test_a_damaged_cached_copy_is_dropped_and_made_again(tmp_path, monkeypatch):
    monkeypatch.setenv("FORENSICS_CACHE", str(tmp_path / "cache"))
    Store(str(tmp_path / "a.duckdb")).close()
    Path(store.template_path()).write_bytes(b"not a database" * 100)
    Store(str(tmp_path / "b.duckdb")).close()
    Store(str(tmp_path / "c.duckdb")).close()  # a new cached copy, whole again
    assert _views(str(tmp_path / "b.duckdb")) == _views(str(tmp_path / "c.duckdb")) == _views(str(tmp_path / "a.duckdb"))


def test_a_database_made_meanwhile_is_not_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("FORENSICS_CACHE", str(tmp_path / "cache"))
    Store(str(tmp_path / "a.duckdb")).close()
    target = tmp_path / "b.duckdb"
    real_copy = shutil.copyfile

    def copy_then_race(src, dst):  # another process creates the database during the copy
        out = real_copy(src, dst)
        target.write_bytes(b"theirs")
        return out

    monkeypatch.setattr(store.shutil, "copyfile", copy_then_race)
    with pytest.raises(store.StoreError):
        Store(str(target))  # theirs is not a database: opened as it is, and refused
    assert target.read_bytes() == b"theirs"
    assert not list(tmp_path.glob("*.forensics-new"))


def test_an_interrupted_load_is_not_taken_for_a_refusal(tmp_path):
    from forensics.parsers.base import JsonArrayRows

    class Stopped:
        def execute(self, *args):
            raise duckdb.InterruptException("INTERRUPT Error: Interrupted!")

    class Broken:
        def execute(self, *args):
            raise duckdb.InvalidInputException("Invalid Input Error: malformed JSON")

    st = Store(str(tmp_path / "x.duckdb"))
    handed = JsonArrayRows("trace_events", "a.json", "a.parquet", 1, "SELECT 1 AS ok")
    with pytest.raises(duckdb.InterruptException):
        st.insert_json_rows(handed, Stopped())
    with pytest.raises(JsonRowsRefused, match="malformed JSON"):
        st.insert_json_rows(handed, Broken())
    st.close()


def _direct_task(trace: Path) -> pipeline.FileTask:
    from forensics import detect

    d = detect.detect(str(trace), trace.name, trace.stat().st_size)
    assert d.format == "kineto_trace"
    return pipeline.FileTask(1, str(trace.parent), trace.name, str(trace), trace.stat().st_size, 0.0, d)


@pytest.mark.parametrize("stop_after", [0, 2, "insert"])
def test_a_stopped_direct_load_keeps_nothing(tmp_path, monkeypatch, stop_after):
    """Ctrl-C during a direct load: the copy stops at its next window (0: before the
    first; 2: after two), or no insert starts once it is done; nothing is committed and
    nothing is left in the spool."""
    from forensics.parsers import kineto
    from forensics.parsers.base import Stopped

    src = tmp_path / "in" / "rank0.big.pt.trace.json"
    src.parent.mkdir()
    events = json.loads(TINY.read_text())["traceEvents"]
    src.write_text(json.dumps({"traceEvents": events * 2000}, indent=1))  # beyond the parser's first read
    monkeypatch.setattr(kineto, "SPOOL_READ", 4096)  # many windows
    asked = []

    def stopping() -> bool:
        caller = sys._getframe(1).f_globals["__name__"]
        asked.append(caller)
        if stop_after == "insert":  # only once the copy is done: the pipeline's checks
            return caller == "forensics.pipeline"
        return len(asked) > stop_after

    spool = tmp_path / "spool"
    spool.mkdir()
    st = Store(str(tmp_path / "x.duckdb"))
    cur = st.con.cursor()
    with pytest.raises(Stopped):
        pipeline.run_direct([_direct_task(src)], str(spool), False, st, cur, stopping)
    cur.close()
    assert list(spool.iterdir()) == []
    assert st.con.execute("SELECT (SELECT count(*) FROM trace_events), (SELECT count(*) FROM files)").fetchone() == (0, 0)
    if stop_after == "insert":
        assert asked.count("forensics.parsers.kineto") > 2 and asked[-1] == "forensics.pipeline"  # copied, then stopped
    else:
        assert asked == ["forensics.parsers.kineto"] * (stop_after + 1)  # stopped at the first check that said so
    st.close()


def test_a_direct_load_not_stopped_is_whole(tmp_path):
    src = tmp_path / "in" / TINY.name
    src.parent.mkdir()
    shutil.copy(TINY, src)
    spool = tmp_path / "spool"
    spool.mkdir()
    st = Store(str(tmp_path / "x.duckdb"))
    cur = st.con.cursor()
    res = pipeline.run_direct([_direct_task(src)], str(spool), False, st, cur, lambda: False)
    cur.close()
    assert res.loaded is not None and res.loaded.rows_added["trace_events"] == 15
    assert st.con.execute("SELECT (SELECT count(*) FROM trace_events), (SELECT count(*) FROM files)").fetchone() == (15, 1)
    st.close()


def test_pruning_an_unlistable_cache_does_not_stop_the_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("FORENSICS_CACHE", str(tmp_path / "cache"))

    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(store.os, "scandir", refuse)
    assert store._prune_templates(str(tmp_path / "cache" / "empty-x.duckdb")) == []
    assert store._start_from_template(str(tmp_path / "a.duckdb"))  # built, pruned nothing, copied
    Store(str(tmp_path / "a.duckdb")).close()
    Store(str(tmp_path / "b.duckdb"), _template=False).close()
    assert _views(str(tmp_path / "a.duckdb")) == _views(str(tmp_path / "b.duckdb")) != []
    assert Path(store.template_path()).is_file()
