"""The ``forensics`` command line (see docs/cli.md and ../shared/contract.md).

Every command is a thin layer over :mod:`forensics.api`.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
from typing import List, Optional

import duckdb
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table as RichTable
from rich.text import Text

from . import pipeline
from .store import SettingError, StoreError, StoreLocked

app = typer.Typer(
    add_completion=True,
    no_args_is_help=True,
    help="Post-mortems of distributed RL training runs (Ray, vLLM/SGLang, FSDP/Megatron, NCCL) from their logs.",
)
# no emoji codes: log text is full of ``:100:``-like sequences (file:line:) that rich
# would turn into pictures; markup off unless a call asks for it (our own styled
# messages, where the input text in them goes through _shown)
out = Console(soft_wrap=True, emoji=False, markup=False)
err = Console(stderr=True, soft_wrap=True, emoji=False, markup=False)

DB_OPTION = typer.Option("forensics.duckdb", "--db", help="DuckDB database file.")


class State:
    debug = False
    interrupted = False  # SIGINT/SIGTERM came (DuckDB and Arrow report it as errors of their own)
    told = False  # an error message was printed (_fail)


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show Python tracebacks of internal errors.")) -> None:
    State.debug = debug


# control characters (terminal escapes in a file name or log excerpt) and bidi overrides
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _shown(text: str) -> str:
    """Text that comes from the input (file names, log excerpts, error messages quoting
    them) made safe to print: rich markup escaped, control characters shown as ``\\xNN``."""
    return escape(_UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text))


def _fail(message: str, code: int = 2) -> None:
    err.print(f"[red]error:[/red] {_shown(message)}", markup=True, highlight=False)
    State.told = True
    raise typer.Exit(code)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@app.command()
def ingest(
    paths: List[str] = typer.Argument(..., help="Folders, files or .tar/.tar.gz/.zip bundles."),
    db: str = DB_OPTION,
    workers: int = typer.Option(0, "--workers", "-j", help="Parser processes (0 = number of cores)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the summary line."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    exclude: List[str] = typer.Option([], "--exclude", "-x", help="Glob of files not to read (matched against the relative path and the name); repeatable."),
) -> None:
    """Detect, parse and load every file under PATHS into the database."""
    show_progress = not quiet and not as_json and err.is_terminal
    with _interruptible():
        try:
            summary = _run_ingest(paths, db, workers, exclude, show_progress)
        except BaseException as exc:
            _ingest_failed(exc, db)
            raise
        headline = _headline(db)
    _print_ingest(summary, headline, db, quiet, as_json)


@contextlib.contextmanager
def _interruptible():
    """Ctrl-C and a polite kill (timeout, scheduler, docker stop) stop the command the same
    way: the open transaction is rolled back, the temporary folder removed, and the user
    told so, also when DuckDB or Arrow turn the interrupt into an error of their own."""
    def on_signal(signum, frame):
        State.interrupted = True
        raise KeyboardInterrupt

    State.interrupted = False
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s, h in handlers.items():
        if h is not signal.SIG_IGN:  # a background job that ignores SIGINT keeps ignoring it
            signal.signal(s, on_signal)
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def _ingest_failed(exc: BaseException, db: str) -> None:
    """Turn what stopped an ingest into a clear message (typer.Exit); return for a bug."""
    if State.interrupted or isinstance(exc, KeyboardInterrupt):
        _fail("interrupted: the files loaded so far are committed; run the same command again to load the rest", 130)
    if isinstance(exc, (StoreError, pipeline.IngestError)):
        _fail(str(exc))
    if isinstance(exc, duckdb.IOException) and not State.debug:  # the database cannot be written (disk full, ...)
        _fail(f"cannot write the database {db}: {exc}")


def _run_ingest(paths: list[str], db: str, workers: int, exclude: list[str], show_progress: bool) -> pipeline.IngestSummary:
    if show_progress:
        with Progress(TextColumn("ingest"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"), console=err, transient=True) as bar:
            task = bar.add_task("", total=None)

            def progress(done: int, total: int, rel: str) -> None:
                bar.update(task, completed=done, total=total, description=_shown(rel[-60:]))

            return pipeline.ingest(paths, db, workers=workers or None, progress=progress, debug=State.debug, exclude=exclude)
    return pipeline.ingest(paths, db, workers=workers or None, debug=State.debug, exclude=exclude)


def _print_ingest(summary: pipeline.IngestSummary, headline: str | None, db: str, quiet: bool, as_json: bool) -> None:
    if as_json:
        payload = {
            "db": summary.db, "seconds": round(summary.seconds, 3), "files_seen": summary.files_seen,
            "files_loaded": summary.files_loaded, "files_unchanged": summary.files_unchanged,
            "files_grown": summary.files_grown, "files_by_format": summary.files_by_format,
            "rows_added": summary.rows_added, "rows_total": summary.rows_total,
            "unparsed_lines": summary.unparsed_lines, "messages": summary.messages, "diagnosis": headline,
        }
        typer.echo(json.dumps(payload, indent=2, default=str))
        return
    for m in summary.messages:
        err.print(f"[yellow]![/yellow] {_shown(m)}", markup=True, highlight=False)
    if not quiet:
        t = RichTable(title=f"ingested into {summary.db}", show_edge=False)
        t.add_column("format")
        t.add_column("files", justify="right")
        for fmt, n in sorted(summary.files_by_format.items(), key=lambda kv: (-kv[1], kv[0])):
            t.add_row(fmt, str(n))
        out.print(t)
        r = RichTable(show_edge=False)
        r.add_column("table")
        r.add_column("rows added", justify="right")
        r.add_column("rows in db", justify="right")
        for name, total in sorted(summary.rows_total.items()):
            if total or summary.rows_added.get(name):
                r.add_row(name, f"{summary.rows_added.get(name, 0):,}", f"{total:,}")
        out.print(r)
    mbps = summary.bytes_read / 1e6 / summary.seconds if summary.seconds else 0
    out.print(
        f"{summary.files_loaded} file(s) loaded, {summary.files_unchanged} unchanged, {summary.files_grown} grown; "
        f"{_human(summary.bytes_read)} in {summary.seconds:.2f} s ({mbps:.1f} MB/s); "
        f"{summary.unparsed_lines:,} line(s) no parser understood (kept in `lines`); "
        f"{len(summary.messages)} problem(s)",
        highlight=False,
    )
    if headline:
        out.print(f"diagnosis: {headline}", highlight=False, markup=False)


def _headline(db: str) -> str | None:
    """One-line diagnosis of the database, or None when diagnosis is unavailable."""
    try:
        from . import diagnose as dg
    except ImportError:
        return None
    try:
        return dg.headline(db)
    except Exception as exc:  # diagnosis must never make ingest fail
        if State.debug:
            raise
        if State.interrupted:  # Ctrl-C during the diagnosis, reported by DuckDB as its error
            raise KeyboardInterrupt from None
        return f"(diagnosis failed: {exc.__class__.__name__}: {exc})"


@app.command()
def query(
    sql: str = typer.Argument(..., help="SQL to run (DuckDB dialect)."),
    db: str = DB_OPTION,
    fmt: str = typer.Option("table", "--format", "-f", help="table | csv | json"),
    write: bool = typer.Option(False, "--write", help="Open the database writable (default: read-only)."),
) -> None:
    """Run SQL against the database and print the result."""
    from .api import Run

    if fmt not in ("table", "csv", "json"):
        _fail(f"unknown --format {fmt!r}: use table, csv or json")
    try:
        run = Run(db, write=write)
    except FileNotFoundError as exc:
        _fail(str(exc))
        return
    except StoreError as exc:  # locked by an ingest, not a DuckDB file, ...
        _fail(str(exc))
        return
    try:
        df = run.sql(sql)
    except Exception as exc:  # duckdb errors: syntax, missing table, ...
        if State.interrupted:  # Ctrl-C, which DuckDB reports as an error of its own
            raise KeyboardInterrupt from None
        if State.debug:
            raise
        _fail(f"{exc.__class__.__name__}: {exc}")
        return
    finally:
        run.close()
    if fmt == "csv":
        sys.stdout.write(df.write_csv())
    elif fmt == "json":
        import math

        # strict JSON has no NaN or Infinity: non-finite floats are printed as null
        rows = [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()} for r in df.to_dicts()]
        sys.stdout.write(json.dumps(rows, default=str, indent=1, allow_nan=False) + "\n")
    else:
        t = RichTable(show_edge=False)
        for c in df.columns:
            t.add_column(c, overflow="fold")
        for row in df.iter_rows():
            t.add_row(*[Text("" if v is None else str(v)) for v in row])  # Text: never read as markup
        out.print(t)
        out.print(f"({df.height} row{'s' if df.height != 1 else ''})", highlight=False)


@app.command()
def export(
    db: str = DB_OPTION,
    parquet: Optional[str] = typer.Option(None, "--parquet", metavar="DIR", help="Write one <table>.parquet per table into DIR."),
    chrome_trace: Optional[str] = typer.Option(None, "--chrome-trace", metavar="FILE.json", help="Write one merged Chrome/Perfetto trace of all ranks to FILE.json."),
    category: List[str] = typer.Option([], "--category", "-c", help="PyTorch profiler category (trace_events.category) to put in the Chrome trace (repeatable; default: kernel, gpu_memcpy, gpu_memset, user_annotation, gpu_user_annotation). Ray timeline events are always in."),
    as_json: bool = typer.Option(False, "--json", help="Print what was written as JSON."),
) -> None:
    """Export the database: Parquet files (--parquet) and/or a Chrome/Perfetto trace (--chrome-trace)."""
    from .api import Run

    if not parquet and not chrome_trace:
        _fail("nothing to export: give --parquet DIR and/or --chrome-trace FILE.json")
    try:
        run = Run(db)
    except (FileNotFoundError, StoreLocked) as exc:
        _fail(str(exc))
        return
    payload: dict = {"db": db}
    try:
        if parquet:
            payload["parquet"] = {"dir": parquet, "tables": run.export_parquet(parquet)}
        if chrome_trace:
            summary = run.export_chrome_trace(chrome_trace, categories=category or None)
            payload["chrome_trace"] = summary.to_dict()
    except (OSError, duckdb.IOException) as exc:  # cannot write there: a user error, not a bug
        _fail(f"cannot write: {exc}")
    finally:
        run.close()
    if as_json:
        typer.echo(json.dumps(payload, indent=2, default=str))
        return
    if "parquet" in payload:
        tables = payload["parquet"]["tables"]
        out.print(f"parquet: {len(tables)} table(s), {sum(tables.values()):,} row(s) -> {parquet}", highlight=False)
    if "chrome_trace" in payload:
        ct = payload["chrome_trace"]
        kinds = ", ".join(f"{k} {v:,}" for k, v in ct["by_kind"].items())
        out.print(f"chrome trace: {ct['events']:,} event(s) ({kinds}) in {len(ct['processes'])} process(es) -> {chrome_trace}", highlight=False)
        if ct["unplaced_log_lines"]:
            out.print(f"  {ct['unplaced_log_lines']:,} warning/error line(s) without a timestamp left out", highlight=False)
        out.print("  open it in https://ui.perfetto.dev or chrome://tracing", highlight=False)


@app.command()
def report(
    db: str = DB_OPTION,
    output: str = typer.Option("report.html", "--output", "-o", metavar="FILE.html", help="Where to write the report."),
    title: Optional[str] = typer.Option(None, "--title", help="Page title (default: the database name)."),
) -> None:
    """Write the self-contained post-mortem HTML: incident card, findings, per-rank phase
    timeline, phases per step, training metrics, file inventory. Works offline."""
    from . import report as report_mod

    try:
        result = report_mod.write_report(db, output, title)
    except FileNotFoundError as exc:
        _fail(str(exc))
        return
    except duckdb.IOException as exc:  # locked or unreadable database
        _fail(f"cannot read {db}: {exc}")
        return
    except SettingError as exc:
        _fail(str(exc))
        return
    except OSError as exc:  # cannot write the output
        _fail(f"cannot write {output}: {exc}")
        return
    for note in result.notes:
        err.print(f"[yellow]![/yellow] {_shown(note)}", markup=True, highlight=False)
    out.print(f"wrote {result.path} ({_human(result.bytes)}) in {result.seconds:.2f} s", highlight=False)


SIGNATURES_OPTION = typer.Option([], "--signatures", "-s", metavar="DIR", help="Folder of extra signature rules (*.yaml); repeatable. Its rules override built-in rules of the same id.")


@app.command()
def diagnose(
    db: str = DB_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print the diagnosis as JSON (see contract.md)."),
    signatures: List[str] = SIGNATURES_OPTION,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show every evidence line of every root cause."),
) -> None:
    """Classify what went wrong in the ingested run: root cause with evidence, cascade, remediation.

    Exit status 0 when a verdict was reached (healthy or failed); non-zero only when the
    diagnosis could not run (no database, bad signature files)."""
    from . import diagnose as dg
    from .catalogue import SignatureError

    if not os.path.exists(db):
        _fail(f"no database at {db}: run `forensics ingest PATH --db {db}` first")
    try:
        result = dg.diagnose(db, signatures)
    except SignatureError as exc:
        _fail(f"signature catalogue: {exc}")
        return
    except dg.NothingToDiagnose as exc:
        _fail(str(exc))
        return
    except duckdb.IOException as exc:  # locked or unreadable database
        _fail(f"cannot read {db}: {exc}")
        return
    except SettingError as exc:
        _fail(str(exc))
        return
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2, default=str))
        return
    out.print(dg.render(result, verbose=verbose), highlight=False, markup=False)
    err.print(f"({result.rules} signatures, {result.seconds:.2f} s)", highlight=False)


@app.command("signatures")
def signatures_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print the catalogue as JSON."),
    signatures: List[str] = SIGNATURES_OPTION,
    check: bool = typer.Option(False, "--check", help="Also compile every pattern with DuckDB's regex engine (RE2)."),
) -> None:
    """List the signature catalogue: one rule per line with its class and causal role."""
    from . import catalogue as sig

    try:
        cat = sig.load(signatures)
        if check:
            sig.check_with_duckdb(cat)
    except sig.SignatureError as exc:
        _fail(str(exc))
        return
    if as_json:
        payload = {
            "sources": cat.sources,
            "rules": [r.to_dict() for r in cat.rules],
            "classes": {c.id: {"title": c.title, "remediation": len(c.remediation)} for c in cat.classes.values()},
            "metric_detectors": sorted(k for k, v in cat.metric_detectors.items() if isinstance(v, dict)),
        }
        typer.echo(json.dumps(payload, indent=2, default=str))
        return
    t = RichTable(show_edge=False)
    for c in ("id", "class", "role", "weight", "title"):
        t.add_column(c, overflow="fold")
    for r in sorted(cat.rules, key=lambda r: (r.cls, r.role, r.id)):
        t.add_row(*(Text(v) for v in (r.id, r.cls, r.role, f"{r.weight:.2f}", r.title or "")))  # user rule files
    out.print(t)
    detectors = ", ".join(sorted(k for k, v in cat.metric_detectors.items() if isinstance(v, dict)))
    out.print(f"{len(cat.rules)} rule(s) from {len(cat.sources)} file(s); metric detectors: {detectors}", highlight=False)


@app.command()
def evaluate(
    corpus_dir: str = typer.Argument(..., help="Folder of labelled bundles (each with a label.json), e.g. ../shared/corpus."),
    work: Optional[str] = typer.Option(None, "--work", help="Folder for the per-bundle databases (default: a temporary folder)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    signatures: List[str] = SIGNATURES_OPTION,
) -> None:
    """Ingest every labelled bundle, diagnose it and score the diagnoses against the labels."""
    from . import evaluate as ev

    try:
        report_ = ev.evaluate(corpus_dir, work_dir=work, signature_dirs=signatures)
    except FileNotFoundError as exc:
        _fail(str(exc))
        return
    if as_json:
        typer.echo(json.dumps(report_.to_dict(), indent=2, default=str))
        return
    out.print(ev.render(report_), highlight=False, markup=False)

def main() -> None:
    try:
        with _interruptible():
            app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except SystemExit as exc:
        if exc.code == 130 and State.interrupted and not State.told:  # typer ends a KeyboardInterrupt silently
            err.print("interrupted")
        raise
    except Exception as exc:
        if State.interrupted:  # DuckDB (a query in any thread) turns Ctrl-C into an error of its own
            err.print("interrupted")
            sys.exit(130)
        if State.debug or os.environ.get("FORENSICS_DEBUG"):
            raise
        err.print(f"[red]internal error:[/red] {_shown(f'{exc.__class__.__name__}: {exc}')} (run with --debug for the traceback)", markup=True, highlight=False)
        sys.exit(1)


if __name__ == "__main__":
    main()
