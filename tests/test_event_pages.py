"""The fatal events reach the exception rules a range of files at a time
(matching._events): the hits are the same whatever the range size."""
import shutil
from pathlib import Path

import duckdb

import forensics
from forensics import catalogue as sig
from forensics.diagnosis import ensure_views, matching

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _hits(db: str):
    con = duckdb.connect(db, read_only=True)
    try:
        ensure_views(con)
        return [(h.rule.id, h.file_id, h.line_no, h.event_line, h.message, sorted(h.groups.items()), h.event)
                for h in matching.event_hits(con, sig.load(()))]
    finally:
        con.close()


def test_event_hits_do_not_depend_on_the_page_size(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    for name in ("diag_app_error_reward_keyerror", "diag_oom_train_torchrun", "diag_capture_segfault", "diag_xid79_cascade"):
        shutil.copytree(FIXTURES / name, logs / name, ignore=shutil.ignore_patterns("expected.json"))
    db = str(tmp_path / "e.duckdb")
    forensics.ingest(str(logs), db=db, workers=1).close()
    whole = _hits(db)
    assert len({h[1] for h in whole}) >= 3, whole  # events in several files
    monkeypatch.setattr(matching, "EVENT_PAGE", 1)
    con = duckdb.connect(db, read_only=True)
    pages = matching._event_pages(con)
    con.close()
    assert len(pages) >= 3 and all(lo <= hi for lo, hi in pages)
    assert all(a[1] < b[0] for a, b in zip(pages, pages[1:]))  # in file order, no file twice
    assert _hits(db) == whole
