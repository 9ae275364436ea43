"""Generic timestamp headers (parsers/lines/headers.py): Python logging shapes and ISO stamps."""
from __future__ import annotations

import io
from datetime import datetime

from forensics.parsers.base import FileContext
from forensics.parsers.text import parse_text


def _lines(text: str):
    ctx = FileContext(file_id=1, path="app.log", size=len(text), fmt="text")
    frames = [f for name, f in parse_text(io.BytesIO(text.encode()), ctx) if name == "lines"]
    return frames[0].select("ts", "level", "logger", "message", "header").rows()


def test_offsets_are_moved_to_utc():
    rows = _lines("2025-03-14T18:02:11.345+08:00 east\n2025-03-14 05:02:11-0500 ERROR west\n2025-03-14T10:02:11.345Z zulu\n")
    assert [r[0] for r in rows] == [datetime(2025, 3, 14, 10, 2, 11, 345000), datetime(2025, 3, 14, 10, 2, 11),
                                    datetime(2025, 3, 14, 10, 2, 11, 345000)]
    assert [r[3] for r in rows] == ["east", "west", "zulu"]
    assert rows[1][1] == "ERROR"


def test_logger_name_or_source_location():
    rows = _lines("2025-03-14 10:02:11,345 INFO verl.trainer.main_ppo:375 - started\n"
                  "2025-03-14 10:02:12,000 - verl.workers - WARNING - slow\n"
                  "2025-03-14 10:02:13 INFO plain words here\n"
                  # `%(levelname)s %(process)d [%(filename)s:%(lineno)d]`: pid and source are header
                  "2025-03-14 10:02:14 ERROR 4127 [engine.py:88] RuntimeError: boom\n"
                  "2025-03-14 10:02:15 INFO [server.py:12] 7 requests waiting\n")
    assert [(r[1], r[2], r[3]) for r in rows] == [
        ("INFO", "verl.trainer.main_ppo:375", "started"),
        ("WARNING", "verl.workers", "slow"),
        ("INFO", None, "plain words here"),
        ("ERROR", "engine.py:88", "RuntimeError: boom"),
        ("INFO", "server.py:12", "7 requests waiting"),
    ]
    assert {r[4] for r in rows} == {"pylog"}


def test_a_verl_step_line_after_a_logging_header_keeps_its_step():
    """`step:3 - key:value - ...` right after the level looks like a `file:line -` source
    location; it is the start of verl's step line and stays in the message, so the line's
    metrics are read. A real source location before it is still taken."""
    text = ("2025-03-14 10:02:11,345 INFO step:3 - actor/grad_norm:0.25 - timing_s/gen:12.0\n"
            "2025-03-14 10:02:12,000 - verl - INFO - step:4 - actor/grad_norm:0.5\n"
            "2025-03-14 10:02:13,000 INFO main_ppo:375 - step:5 - actor/grad_norm:0.75\n")
    ctx = FileContext(file_id=1, path="app.log", size=len(text), fmt="text")
    frames = dict(parse_text(io.BytesIO(text.encode()), ctx))
    rows = frames["lines"].select("level", "logger", "message").rows()
    assert [r[1] for r in rows] == [None, "verl", "main_ppo:375"]
    assert [r[2].split(" - ")[0] for r in rows] == ["step:3", "step:4", "step:5"]
    got = frames["metrics"].select("line_no", "step", "key", "value").sort("line_no", "key").rows()
    assert got == [(1, 3, "actor/grad_norm", 0.25), (1, 3, "timing_s/gen", 12.0),
                   (2, 4, "actor/grad_norm", 0.5), (3, 5, "actor/grad_norm", 0.75)]



def test_syslog_stamp_with_the_month_of_a_cjk_locale():
    """journalctl under zh_CN / ja_JP prints `6月 10 16:45:05`, ko_KR `6월`: the same header
    as `Jun 10 16:45:05` (parsers/lines/kernel.py), so the traceback behind it is read."""
    text = ("6月 10 16:45:05 gpu-a bash[1074]: Traceback (most recent call last):\n"
            "6월 10 16:45:06 gpu-a bash[1074]:   File \"/opt/app/run.py\", line 3, in <module>\n")
    ctx = FileContext(file_id=1, path="journal.log", size=len(text.encode()), fmt="text")
    lines = dict(parse_text(io.BytesIO(text.encode()), ctx))["lines"]
    assert lines["node"].to_list() == ["gpu-a", "gpu-a"]
    assert [t.strftime("%m-%d %H:%M:%S") for t in lines["ts"]] == ["06-10 16:45:05", "06-10 16:45:06"]
    assert lines["message"][1].startswith('  File "/opt/app/run.py"')


def test_a_bracketed_level_and_logger_without_a_time():
    """ms-swift's / ModelScope's `[LEVEL:logger] msg`: level and logger; a bracket that is
    not a level (a list, a tag) is left in the message."""
    text = "[INFO:swift] Start time of running main\n[WARNING:swift] rank 3 exited\n[INFO:a b] no\n[0, 1] a list\n"
    ctx = FileContext(file_id=1, path="swift.log", size=len(text.encode()), fmt="text")
    rows = dict(parse_text(io.BytesIO(text.encode()), ctx))["lines"].sort("line_no").select("level", "logger", "message").rows()
    assert rows == [("INFO", "swift", "Start time of running main"), ("WARNING", "swift", "rank 3 exited"),
                    (None, None, "[INFO:a b] no"), (None, None, "[0, 1] a list")]


def test_no_break_spaces_of_a_web_page_copy_are_read_as_spaces():
    """A paste copied from a rendered page carries U+00A0 for some spaces: the header is read
    as with plain spaces; `text` keeps what was written."""
    rows = _lines("2025-03-14\u00a010:02:14\u00a0ERROR 4127 [engine.py:88]\u00a0 RuntimeError: boom\n")
    assert rows[0][1:5] == ("ERROR", "engine.py:88", "RuntimeError: boom", "pylog")


def test_areal_logger_records():
    """AReaL's `(AReaL) YYYYMMDD-HH:MM:SS.mmm name LEVEL: msg` (older releases without the tag,
    a logger name in brackets, merged.log's `[main]` source first, a markdown list's margin)."""
    text = ("(AReaL) 20260302-14:05:11.250 RemoteInfEngine INFO: waiting for server at 10.1.2.3:30000\n"
            "  (AReaL) 20260302-14:05:40.004 EngineBP ERROR: Engine method 'initialize' failed: bad wrap names\n"
            "20251102-08:10:00.117 [FSDPEngine Rank 2] WARNING: slow step\n"
            "[main]    (AReaL) 20260302-14:06:00.000 LocalScheduler ERROR: worker actor/1 exited\n"
            "20260302 not a record\n")
    ctx = FileContext(file_id=1, path="areal.log", size=len(text.encode()), fmt="text")
    lines = dict(parse_text(io.BytesIO(text.encode()), ctx))["lines"].sort("line_no")
    rows = lines.select("level", "logger", "message").rows()
    assert rows[:4] == [("INFO", "RemoteInfEngine", "waiting for server at 10.1.2.3:30000"),
                        ("ERROR", "EngineBP", "Engine method 'initialize' failed: bad wrap names"),
                        ("WARNING", "FSDPEngine Rank 2", "slow step"), ("ERROR", "LocalScheduler", "worker actor/1 exited")]
    assert rows[4] == (None, None, "20260302 not a record")
    assert lines["ts"][1] == datetime(2026, 3, 2, 14, 5, 40, 4000)
