"""Before/after comparison for refactors: does every bundle still give the same answer?

``snapshot OUT`` ingests every bundle (each folder of ``../shared/corpus/{real,cases,public}``
that holds a ``label.json``, each folder under ``tests/fixtures/`` and ``sample_logs/``) into
a fresh database through the command line, and writes for each:

- ``diagnose.json``: ``forensics diagnose --json``;
- ``tables/<name>.csv``: every base table and every view, rows sorted, with the columns
  that change from one ingest to the next left out (absolute roots, mtimes, ingest times,
  the database's own version facts);
- ``report.html``: ``forensics report``, with its generation time and the database's
  temporary name replaced by placeholders.

``diff A B`` compares two snapshots file by file and prints what differs (exit 1 if anything
does). Run ``snapshot`` before a refactor and after it, then ``diff``.

It drives the installed ``forensics`` command (``python -m forensics``), so it keeps
working whatever is moved inside the package.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parent.parent
# columns whose values differ between two ingests of the same bytes
VOLATILE = {
    "files": {"root", "mtime", "ingested_at"},
    "meta": {"value"},
}
# tables/views whose rows are about the ingest itself, not the logs
SKIP = set()


def bundles(corpus: Path | None) -> list[tuple[str, Path]]:
    out: list[tuple[str, Path]] = []
    if corpus is not None and corpus.is_dir():
        for kind in ("real", "cases", "public"):
            base = corpus / kind
            if base.is_dir():
                out += [(f"corpus/{kind}/{p.name}", p) for p in sorted(base.iterdir()) if (p / "label.json").is_file()]
    fixtures = ROOT / "tests" / "fixtures"
    out += [(f"fixtures/{p.name}", p) for p in sorted(fixtures.iterdir()) if p.is_dir()]
    out.append(("sample_logs", ROOT / "sample_logs"))
    return out


def _forensics(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forensics", *args], cwd=cwd, capture_output=True, text=True)


def _dump_tables(db: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect(str(db), read_only=True)
    try:
        rels = con.execute(
            "SELECT table_name, table_type FROM information_schema.tables WHERE table_schema = 'main' ORDER BY 1").fetchall()
        for name, kind in rels:
            if name in SKIP:
                continue
            cols = [r[0] for r in con.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = ? ORDER BY ordinal_position", [name]).fetchall()]
            keep = [c for c in cols if c not in VOLATILE.get(name, set())]
            if not keep:
                continue
            sel = ", ".join(f'"{c}"' for c in keep)
            try:
                con.execute(f"COPY (SELECT {sel} FROM \"{name}\" ORDER BY ALL) TO '{out / (name + '.csv')}' (HEADER, DELIMITER ',')")
            except duckdb.Error as exc:  # a view that needs a macro of the session (phase rules), etc.
                (out / (name + ".csv")).write_text(f"<error {type(exc).__name__}: {str(exc).splitlines()[0]}>\n")
    finally:
        con.close()


def _normalise_report(html: str, db_name: str) -> str:
    html = re.sub(r"generated \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", "generated <TIME>", html)
    return html.replace(db_name, "<DB>")


def snapshot_one(name: str, path: Path, out: Path) -> str:
    dest = out / name
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fx-compare-") as tmp:
        db = Path(tmp) / "run.duckdb"
        r = _forensics("ingest", str(path), "--db", str(db), cwd=Path(tmp))
        (dest / "ingest.rc").write_text(f"{r.returncode}\n")
        if not db.exists():
            (dest / "ingest.err").write_text(r.stderr)
            return f"{name}: no database (rc {r.returncode})"
        d = _forensics("diagnose", "--db", str(db), "--json", cwd=Path(tmp))
        try:
            obj = json.loads(d.stdout)
            text = json.dumps(obj, indent=1, sort_keys=True)
        except json.JSONDecodeError:
            text = f"<rc {d.returncode}>\n{d.stdout}\n{d.stderr}"
        (dest / "diagnose.json").write_text(text + "\n")
        _dump_tables(db, dest / "tables")
        html = Path(tmp) / "report.html"
        rep = _forensics("report", "--db", str(db), "-o", str(html), cwd=Path(tmp))
        if html.exists():
            (dest / "report.html").write_text(_normalise_report(html.read_text(), db.name))
        else:
            (dest / "report.html").write_text(f"<rc {rep.returncode}>\n{rep.stderr}")
    return f"{name}: ok"


def snapshot(out: Path, corpus: Path | None, jobs: int) -> int:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    todo = bundles(corpus)
    with ThreadPoolExecutor(max_workers=jobs) as ex:
        for msg in ex.map(lambda b: snapshot_one(b[0], b[1], out), todo):
            print(msg, flush=True)
    print(f"{len(todo)} bundles -> {out}")
    return 0


def diff(a: Path, b: Path, context: int = 2, limit: int = 40) -> int:
    files_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    files_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    bad = 0
    for rel in sorted(files_a - files_b):
        print(f"only in {a}: {rel}")
        bad += 1
    for rel in sorted(files_b - files_a):
        print(f"only in {b}: {rel}")
        bad += 1
    for rel in sorted(files_a & files_b):
        ta, tb = (a / rel).read_text(errors="replace"), (b / rel).read_text(errors="replace")
        if ta == tb:
            continue
        bad += 1
        print(f"--- differs: {rel}")
        lines = list(difflib.unified_diff(ta.splitlines(), tb.splitlines(), lineterm="", n=context))
        for ln in lines[2:2 + limit]:
            print("   " + (ln if len(ln) < 300 else ln[:300] + " ..."))
        if len(lines) > 2 + limit:
            print(f"   ... {len(lines) - 2 - limit} more diff lines")
    print(f"{bad} difference(s)" if bad else "no differences")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot", help="ingest, diagnose and report every bundle into OUT")
    s.add_argument("out", type=Path)
    s.add_argument("--corpus", type=Path, default=ROOT.parent / "shared" / "corpus")
    s.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    d = sub.add_parser("diff", help="compare two snapshots")
    d.add_argument("a", type=Path)
    d.add_argument("b", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "snapshot":
        return snapshot(args.out, args.corpus if args.corpus.is_dir() else None, args.jobs)
    return diff(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
