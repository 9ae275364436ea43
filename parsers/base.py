"""What every parser shares: table declarations and the per-file context.

A parser is a pure function ``parse(stream, ctx) -> Iterator[(table_name, frame)]``
where ``stream`` is a binary file object and ``frame`` is a polars DataFrame or an
Arrow table / record batch whose columns follow the :class:`Table` the parser
declares. Parsers know nothing of DuckDB; ``forensics.store`` loads what they yield.

A parser may also hand over rows it has not decoded: :class:`JsonArrayRows` names a
JSON array it copied to a file of its own and the SELECT (text, for the store to run
with DuckDB's JSON reader) that turns its elements into rows. The parser still knows
nothing of a database: it writes files and text; the store runs the query, checks
that every element became a row, and otherwise has the file parsed again the usual way.

Problems with the input (bad encoding, truncation, corrupt records) are reported
through :meth:`FileContext.problem`, never by raising, so one bad file cannot stop
an ingest. A parser raises only for bugs; the pipeline turns those into a per-file
error too.

Each format says what it is next to its parser, in a :class:`Format`: its name, the
:class:`Sniff` rules that claim a file for it (from its path and first bytes, see
:class:`Head`), their priority against the other formats' rules, its parse function and
the tables it fills. A text format is read by the text splitter (:mod:`.text`), which runs
every :class:`LineFormat` over the lines of every text file. The declarations are found by
:mod:`.registry`; nothing else lists formats.
"""
from __future__ import annotations

import functools
import gzip
import re
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Union

import polars as pl
import pyarrow as pa
from isal import isal_zlib

# What reading a gzip stream raises when its data is cut off (EOFError) or is not gzip
# data or corrupt (gzip.BadGzipFile; ISA-L's inflate raises its own error, zlib's
# zlib.error). A parser reading a possibly compressed stream treats these as the end of
# the data and reports a truncation.
DECOMPRESS_ERRORS: tuple[type[BaseException], ...] = (EOFError, gzip.BadGzipFile, zlib.error, isal_zlib.error)

Frame = Union[pl.DataFrame, pa.Table, pa.RecordBatch]
ParseOutput = Iterator[tuple[str, Frame]]


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    doc: str
    # Store once: a DuckDB expression over the row's other columns that gives this
    # column's usual value (``"text"`` for a message left as the line was). The store
    # keeps the column's own value only where it differs (in a hidden ``_<name>``
    # column) and shows ``coalesce(_<name>, default)`` under the column's name, so
    # queries see the same values. A row's own null cannot be kept apart from "as the
    # default": such a column is never null where its default is not.
    default: str | None = None


@dataclass(frozen=True)
class Table:
    """A table a parser fills. ``doc`` and column docs generate docs/schema.md."""

    name: str
    doc: str
    columns: tuple[Column, ...]

    @property
    def arrow_schema(self) -> pa.Schema:
        return pa.schema([pa.field(c.name, c.type) for c in self.columns])

    @property
    def polars_schema(self) -> dict[str, pl.DataType]:
        empty = pa.Table.from_batches([], schema=self.arrow_schema)
        return dict(pl.from_arrow(empty).schema)

    def empty(self) -> pl.DataFrame:
        return pl.DataFrame(schema=self.polars_schema)

    def conform(self, frame: Frame) -> pa.Table:
        """Return ``frame`` as an Arrow table with exactly this table's columns and types.

        Missing columns become nulls; extra columns are an error (a parser bug).
        """
        if isinstance(frame, pl.DataFrame):
            extra = set(frame.columns) - {c.name for c in self.columns}
            if extra:
                raise ValueError(f"{self.name}: unexpected columns {sorted(extra)}")
            cols = []
            for c in self.columns:
                if c.name in frame.columns:
                    cols.append(frame.get_column(c.name))
                else:
                    cols.append(pl.Series(c.name, [None] * frame.height))
            frame = pl.DataFrame(cols).to_arrow()
        elif isinstance(frame, pa.RecordBatch):
            frame = pa.Table.from_batches([frame])
        extra = set(frame.column_names) - {c.name for c in self.columns}
        if extra:
            raise ValueError(f"{self.name}: unexpected columns {sorted(extra)}")
        arrays = []
        for c in self.columns:
            if c.name in frame.column_names:
                arr = frame.column(c.name)
                if arr.type != c.type:
                    arr = arr.cast(c.type)
                arrays.append(arr)
            else:
                arrays.append(pa.nulls(frame.num_rows, c.type))
        return pa.Table.from_arrays(arrays, schema=self.arrow_schema)


def col(name: str, type_: pa.DataType, doc: str, default: str | None = None) -> Column:
    return Column(name, type_, doc, default)


# Provenance columns shared by every row-level table.
FILE_ID = col("file_id", pa.int32(), "Source file (join `files.file_id`).")
LINE_NO = col("line_no", pa.int64(), "1-based physical line number in the source file (`\\n`-terminated lines, as `grep -n` counts them); for structured files the line where the record starts, or null.")


@dataclass(frozen=True)
class JsonArrayRows:
    """Rows of ``table`` left for the store to read with DuckDB's JSON reader.

    ``select`` is a SELECT over ``read_json(array_path)`` and ``read_parquet(lines_path)``
    that yields the table's columns in order and then a BOOLEAN column ``ok``: false for
    an element that the parser itself would have read differently (a field of an
    unexpected type, ...). The store inserts the rows that are ``ok`` and keeps them
    only when they are exactly ``rows`` (the elements the parser counted); otherwise the
    file is parsed again without a scratch folder."""

    table: str
    array_path: str
    lines_path: str
    rows: int
    select: str


class Stopped(BaseException):
    """The ingest is being stopped (``FileContext.stopping`` said so): nothing of the file
    is kept. A BaseException, as KeyboardInterrupt is, so that no parser's error handling
    takes it for a fault of the file."""


@dataclass
class Problem:
    message: str
    line_no: int | None = None
    kind: str = "error"  # error | warning | truncated


@dataclass
class FileContext:
    """What the pipeline knows about one file before parsing it."""

    file_id: int
    path: str  # relative to the ingested root, '/'-separated
    size: int
    fmt: str
    start_line: int = 1  # first line number to emit (a grown file resumes here)
    start_offset: int = 0  # byte offset ``stream`` is positioned at
    node: str | None = None  # host/IP hinted by the path
    pid: int | None = None  # process id hinted by the file name
    rank: int | None = None  # global rank hinted by the path
    actor: str | None = None  # Ray actor class / role hinted by the file
    scratch: str | None = None  # a folder where the parser may leave JsonArrayRows files (None: it yields frames)
    stopping: Callable[[], bool] | None = None  # True once the ingest is being stopped: a long read may raise Stopped
    problems: list[Problem] = field(default_factory=list)
    lines: int = 0  # physical lines seen (set by the parser)
    unparsed_lines: int = 0  # lines no line-format recognised (set by text parsers)
    truncated: bool = False

    def problem(self, message: str, line_no: int | None = None, kind: str = "error") -> None:
        self.problems.append(Problem(message, line_no, kind))


class ChunkContext:
    """What the line-format modules see besides the frame: the files the frame's lines
    come from (a frame holds one chunk of one big file or many small files whole) and
    state that a big file carries from one chunk to the next (per module, per file)."""

    def __init__(self, files: dict[int, FileContext]):
        self.files = files
        self.state: dict[tuple[str, int], object] = {}

    def problem(self, file_id: int, message: str, line_no: int | None = None, kind: str = "error") -> None:
        self.files[file_id].problem(message, line_no, kind)


# -- what a format says about itself ---------------------------------------------------

SNIFF_BYTES = 64 * 1024  # what detection reads of a file (decompressed) for the sniffs
LINE_SAMPLE = 16 * 1024  # what line shares are counted on: a few hundred lines decide the kind


class Head:
    """What a sniff sees of a file: ``rel``, its path below the ingested root
    ('/'-separated), ``name``, the last part of it, and ``data``, its first bytes
    (decompressed when the file is gzip, ``compressed``). What several rules ask of the
    same file (the stripped bytes, the count of lines matching a pattern, what a path
    says) is worked out once."""

    def __init__(self, rel: str, data: bytes, compressed: bool = False, size: int | None = None):
        self.rel = rel
        self.name = rel.rsplit("/", 1)[-1]
        self.data = data
        self.compressed = compressed
        self.size = size
        self._counts: dict[re.Pattern, int] = {}
        self._derived: dict[Callable, object] = {}

    @functools.cached_property
    def stripped(self) -> bytes:
        """``data`` without leading whitespace."""
        return self.data.lstrip()

    @functools.cached_property
    def lines(self) -> int:
        """Lines in the first ``LINE_SAMPLE`` bytes, at least 1: what a share of lines is a share of."""
        return max(1, self.data[:LINE_SAMPLE].count(b"\n"))

    @functools.cached_property
    def _sample(self) -> bytes:
        return b"\n" + self.data[:LINE_SAMPLE]

    def count(self, pattern: re.Pattern) -> int:
        """How many lines of the first ``LINE_SAMPLE`` bytes ``pattern`` matches at their
        start. The pattern begins with ``\\n`` (the sample gets one in front): ``re`` then
        jumps from newline to newline, where a MULTILINE ``^`` made it try every byte
        (1 s per 8,000 files)."""
        n = self._counts.get(pattern)
        if n is None:
            n = self._counts[pattern] = len(pattern.findall(self._sample))
        return n

    def of(self, fn: Callable[[str], object]):
        """``fn(rel)``, computed once for this file however many rules ask."""
        if fn not in self._derived:
            self._derived[fn] = fn(self.rel)
        return self._derived[fn]


@dataclass(frozen=True)
class Sniff:
    """A rule that claims a file for a format: ``test(head)`` true, and no rule of a higher
    ``priority`` claimed it first. The content decides; a rule on the name alone has a
    lower priority than the rules on the content it would otherwise override."""

    priority: int
    test: Callable[[Head], bool]


TEXT, STRUCTURED = "text", "structured"


@dataclass(frozen=True)
class Format:
    """One input format, declared next to its parser.

    ``name`` is what ``files.format`` says (and, for text, the ``_fmt`` the line formats
    see). ``kind``: ``text`` (the file is read by the text splitter: every line goes to
    ``lines`` and through every :class:`LineFormat`; the format has no ``parse`` of its own,
    only the splitter's format does) or ``structured`` (``parse(stream, ctx)`` yields the
    rows of its own tables). ``sniff``: one rule or several (a format may claim a file
    strongly at one priority and weakly at another). ``tables``: the tables its parser
    fills. ``hints``: what a path says about the process that wrote the file
    (``{"pid", "actor", "rank"}``), asked of every file whatever its format. ``direct``:
    given ``ctx.scratch``, the parser may hand rows over as :class:`JsonArrayRows`.
    ``headed``: every record of such a file starts with a header, so a line without one
    continues the record above it. ``own_output``: the file is what one process (or the
    kernel) wrote itself, not a driver's prefixed copy of many: the diagnosis cites its
    line before a copy of the same failure elsewhere. ``software``: whose logs these are
    (``"ray"``): a run with such a file has the trait ``run:<software>``, which rules can
    ask for (docs/signatures.md)."""

    name: str
    kind: str
    sniff: Sniff | tuple[Sniff, ...]
    parse: Callable[..., ParseOutput] | None = None
    tables: tuple[Table, ...] = ()
    hints: Callable[[str], dict] | None = None
    direct: bool = False
    headed: bool = False
    own_output: bool = False
    software: str | None = None

    def __post_init__(self):
        if isinstance(self.sniff, Sniff):
            object.__setattr__(self, "sniff", (self.sniff,))
        if self.kind not in (TEXT, STRUCTURED):
            raise ValueError(f"format {self.name!r}: kind is {TEXT!r} or {STRUCTURED!r}, not {self.kind!r}")
        if self.kind == STRUCTURED and self.parse is None:
            raise ValueError(f"format {self.name!r}: a structured format needs its parse function")


# A line format's annotator: (lines frame, ChunkContext) -> (lines frame, {table: rows}).
Annotator = Callable[[pl.DataFrame, ChunkContext], tuple[pl.DataFrame, dict[str, pl.DataFrame]]]


@dataclass(frozen=True)
class LineFormat:
    """A family of prefixes or headers that the text splitter looks for on every line of
    every text file (logs are renamed and mixed: a driver log holds NCCL, vLLM, glog and
    metric lines). ``annotate`` recognises them on ``message``, fills provenance columns,
    strips what it recognised and may return rows of ``tables``; it never adds or drops
    lines. The splitter runs them by ``order``, lowest first: a prefix (``(pid=...)``,
    ``[rank3]:``) has to be stripped before the header behind it can be matched."""

    name: str
    order: int
    annotate: Annotator
    tables: tuple[Table, ...] = ()
