"""The ``forensics`` command line (see docs/cli.md and ../shared/contract.md).

Every command parses its arguments, makes one call of :mod:`forensics.api` (the call a
notebook makes) and formats what it returns. A :class:`forensics.api.ForensicsError`
(:mod:`forensics.errors`) from any command is printed as one ``error:`` line with exit status 2, in one place
(:meth:`_Group.invoke`); Ctrl-C ends a command with status 130; anything else is an
internal error (status 1, its traceback with ``--debug``).

The API (DuckDB, polars, pyarrow, the parsers) is imported inside the commands that call
it, and rich's progress bars and tables where they are drawn: ``forensics --help``,
``--version`` and a command's ``--help`` load none of them (tests/test_cli.py checks it;
bench/bench_startup.py times it).
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import signal
import sys
import time
import traceback
from typing import TYPE_CHECKING, List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from . import __version__
from .errors import ForensicsError

if TYPE_CHECKING:
    from . import api

STARTED = time.perf_counter()  # the command's start, near enough (imports before it: a few tenths of a second)


def _plain_values(param):
    """Our parameters are strings, flags, whole numbers and lists of strings. typer (0.2x)
    checks every value through a pydantic TypeAdapter that it builds for the parameter when
    the command runs: with pydantic's own imports a twentieth of a second of every command,
    more than the check itself is worth. Our parameters take the values as click parsed
    them and check the numbers here (:func:`_plain_runtime_param`); any other annotation
    goes to typer's own check."""
    plain = _plain_runtime_param(param)
    return plain if plain is not None else super(type(param), param).get_runtime_param()


def _plain_runtime_param(param):
    """The check of ``param``'s value without pydantic, or None for an annotation other than
    str, bool, int, Optional[str] and List[str] (or a typer without runtime checks)."""
    desc = getattr(param, "type_descriptor", None)
    if desc is None:
        return None
    annotation = desc.annotation
    args = getattr(annotation, "__args__", ())
    if getattr(annotation, "__origin__", None) is list and args == (str,):
        kind = "strs"
    elif annotation is int:
        kind = "int"
    elif annotation in (str, bool) or (args and set(args) == {str, type(None)}):
        kind = "as_parsed"  # click's string, or the flag's bool (None is handled before: RuntimeParam.coerce)
    else:
        return None
    return _plain_class()(parameter_info=desc.parameter_info, annotation=annotation, kind=kind)


@functools.cache
def _plain_class():
    from dataclasses import dataclass

    from typer._coercion import RuntimeParam  # typer's own base: coerce() handles None and multiple values
    from typer._click.exceptions import BadParameter

    @dataclass(frozen=True)
    class PlainRuntimeParam(RuntimeParam):
        kind: str = "as_parsed"

        def _coerce_value(self, value, param, ctx):
            if self.kind == "strs":
                return [str(v) for v in value]
            if self.kind == "as_parsed" or isinstance(value, bool):
                return value
            try:
                number = int(value)
            except (TypeError, ValueError):
                raise BadParameter("Input should be a valid integer", ctx=ctx, param=param) from None
            info = self.parameter_info
            if info.min is not None and number < info.min:
                raise BadParameter(f"Input should be greater than or equal to {info.min}", ctx=ctx, param=param)
            if info.max is not None and number > info.max:
                raise BadParameter(f"Input should be less than or equal to {info.max}", ctx=ctx, param=param)
            return number

    return PlainRuntimeParam


class _ArgumentWithoutType(TyperArgument):
    get_runtime_param = _plain_values

    def display_type(self, ctx):
        return None


class _OptionWithoutType(TyperOption):
    get_runtime_param = _plain_values

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
        except ForensicsError as exc:
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
RUN_OPTION = typer.Option(None, "--run", metavar="RUN", help="The run to read, when the database holds several: its id or name (table `runs`; the end of a name after a / will do when only one run's name ends so).")


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
    add: bool = typer.Option(False, "--add", help="Ingest PATHS beside the runs of other PATHs the database holds (without it, that is refused: runs are kept apart)."),
    engine: str = typer.Option("local", "--engine", metavar="ENGINE", help="local (this machine) or ray (every node of a Ray cluster parses its own files)."),
    address: Optional[str] = typer.Option(None, "--address", metavar="ADDR", help="--engine ray: the cluster (default: RAY_ADDRESS, else the one started here)."),
    parts: Optional[str] = typer.Option(None, "--parts", metavar="DIR|URL", help="--engine ray: nodes write Parquet parts there (a shared folder or s3://...) instead of the object store."),
    views_only: bool = typer.Option(False, "--views-only", help="--engine ray --parts: leave the parts in place; the database is views over them."),
    shared: bool = typer.Option(False, "--shared", help="--engine ray: PATHS are on a filesystem every node sees: split the file list across the cluster's CPUs (implied by a URL)."),
) -> None:
    """Detect, parse and load every file under PATHS into the database."""
    from . import api

    show_progress = not quiet and not as_json and err.is_terminal
    with _interruptible():
        try:
            with _progress_bar(show_progress) as progress:
                run = api.ingest(paths or None, db, workers=workers or None, progress=progress, debug=State.debug,
                                 exclude=exclude, add=add, engine=engine, address=address, parts=parts,
                                 views_only=views_only, shared=shared)
        except BaseException as exc:  # a user error (ForensicsError) goes on to _Group.invoke
            if State.interrupted or isinstance(exc, KeyboardInterrupt):
                _fail(INTERRUPTED_INGEST, 130)
            raise
        t0 = time.perf_counter()
        with run, _spinner("diagnosing", show_progress):
            headline = _headline(run)
        diagnosis_s = time.perf_counter() - t0
    _print_ingest(run.last_ingest, headline, quiet, as_json, diagnosis_s, time.perf_counter() - STARTED)


@contextlib.contextmanager
def _spinner(what: str, shown: bool):
    """A spinner with ``what`` and the seconds so far on stderr while a long step runs
    (only on a terminal: nothing on a pipe or with --json)."""
    if not shown:
        yield
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err, transient=True) as bar:
        bar.add_task(what, total=None)
        yield


@contextlib.contextmanager
def _interruptible():
    """Ctrl-C and a polite kill (timeout, scheduler, docker stop) stop the command the same
    way: the open transaction is rolled back, the temporary folder removed, and the user
    told so, also when DuckDB or Arrow turn the interrupt into an error of their own."""
    def on_signal(signum, frame):
        State.interrupted = True
        # DuckDB would finish the statement under way first: stop it now (no connection
        # is open unless the module that opens them has been imported)
        database = sys.modules.get("forensics.database")
        if database is not None:
            database.interrupt_all()
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
    """A progress callback for :func:`forensics.api.ingest`: a bar on stderr (bytes read of
    the bytes to read, MB/s, the time so far, the last file), or None."""
    if not shown:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn

    with Progress(TextColumn("ingest"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=err, transient=True) as bar:
        task = bar.add_task("", total=None)

        def progress(done: int, total: int, rel: str) -> None:
            bar.update(task, completed=done, total=total, description=_shown(rel[-60:]))

        yield progress


def _print_ingest(summary, headline: str | None, quiet: bool, as_json: bool, diagnosis_s: float = 0.0,
                  wall_s: float | None = None) -> None:
    wall_s = summary.seconds + diagnosis_s if wall_s is None else wall_s
    if as_json:
        payload = {
            "db": summary.db, "seconds": round(summary.seconds, 3), "diagnosis_seconds": round(diagnosis_s, 3),
            "wall_seconds": round(wall_s, 3), "files_seen": summary.files_seen,
            "files_loaded": summary.files_loaded, "files_unchanged": summary.files_unchanged,
            "files_grown": summary.files_grown, "files_by_format": summary.files_by_format,
            "rows_added": summary.rows_added, "rows_total": summary.rows_total,
            "unparsed_lines": summary.unparsed_lines, "messages": summary.messages, "runs": summary.runs, "diagnosis": headline,
        }
        typer.echo(json.dumps(payload, indent=2, default=str))
        return
    for m in summary.messages:
        err.print(f"[yellow]![/yellow] {_shown(m)}", markup=True, highlight=False)
    if not quiet:
        from rich.table import Table as RichTable

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
        f"{len(summary.messages)} problem(s); diagnosis {diagnosis_s:.2f} s; {wall_s:.2f} s in all",
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


QUERY_FORMATS = ("table", "csv", "json", "ndjson")


@_command()
def collect(
    out_dir: str = typer.Argument(..., metavar="OUT_DIR", help="Folder to copy the logs into (OUT_DIR/node_<node>/...)."),
    address: Optional[str] = typer.Option(None, "--address", metavar="ADDR", help="The Ray cluster (default: RAY_ADDRESS, else the one started here)."),
    as_json: bool = typer.Option(False, "--json", help="Print what was copied as JSON."),
) -> None:
    """Copy every alive Ray node's session logs into OUT_DIR, for `forensics ingest OUT_DIR`."""
    from . import api

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
    fmt: str = typer.Option("table", "--format", "-f", metavar="FORMAT", help="table | csv | json | ndjson"),
    write: bool = typer.Option(False, "--write", help="Open the database writable (default: read-only)."),
    max_rows: int = typer.Option(40, "--max-rows", metavar="N", min=0, help="Rows the table shows (0: all); the other formats print every row."),
) -> None:
    """Run SQL against the database and print the result (streamed: any size)."""
    from . import api

    if fmt not in QUERY_FORMATS:
        raise ForensicsError(f"unknown --format {fmt!r}: use table, csv, json or ndjson")
    try:
        with api.query_batches(db, sql, write=write) as result:
            if fmt == "table":
                _print_table(result, max_rows)
            else:
                {"csv": _write_csv, "json": _write_json, "ndjson": _write_ndjson}[fmt](result)
        sys.stdout.flush()
    except BrokenPipeError:  # `forensics query ... | head`: the reader has all it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise typer.Exit(0)


def _emit(data: bytes) -> None:
    """Bytes to stdout (its buffer, past the text layer's encoding)."""
    buf = getattr(sys.stdout, "buffer", None)
    if buf is None:
        sys.stdout.write(data.decode("utf-8", "replace"))
    else:
        buf.write(data)


def _interval(v) -> str | None:
    """An Arrow month-day-nanosecond interval as text (``1 month 2 days 00:00:03.5``), else None."""
    if not (isinstance(v, tuple) and hasattr(v, "months") and hasattr(v, "nanoseconds")):
        return None
    secs, parts = v.nanoseconds / 1e9, []
    if v.months:
        parts.append(f"{v.months} month{'s' if abs(v.months) != 1 else ''}")
    if v.days:
        parts.append(f"{v.days} day{'s' if abs(v.days) != 1 else ''}")
    if secs or not parts:
        h, rest = divmod(abs(secs), 3600)
        m, sec = divmod(rest, 60)
        frac = f"{sec:06.3f}".rstrip("0").rstrip(".")  # 03.500 -> 03.5, 10.000 -> 10
        parts.append(f"{'-' if secs < 0 else ''}{int(h):02d}:{int(m):02d}:{frac}")
    return " ".join(parts)


def _json_default(v):
    """What orjson does not write itself: datetimes as DuckDB prints them, decimals, blobs, intervals."""
    if isinstance(v, bytes):
        return v.decode("utf-8", "backslashreplace")
    iv = _interval(v)
    return iv if iv is not None else str(v)


def _json(v) -> bytes:
    import orjson

    # non-finite floats become null (strict JSON has no NaN); dict keys of a MAP may be numbers
    return orjson.dumps(v, default=_json_default, option=orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_NON_STR_KEYS)


def _write_ndjson(result) -> None:
    for batch in result:
        if batch.num_rows:
            _emit(b"\n".join(_json(r) for r in batch.to_pylist()) + b"\n")


def _write_json(result) -> None:
    """One JSON array, one object a line, written batch by batch."""
    first = True
    _emit(b"[")
    for batch in result:
        if not batch.num_rows:
            continue
        _emit((b"\n" if first else b",\n") + b",\n".join(_json(r) for r in batch.to_pylist()))
        first = False
    _emit(b"\n]\n" if not first else b"]\n")


def _write_csv(result) -> None:
    """CSV with a header line; list, struct and map cells are JSON, other types as DuckDB prints them."""
    import csv
    import io

    import pyarrow.csv as pacsv

    head = io.StringIO()
    csv.writer(head, lineterminator="\n").writerow(result.schema.names)
    _emit(head.getvalue().encode())
    options = pacsv.WriteOptions(include_header=False)
    for batch in result:
        if batch.num_rows:
            sink = io.BytesIO()
            pacsv.write_csv(_csv_ready(batch), sink, options)
            _emit(sink.getvalue())


def _csv_ready(batch):
    """The batch with every column the CSV writer cannot write as text: nested values as JSON."""
    import pyarrow as pa

    cols = []
    for col, f in zip(batch.columns, batch.schema):
        t = f.type
        if pa.types.is_nested(t):
            col = pa.array([None if v is None else _json(v).decode() for v in col.to_pylist()], pa.string())
        elif not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t) or pa.types.is_string(t)
                  or pa.types.is_large_string(t) or pa.types.is_boolean(t) or pa.types.is_temporal(t) and not pa.types.is_interval(t)
                  or pa.types.is_binary(t) or pa.types.is_null(t)):
            col = pa.array([None if v is None else _cell(v) for v in col.to_pylist()], pa.string())
        cols.append(col)
    return pa.RecordBatch.from_arrays(cols, names=batch.schema.names)


# -- the table of `forensics query` ----------------------------------------------------------

MIN_CELL = 8  # narrowest a column is cut to (to fit the terminal) before columns are left out


def _cell(v) -> str:
    """A value as the table shows it: no Python reprs (NULL, true/false, JSON for nested values)."""
    if v is None:
        return "NULL"
    if isinstance(v, bool):
        return "true" if v else "false"
    iv = _interval(v)
    if iv is not None:
        return iv
    if isinstance(v, (list, dict, tuple)):
        return _json(v).decode()
    if isinstance(v, bytes):
        v = v.decode("utf-8", "backslashreplace")
    s = str(v)
    return _UNPRINTABLE.sub(lambda m: "\\n" if m.group() == "\n" else f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}",
                            s.replace("\n", "\\n").replace("\t", " "))


def _print_table(result, max_rows: int) -> None:
    import pyarrow as pa
    from rich.cells import cell_len, set_cell_size

    names = list(result.schema.names)
    numeric = [pa.types.is_integer(f.type) or pa.types.is_floating(f.type) or pa.types.is_decimal(f.type) for f in result.schema]
    rows: list[list[str]] = []
    total = 0
    for batch in result:
        want = batch.num_rows if max_rows == 0 else min(batch.num_rows, max_rows - len(rows))
        if want > 0:
            cols = [c.to_pylist() for c in batch.slice(0, want).columns]
            rows.extend([_cell(v) for v in vals] for vals in zip(*cols))
        total += batch.num_rows
    if not names:
        out.print("(no result)", highlight=False)
        return
    room = max(40, out.width)
    widths = [min(room - 4, max([cell_len(n)] + [cell_len(r[i]) for r in rows])) for i, n in enumerate(names)]

    def span(ws: list[int]) -> int:
        return sum(ws) + 3 * len(ws) + 1

    while span(widths) > room and max(widths) > MIN_CELL:  # cut the widest column first
        widest = max(range(len(widths)), key=lambda i: widths[i])
        widths[widest] -= 1
    shown = list(range(len(names)))
    if span(widths) > room:  # still too wide: leave out middle columns, keep the outer ones
        left, right, used = [], [], span([1])  # the "…" column
        lo, hi = 0, len(names) - 1
        while lo <= hi:
            i = lo if len(left) <= len(right) else hi
            if used + widths[i] + 3 > room:
                break
            used += widths[i] + 3
            if i == lo:
                left.append(lo)
                lo += 1
            else:
                right.insert(0, hi)
                hi -= 1
        shown = left + [-1] + right

    def fit(text: str, w: int, right: bool) -> str:
        if cell_len(text) > w:
            text = set_cell_size(text, w - 1) + "\u2026"
        pad = " " * (w - cell_len(text))
        return pad + text if right else text + pad

    def line(cells: list[str]) -> str:
        return " " + " \u2502 ".join(cells).rstrip()

    head = [fit(names[i], widths[i], numeric[i]) if i >= 0 else "\u2026" for i in shown]
    out.print(line(head), highlight=False, markup=False)
    out.print("\u2500" + "\u2500\u253c\u2500".join("\u2500" * (widths[i] if i >= 0 else 1) for i in shown) + "\u2500", highlight=False, markup=False)
    for r in rows:
        out.print(line([fit(r[i], widths[i], numeric[i]) if i >= 0 else "\u2026" for i in shown]), highlight=False, markup=False)
    what = f"{total:,} row{'s' if total != 1 else ''}"
    if len(rows) < total:
        what += f", {len(rows):,} shown"
    if -1 in shown:
        what += f"; {len(names)} columns, {len(shown) - 1} shown"
    out.print(f"({what})", highlight=False, markup=False)


@_command()
def export(
    db: str = DB_OPTION,
    parquet: Optional[str] = typer.Option(None, "--parquet", metavar="DIR", help="Write one <table>.parquet per table into DIR."),
    chrome_trace: Optional[str] = typer.Option(None, "--chrome-trace", metavar="FILE.json", help="Write one merged Chrome/Perfetto trace of all ranks to FILE.json."),
    category: List[str] = typer.Option([], "--category", "-c", metavar="CAT", help="PyTorch profiler category (trace_events.category) to put in the Chrome trace (repeatable; default: kernel, gpu_memcpy, gpu_memset, user_annotation, gpu_user_annotation). Ray timeline events are always in."),
    as_json: bool = typer.Option(False, "--json", help="Print what was written as JSON."),
) -> None:
    """Export the database: Parquet files (--parquet) and/or a Chrome/Perfetto trace (--chrome-trace)."""
    from . import api

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
    run: Optional[str] = RUN_OPTION,
) -> None:
    """Write the self-contained post-mortem HTML: incident card, findings, per-rank phase
    timeline, phases per step, training metrics, file inventory. Works offline."""
    from . import api

    with _spinner(f"writing {output}", err.is_terminal):
        result = api.report(db, output, title, run=run)
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
    run: Optional[str] = RUN_OPTION,
) -> None:
    """Classify what went wrong in the ingested run: root cause with evidence, cascade, remediation.

    Exit status 0 when a verdict was reached (healthy or failed); non-zero only when the
    diagnosis could not run (no database, bad signature files)."""
    from . import api

    with _spinner("diagnosing", err.is_terminal and not as_json):
        result = api.diagnose(db, signatures, context=context, run=run)
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
    from rich.table import Table as RichTable
    from rich.text import Text

    from . import api

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
    from . import api

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
