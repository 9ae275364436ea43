"""The ``forensics`` command line (see docs/cli.md and ../shared/contract.md).

Every command parses its arguments, makes one call of :mod:`forensics.api` (the call a
notebook makes) and formats what it returns. A :class:`forensics.api.ForensicsError`
from any command is printed as one ``error:`` line with exit status 2, in one place
(:meth:`_Group.invoke`); Ctrl-C ends a command with status 130; anything else is an
internal error (status 1, its traceback with ``--debug``).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import sys
import traceback
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table as RichTable
from rich.text import Text
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from . import __version__, api


class _ArgumentWithoutType(TyperArgument):
    def display_type(self, ctx):
        return None


class _OptionWithoutType(TyperOption):
    def display_type(self, ctx):
        return None


class _HelpWithoutTypes:
    """typer's help shows the Python type of every parameter (``--db <str>``, ``--json
    <bool>``, ``PATHS <list[str]>``), which tells a user nothing. Our parameters name
    their value instead (``metavar``: FILE, N, GLOB, ... as docs/cli.md writes them) and
    a flag, ours or typer's (``--help``, ``--install-completion``), takes no value: the
    parameters of our commands are typer's, less the type (``display_type``)."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        # typer makes the parameters itself, with no say in their class: they take the
        # subclass here, where the help (and the parser) ask for them
        for p in params:
            if type(p) is TyperArgument:
                p.__class__ = _ArgumentWithoutType
            elif type(p) is TyperOption:
                p.__class__ = _OptionWithoutType
        return params


class _Command(_HelpWithoutTypes, TyperCommand):
    pass


class _Group(_HelpWithoutTypes, TyperGroup):
    def invoke(self, ctx):
        """Run the command; a user error becomes one ``error:`` line and exit status 2."""
        try:
            return super().invoke(ctx)
        except api.ForensicsError as exc:
            if State.interrupted:  # Ctrl-C, which DuckDB reported as an error of its own
                raise KeyboardInterrupt from None
            if State.debug and exc.__cause__ is not None:
                err.print("".join(traceback.format_exception(exc.__cause__)).rstrip(), highlight=False)
            _fail(str(exc))


app = typer.Typer(
    cls=_Group,
    add_completion=True,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Post-mortems of distributed RL training runs (Ray, vLLM/SGLang, FSDP/Megatron, NCCL) from their logs.",
)


def _command(name: str | None = None):
    return app.command(name, cls=_Command)


# no emoji codes: log text is full of ``:100:``-like sequences (file:line:) that rich
# would turn into pictures; markup off unless a call asks for it (our own styled
# messages, where the input text in them goes through _shown)
out = Console(soft_wrap=True, emoji=False, markup=False)
err = Console(stderr=True, soft_wrap=True, emoji=False, markup=False)

DB_OPTION = typer.Option("forensics.duckdb", "--db", metavar="FILE", help="DuckDB database file.")


class State:
    debug = False
    interrupted = False  # SIGINT/SIGTERM came (DuckDB and Arrow report it as errors of their own)
    told = False  # an error message was printed (_fail)


def _print_version(value: bool) -> None:
    if value:
        out.print(f"forensics {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show Python tracebacks of internal errors, and of what caused a user error."),
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
) -> None:
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


INTERRUPTED_INGEST = "interrupted: the files loaded so far are committed; run the same command again to load the rest"


@_command()
def ingest(
    paths: List[str] = typer.Argument(None, metavar="PATHS", help="Folders, files or .tar/.tar.gz/.zip bundles (--engine ray: optional, URLs too)."),
    db: str = DB_OPTION,
    workers: int = typer.Option(0, "--workers", "-j", metavar="N", help="Parser processes (0 = number of cores)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the summary line."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    exclude: List[str] = typer.Option([], "--exclude", "-x", metavar="GLOB", help="Glob of files not to read (matched against the relative path and the name); repeatable."),
    engine: str = typer.Option("local", "--engine", metavar="ENGINE", help="local (this machine) or ray (every node of a Ray cluster parses its own files)."),
    address: Optional[str] = typer.Option(None, "--address", metavar="ADDR", help="--engine ray: the cluster (default: RAY_ADDRESS, else the one started here)."),
    parts: Optional[str] = typer.Option(None, "--parts", metavar="DIR|URL", help="--engine ray: nodes write Parquet parts there (a shared folder or s3://...) instead of the object store."),
    views_only: bool = typer.Option(False, "--views-only", help="--engine ray --parts: leave the parts in place; the database is views over them."),
    shared: bool = typer.Option(False, "--shared", help="--engine ray: PATHS are on a filesystem every node sees: split the file list across the cluster's CPUs (implied by a URL)."),
) -> None:
    """Detect, parse and load every file under PATHS into the database."""
    show_progress = not quiet and not as_json and err.is_terminal
    with _interruptible():
        try:
            with _progress_bar(show_progress) as progress:
                run = api.ingest(paths or None, db, workers=workers or None, progress=progress, debug=State.debug,
                                 exclude=exclude, engine=engine, address=address, parts=parts, views_only=views_only,
                                 shared=shared)
        except BaseException as exc:  # a user error (ForensicsError) goes on to _Group.invoke
            if State.interrupted or isinstance(exc, KeyboardInterrupt):
                _fail(INTERRUPTED_INGEST, 130)
            raise
        with run:
            headline = _headline(run)
    _print_ingest(run.last_ingest, headline, quiet, as_json)


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


@contextlib.contextmanager
def _progress_bar(shown: bool):
    """A progress callback for :func:`forensics.api.ingest`: a bar on stderr, or None."""
    if not shown:
        yield None
        return
    with Progress(TextColumn("ingest"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"), console=err, transient=True) as bar:
        task = bar.add_task("", total=None)

        def progress(done: int, total: int, rel: str) -> None:
            bar.update(task, completed=done, total=total, description=_shown(rel[-60:]))

        yield progress


def _print_ingest(summary, headline: str | None, quiet: bool, as_json: bool) -> None:
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


def _headline(run: api.Run) -> str | None:
    """The run's diagnosis in one line; a diagnosis that fails is said, it never makes
    the ingest fail (its exit status is about the ingest: ../shared/contract.md)."""
    try:
        return run.headline()
    except Exception as exc:
        if State.debug:
            raise
        if State.interrupted:  # Ctrl-C during the diagnosis, reported by DuckDB as its error
            raise KeyboardInterrupt from None
        return f"(diagnosis failed: {exc.__class__.__name__}: {exc})"


@_command()
def collect(
    out_dir: str = typer.Argument(..., metavar="OUT_DIR", help="Folder to copy the logs into (OUT_DIR/node_<node>/...)."),
    address: Optional[str] = typer.Option(None, "--address", metavar="ADDR", help="The Ray cluster (default: RAY_ADDRESS, else the one started here)."),
    as_json: bool = typer.Option(False, "--json", help="Print what was copied as JSON."),
) -> None:
    """Copy every alive Ray node's session logs into OUT_DIR, for `forensics ingest OUT_DIR`."""
    result = api.collect(out_dir, address=address)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    for m in result["messages"]:
        err.print(f"[yellow]![/yellow] {_shown(m)}", markup=True, highlight=False)
    files = sum(result["nodes"].values())
    out.print(f"{files} file(s) from {len(result['nodes'])} node(s), {_human(result['bytes'])}, copied into {_shown(result['out'])}; "
              f"next: forensics ingest {_shown(result['out'])}", highlight=False)


@_command()
def query(
    sql: str = typer.Argument(..., metavar="SQL", help="SQL to run (DuckDB dialect)."),
    db: str = DB_OPTION,
    fmt: str = typer.Option("table", "--format", "-f", metavar="FORMAT", help="table | csv | json"),
    write: bool = typer.Option(False, "--write", help="Open the database writable (default: read-only)."),
) -> None:
    """Run SQL against the database and print the result."""
    if fmt not in ("table", "csv", "json"):
        raise api.ForensicsError(f"unknown --format {fmt!r}: use table, csv or json")
    df = api.query(db, sql, write=write)
    if fmt == "csv":
        sys.stdout.write(df.write_csv())
    elif fmt == "json":
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


@_command()
def export(
    db: str = DB_OPTION,
    parquet: Optional[str] = typer.Option(None, "--parquet", metavar="DIR", help="Write one <table>.parquet per table into DIR."),
    chrome_trace: Optional[str] = typer.Option(None, "--chrome-trace", metavar="FILE.json", help="Write one merged Chrome/Perfetto trace of all ranks to FILE.json."),
    category: List[str] = typer.Option([], "--category", "-c", metavar="CAT", help="PyTorch profiler category (trace_events.category) to put in the Chrome trace (repeatable; default: kernel, gpu_memcpy, gpu_memset, user_annotation, gpu_user_annotation). Ray timeline events are always in."),
    as_json: bool = typer.Option(False, "--json", help="Print what was written as JSON."),
) -> None:
    """Export the database: Parquet files (--parquet) and/or a Chrome/Perfetto trace (--chrome-trace)."""
    written = api.export(db, parquet=parquet, chrome_trace=chrome_trace, categories=category or None)
    if as_json:
        typer.echo(json.dumps(written, indent=2, default=str))
        return
    if "parquet" in written:
        tables = written["parquet"]["tables"]
        out.print(f"parquet: {len(tables)} table(s), {sum(tables.values()):,} row(s) -> {parquet}", highlight=False)
    if "chrome_trace" in written:
        ct = written["chrome_trace"]
        kinds = ", ".join(f"{k} {v:,}" for k, v in ct["by_kind"].items())
        out.print(f"chrome trace: {ct['events']:,} event(s) ({kinds}) in {len(ct['processes'])} process(es) -> {chrome_trace}", highlight=False)
        if ct["unplaced_log_lines"]:
            out.print(f"  {ct['unplaced_log_lines']:,} warning/error line(s) without a timestamp left out", highlight=False)
        out.print("  open it in https://ui.perfetto.dev or chrome://tracing", highlight=False)


@_command()
def report(
    db: str = DB_OPTION,
    output: str = typer.Option("report.html", "--output", "-o", metavar="FILE.html", help="Where to write the report."),
    title: Optional[str] = typer.Option(None, "--title", metavar="TEXT", help="Page title (default: the database name)."),
) -> None:
    """Write the self-contained post-mortem HTML: incident card, findings, per-rank phase
    timeline, phases per step, training metrics, file inventory. Works offline."""
    result = api.report(db, output, title)
    for note in result.notes:
        err.print(f"[yellow]![/yellow] {_shown(note)}", markup=True, highlight=False)
    out.print(f"wrote {result.path} ({_human(result.bytes)}) in {result.seconds:.2f} s", highlight=False)


SIGNATURES_OPTION = typer.Option([], "--signatures", "-s", metavar="DIR", help="Folder of extra signature rules (*.yaml); repeatable. Its rules override built-in rules of the same id.")


@_command()
def diagnose(
    db: str = DB_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print the diagnosis as JSON (see contract.md)."),
    signatures: List[str] = SIGNATURES_OPTION,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show every evidence line of every root cause, whole, and the root cause's traceback."),
    context: int = typer.Option(0, "--context", "-C", metavar="N", min=0, help="Show N lines of the file before and after the first evidence line."),
) -> None:
    """Classify what went wrong in the ingested run: root cause with evidence, cascade, remediation.

    Exit status 0 when a verdict was reached (healthy or failed); non-zero only when the
    diagnosis could not run (no database, bad signature files)."""
    result = api.diagnose(db, signatures, context=context)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2, default=str))
        return
    out.print(api.render_diagnosis(result, verbose=verbose), highlight=False, markup=False)
    err.print(f"({result.rules} signatures, {result.seconds:.2f} s)", highlight=False)


@_command("signatures")
def signatures_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print the catalogue as JSON."),
    signatures: List[str] = SIGNATURES_OPTION,
    check: bool = typer.Option(False, "--check", help="Also compile every pattern with DuckDB's regex engine (RE2)."),
) -> None:
    """List the signature catalogue: one rule per line with its class and causal role."""
    cat = api.catalogue(signatures, check=check)
    detectors = sorted(k for k, v in cat.metric_detectors.items() if isinstance(v, dict))
    if as_json:
        payload = {
            "sources": cat.sources,
            "rules": [r.to_dict() for r in cat.rules],
            "classes": {c.id: {"title": c.title, "remediation": len(c.remediation)} for c in cat.classes.values()},
            "metric_detectors": detectors,
        }
        typer.echo(json.dumps(payload, indent=2, default=str))
        return
    t = RichTable(show_edge=False)
    for c in ("id", "class", "role", "weight", "title"):
        t.add_column(c, overflow="fold")
    for r in sorted(cat.rules, key=lambda r: (r.cls, r.role, r.id)):
        t.add_row(*(Text(v) for v in (r.id, r.cls, r.role, f"{r.weight:.2f}", r.title or "")))  # user rule files
    out.print(t)
    out.print(f"{len(cat.rules)} rule(s) from {len(cat.sources)} file(s); metric detectors: {', '.join(detectors)}", highlight=False)


@_command()
def evaluate(
    corpus_dir: str = typer.Argument(..., metavar="CORPUS_DIR", help="Folder of labelled bundles (each with a label.json), e.g. ../shared/corpus."),
    work: Optional[str] = typer.Option(None, "--work", metavar="DIR", help="Folder for the per-bundle databases (default: a temporary folder)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    signatures: List[str] = SIGNATURES_OPTION,
) -> None:
    """Ingest every labelled bundle, diagnose it and score the diagnoses against the labels."""
    scores = api.evaluate(corpus_dir, work=work, signatures=signatures)
    if as_json:
        typer.echo(json.dumps(scores.to_dict(), indent=2, default=str))
        return
    out.print(api.render_evaluation(scores), highlight=False, markup=False)


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
