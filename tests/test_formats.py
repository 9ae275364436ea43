"""Formats describe themselves (parsers/registry.py): what the registry finds, in what
order it tries and runs them, and a format that another package adds through the entry
point group ``forensics.formats``, ingested for real."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import EntryPoint
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from forensics import detect
from forensics.parsers import registry
from forensics.parsers.base import FILE_ID, LINE_NO, Format, LineFormat, Sniff, Table, col
from forensics.parsers.lines.verl_metrics import METRICS

REPO = Path(__file__).resolve().parent.parent

# -- the package a third party would write: a .tinylog format and a line format ----------

TINYLOG_PACKAGE = '''
"""A made-up format: ``TINY1`` on the first line, then ``key=value`` records."""
import os

import polars as pl
import pyarrow as pa

from forensics.parsers.base import FILE_ID, LINE_NO, Format, LineFormat, Sniff, Table, col

TINY_EVENTS = Table("tiny_events", "Records of .tinylog files.", (
    FILE_ID, LINE_NO,
    col("key", pa.string(), "Record key."),
    col("value", pa.int64(), "Record value."),
    col("parsed_by", pa.int64(), "Process that parsed the file."),
))

TINY_MARKS = Table("tiny_marks", "TINYMARK lines of any text log.", (
    FILE_ID, LINE_NO, col("mark", pa.string(), "What follows TINYMARK."),
))


def parse(stream, ctx):
    rows = []
    lines = stream.read().decode().splitlines()
    for n, line in enumerate(lines[1:], 2):
        key, _, value = line.partition("=")
        rows.append({"file_id": ctx.file_id, "line_no": n, "key": key, "value": int(value), "parsed_by": os.getpid()})
    ctx.lines = len(lines)
    yield "tiny_events", pl.DataFrame(rows, schema=TINY_EVENTS.polars_schema)


def annotate(df, ctx):
    is_mark = pl.col("message").str.starts_with("TINYMARK ")
    marks = df.filter(is_mark).select("file_id", "line_no", pl.col("message").str.slice(9).alias("mark"))
    df = df.with_columns(pl.when(is_mark).then(pl.lit("tiny")).otherwise(pl.col("header")).alias("header"))
    return df, {"tiny_marks": marks}


FORMATS = (
    Format("tinylog", "structured", parse=parse, tables=(TINY_EVENTS,),
           sniff=Sniff(850, lambda h: h.data.startswith(b"TINY1\\n"))),
    LineFormat("tiny_marks", 85, annotate, tables=(TINY_MARKS,)),
    # a kind of text log: read by forensics' text splitter, known by its name
    Format("tinytext", "text", sniff=Sniff(320, lambda h: h.name.endswith(".tinytext"))),
)
'''


def _distribution(site: Path, entry_points: str) -> None:
    """A package ``tinylog_fmt`` and its installed metadata (a ``.dist-info`` folder, as
    pip leaves it) in the folder ``site``."""
    (site / "tinylog_fmt").mkdir(parents=True)
    (site / "tinylog_fmt" / "__init__.py").write_text(TINYLOG_PACKAGE)
    info = site / "tinylog_fmt-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tinylog-fmt\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    (info / "RECORD").write_text("")


def test_a_format_from_another_package_is_ingested(tmp_path):
    """A distribution on the path declares, through the entry point, a structured format,
    a kind of text log and a line format; a fresh process ingests a folder with the real pipeline and its parser processes
    (which find the format on their own); a second entry point that does not load is
    reported and leaves the rest working."""
    site = tmp_path / "site"
    _distribution(site, """
        [forensics.formats]
        tinylog = tinylog_fmt
        broken = tinylog_fmt_missing
    """)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "run.tinylog").write_text("TINY1\nalpha=1\nbeta=22\n")
    (logs / "train.log").write_text("step one\nTINYMARK checkpoint saved\nstep two\n")
    (logs / "notes.tinytext").write_text("TINYMARK from a tinytext file\n")
    db = tmp_path / "run.duckdb"
    code = (
        "import json, os, sys\n"
        "from forensics import pipeline\n"
        "s = pipeline.ingest([sys.argv[1]], sys.argv[2], workers=2)\n"
        "print(json.dumps({'pid': os.getpid(), 'messages': s.messages}))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               FORENSICS_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code, str(logs), str(db)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    broken = [m for m in out["messages"] if "'broken'" in m]
    assert len(broken) == 1 and "tinylog_fmt_missing" in broken[0] and "ModuleNotFoundError" in broken[0], out["messages"]

    con = duckdb.connect(str(db), read_only=True)
    files = dict((p, (f, k, s)) for p, f, k, s in con.execute("SELECT path, format, kind, status FROM files").fetchall())
    assert files == {"run.tinylog": ("tinylog", "structured", "ok"), "train.log": ("text", "text", "ok"),
                     "notes.tinytext": ("tinytext", "text", "ok")}
    rows = con.execute("SELECT line_no, key, value, parsed_by FROM tiny_events ORDER BY line_no").fetchall()
    assert [r[:3] for r in rows] == [(2, "alpha", 1), (3, "beta", 22)]
    assert rows[0][3] != out["pid"]  # parsed in a parser process, which found the format itself
    marks = con.execute("SELECT path, line_no, mark FROM tiny_marks JOIN files USING (file_id) ORDER BY path").fetchall()
    assert marks == [("notes.tinytext", 1, "from a tinytext file"), ("train.log", 2, "checkpoint saved")]
    assert con.execute("SELECT line_no, header FROM lines JOIN files USING (file_id) WHERE path = 'train.log' ORDER BY line_no"
                       ).fetchall() == [(1, None), (2, "tiny"), (3, None)]
    con.close()


# -- the registry itself, with entry points made up in this process ------------------------

THIRD = Table("third_rows", "A third party's table.", (FILE_ID, LINE_NO, col("what", pa.string(), "What.")))


def _parse_nothing(stream, ctx):
    return iter(())


def _annotate_nothing(df, ctx):
    return df, {}


THIRD_FORMAT = Format("third", "structured", parse=_parse_nothing, tables=(THIRD, METRICS),
                      sniff=Sniff(450, lambda h: h.data.startswith(b"THIRD")))
THIRD_LINES = LineFormat("third_lines", 85, _annotate_nothing)
NAMED_TEXT = (Format("text", "text", sniff=Sniff(1, lambda h: False)),)  # a name that is ours
OTHER_METRICS = (LineFormat("other_metrics", 1, _annotate_nothing,
                            tables=(Table("metrics", "Not ours.", (FILE_ID, col("x", pa.int32(), "X."))),)),)
NOT_A_FORMAT = 42
OWN_TEXT_PARSER = Format("own_text", "text", parse=_parse_nothing, sniff=Sniff(1, lambda h: False))


@pytest.fixture
def entry_points(monkeypatch):
    """Set the entry points the registry sees (``name=value`` of this module's objects);
    the registry of the real ones is found again afterwards."""
    def use(**targets: str) -> registry.Registry:
        eps = [EntryPoint(name, f"{__name__}:{value}", registry.ENTRY_POINT_GROUP) for name, value in targets.items()]
        monkeypatch.setattr(registry, "_entry_points", lambda: eps)
        registry.registry.cache_clear()
        return registry.registry()

    yield use
    registry.registry.cache_clear()


def test_declarations_join_by_priority_and_order(entry_points):
    reg = entry_points(third="THIRD_FORMAT", lines="THIRD_LINES")
    assert reg.problems == ()
    names = [lf.name for lf in reg.line_formats]
    assert names.index("headers") < names.index("third_lines") < names.index("verl_metrics")  # order 80 < 85 < 90
    assert registry.parser_for("third") is _parse_nothing
    tables = [t.name for t in reg.tables]
    assert tables.count("metrics") == 1 and tables[-1] == "third_rows"  # the same METRICS declared twice is one table
    assert "third_rows" not in [t.name for t in registry.all_tables(builtin_only=True)]
    # priority 450: above Ray's file names (400), below the binary check (500)
    assert detect.sniff("logs/raylet.out", b"THIRD\nhello\n").format == "third"
    assert detect.sniff("logs/raylet.out", b"hello\n").format == "ray_raylet"
    assert detect.sniff("logs/raylet.out", b"THIRD" + b"\x00\x01\x02\x03" * 100).kind == "skipped"


@pytest.mark.parametrize("target, why", [
    ("NAMED_TEXT", "Format 'text' is declared already"),
    ("OTHER_METRICS", "table 'metrics' is declared already, with other columns"),
    ("NOT_A_FORMAT", "42 is no format declaration"),
    ("OWN_TEXT_PARSER", "the text splitter reads every text format"),
    ("NO_SUCH_NAME", "AttributeError"),
])
def test_a_package_that_does_not_fit_is_left_out_whole(entry_points, target, why):
    reg = entry_points(bad=target, third="THIRD_FORMAT")
    (problem,) = reg.problems
    assert problem.startswith("format package 'bad'") and why in problem, problem
    assert "third" in reg.formats  # the others still load
    assert [f.name for f in reg.formats.values() if f.name == "text"] == ["text"]
    assert {t.name: t for t in reg.tables}["metrics"] is METRICS


def test_builtin_declarations():
    """Every built-in format has a rule and a parser; text formats are read by the
    splitter; no two line formats share a position (their order would be the list's)."""
    for f in registry.formats():
        assert f.sniff and registry.parser_for(f.name) is not None, f.name
        if f.kind == "text" and f.name != registry.SPLITTER:
            assert f.parse is None and registry.parser_for(f.name) is registry.parser_for(registry.SPLITTER)
    orders = [lf.order for lf in registry.line_formats()]
    assert orders == sorted(set(orders))
    assert registry.problems() == ()


def test_a_kind_must_be_known():
    with pytest.raises(ValueError, match="kind"):
        Format("x", "binary", sniff=Sniff(1, lambda h: True), parse=_parse_nothing)
    with pytest.raises(ValueError, match="parse"):
        Format("x", "structured", sniff=Sniff(1, lambda h: True))
