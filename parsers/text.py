"""Text logs: split a byte stream into physical lines and run the line-format modules.

Every text file becomes rows of the ``lines`` table, one per physical line (lines end
at ``\\n`` only; a ``\\r`` inside a line does not split it; a last line without
``\\n`` still counts). The file is read in bounded chunks cut at a newline, so
memory does not grow with the file size. A line longer than ``MAX_LINE_BYTES`` (a
progress bar that only ever wrote ``\\r``, a dumped blob) is still one row, but its
``text`` keeps only its first and last ``KEEP_BYTES`` around a marker that says how many
bytes were left out (and a warning in ``problems``); it is never held whole in memory.

Each chunk goes through the line formats (:class:`~.base.LineFormat`, declared by the
modules of :mod:`.lines` and by other packages, see :mod:`.registry`) in their declared
order. Each is a function ``annotate(df, ctx) -> (df, extra_tables)``: it recognises its
prefix or header on ``message``, fills provenance columns, strips what it recognised from
``message`` and may emit rows of its own tables. They never drop or add lines.

This module declares the format ``text``: its parse function reads every text format, and
a file no other format claims is read as text.
"""
from __future__ import annotations

from typing import BinaryIO, Iterator

import polars as pl
import pyarrow as pa

from . import fatal_events, registry
from .base import FILE_ID, LINE_NO, ChunkContext, FileContext, Format, ParseOutput, Sniff, Table, col
from .lines.common import YEARLESS

LINES = Table(
    "lines",
    "Every physical line of every text file, parsed or not. `message` is the line with "
    "the prefixes and headers that were recognised removed; `text` is the line as written.",
    (
        FILE_ID,
        LINE_NO,
        col("byte_offset", pa.int64(), "Byte offset of the line start in the file."),
        col("ts", pa.timestamp("us"), "When the line was written, UTC-naive: printed on the line, or inherited from the nearest earlier stamped line of the file (see `ts_quality`). Null when the file has no stamp before it."),
        col("ts_quality", pa.string(), "`full` (date and time printed), `no_year`/`year_inferred` (the format prints no year: taken from other stamps of the same file, else from the run), `inherited` (the line has no stamp: copied from the nearest earlier stamped line of the same file), or null."),
        col("level", pa.string(), "Severity normalised to DEBUG/INFO/WARNING/ERROR/FATAL when the header has one; a line of a fatal event (a traceback, a crash dump) without one takes the event's: ERROR, or FATAL for a native crash or a fatal record."),
        col("header", pa.string(), "Which line header was recognised: ray_py, ray_cpp, glog, glog_bracket, vllm, sglang, pylog, nccl, kernel, ... (null: none)."),
        col("logger", pa.string(), "Source location or logger named by the header (`file.py:123`, `ProcessGroupNCCL.cpp:616`, `raylet`)."),
        col("actor", pa.string(), "Ray actor class / process role (`WorkerDict`, `TaskRunner`, `raylet`, `EngineCore_0`), from the line prefix or the file."),
        col("pid", pa.int64(), "Process id, from the line prefix/header or the file name."),
        col("tid", pa.int64(), "Thread id when the header prints one."),
        col("node", pa.string(), "Host name or IP of the process that wrote the line, when known (for lines relayed by `docker compose logs`, `kubectl logs --prefix`, pdsh, `srun --label` or SkyPilot, or tagged with a service name: the service, pod, host, task or node the prefix names)."),
        col("rank", pa.int32(), "Global rank, from a `[rankN]:` prefix, the file path or the header."),
        col("local_rank", pa.int32(), "Local rank from a torchrun `[defaultN]:` tee prefix."),
        col("repeat", pa.int32(), "Ray log deduplication: the line stands for this many (`[repeated Nx across cluster]`)."),
        col("event_line", pa.int64(), "For lines that belong to a multi-line event (a Python traceback), the line_no of its first line; else null."),
        col("message", pa.string(), "The line without recognised prefixes/headers and ANSI escapes, no-break spaces (U+00A0) read as spaces; for lines with `\\r` (progress bars) the last non-empty `\\r` segment. Never null.", default='"text"'),
        col("text", pa.string(), "The raw line as decoded (UTF-8; undecodable bytes as U+FFFD), without its `\\n`."),
    ),
)

CHUNK_BYTES = 16 << 20

_ANSI = r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07"


MAX_LINE_BYTES = 2 << 20  # a longer line is stored shortened (see the module doc)
KEEP_BYTES = (MAX_LINE_BYTES - 256) // 2  # kept at each end of a shortened line; the marker fits in the rest


def _utf8_forward(data: bytes, i: int) -> int:
    """``i`` moved past UTF-8 continuation bytes (at most 3): a cut there splits no character."""
    for _ in range(3):
        if i < len(data) and (data[i] & 0xC0) == 0x80:
            i += 1
    return i


def _utf8_back(data: bytes, i: int) -> int:
    """``i`` moved back before UTF-8 continuation bytes (at most 3): ``data[:i]`` splits no character."""
    for _ in range(3):
        if 0 < i < len(data) and (data[i] & 0xC0) == 0x80:
            i -= 1
    return i


def shorten_line(head: bytes, tail: bytes, size: int) -> bytes:
    """What is stored of a line of ``size`` bytes (without its ``\\n``) longer than
    ``MAX_LINE_BYTES``, given its first ``KEEP_BYTES + 4`` bytes and its last ``KEEP_BYTES``:
    both ends, cut at character boundaries, around a marker counting the bytes left out."""
    h = head[: _utf8_back(head, KEEP_BYTES)]
    t = tail[_utf8_forward(tail, 0) :]
    return h + b" [... %d bytes of this line not stored ...] " % (size - len(h) - len(t)) + t


def iter_chunks(stream: BinaryIO, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[bytes, int]]:
    """Yield ``(data, size)``: ``data`` holds whole lines (it ends just after a ``\\n``; the
    last one may not) and stands for the next ``size`` bytes of the stream. They differ
    only for a line longer than ``MAX_LINE_BYTES`` met before its end was read: it comes
    alone, already shortened (:func:`shorten_line`), and is never held whole.

    A last line without ``\\n`` comes with the chunk before it, not alone: a log cut off
    mid-record (a traceback's exception line, a paste) keeps that record in one chunk."""
    rest = b""
    held: tuple[bytes, int] | None = None  # the last chunk, until we know whether only a tail follows
    while True:
        block = stream.read(chunk_bytes)
        if not block:
            if held is not None and rest and len(held[0]) + len(rest) <= chunk_bytes + MAX_LINE_BYTES:
                yield held[0] + rest, held[1] + len(rest)
                return
            if held is not None:
                yield held
            if rest:
                yield rest, len(rest)
            return
        data = rest + block if rest else block
        cut = data.rfind(b"\n")
        if cut < 0:
            rest = data
            if len(rest) > MAX_LINE_BYTES:
                if held is not None:
                    yield held
                    held = None
                line, size, rest = _long_line(rest, stream, chunk_bytes)
                yield line, size
            continue
        if held is not None:
            yield held
        held = (data[: cut + 1], cut + 1)
        rest = data[cut + 1 :]


def _long_line(start: bytes, stream: BinaryIO, chunk_bytes: int) -> tuple[bytes, int, bytes]:
    """Read on to the end of the line that ``start`` (no ``\\n`` in it) begins, keeping only
    its ends; return (shortened line, bytes of the stream it covers, bytes read after it)."""
    head, tail, size = start[: KEEP_BYTES + 4], start[-KEEP_BYTES:], len(start)
    while True:
        block = stream.read(chunk_bytes)
        if not block:
            return shorten_line(head, tail, size), size, b""
        nl = block.find(b"\n")
        piece = block if nl < 0 else block[:nl]
        size += len(piece)
        tail = piece[-KEEP_BYTES:] if len(piece) >= KEEP_BYTES else (tail + piece)[-KEEP_BYTES:]
        if nl >= 0:
            return shorten_line(head, tail, size) + b"\n", size + 1, block[nl + 1 :]


def split_lines(
    chunk: bytes, first_line: int, first_offset: int, size: int | None = None
) -> tuple[pl.DataFrame, int, list[tuple[int, int]]]:
    """Split one chunk into (line_no, byte_offset, text); return also the count of lines
    with undecodable bytes and the (line_no, bytes) of the lines stored shortened.
    ``size``: the stream bytes the chunk stands for, when :func:`iter_chunks` shortened it."""
    body = chunk[:-1] if chunk.endswith(b"\n") else chunk
    texts = None
    try:
        texts = pl.Series("text", [body.decode("utf-8")], dtype=pl.String).str.split("\n").explode()
        sizes = texts.str.len_bytes().cast(pl.Int64)
        bad = 0
        if len(body) > MAX_LINE_BYTES and sizes.max() > MAX_LINE_BYTES:
            texts = None  # a line to shorten: the careful path below
    except UnicodeDecodeError:
        pass
    long: list[tuple[int, int]] = []
    if texts is None:
        raw = body.split(b"\n")
        sizes = pl.Series("sizes", [len(r) for r in raw], dtype=pl.Int64)
        for i, r in enumerate(raw):
            if len(r) > MAX_LINE_BYTES:
                long.append((first_line + i, len(r)))
                raw[i] = shorten_line(r[: KEEP_BYTES + 4], r[-KEEP_BYTES:], len(r))
        decoded_lines = [r.decode("utf-8", "replace") for r in raw]
        bad = sum(1 for r, d in zip(raw, decoded_lines) if "\ufffd" in d and b"\xef\xbf\xbd" not in r)
        texts = pl.Series("text", decoded_lines, dtype=pl.String)
    if size is not None and size > len(chunk):
        long.append((first_line, size - (len(chunk) - len(body))))
    n = len(texts)
    offsets = (sizes + 1).cum_sum().shift(1, fill_value=0) + first_offset
    df = pl.DataFrame(
        {
            "line_no": pl.int_range(first_line, first_line + n, eager=True, dtype=pl.Int64),
            "byte_offset": offsets,
            "text": texts,
        }
    )
    return df, bad, long


def lines_frame(data: bytes, ctx: FileContext, first_line: int, first_offset: int, size: int | None = None) -> pl.DataFrame:
    """One file's chunk as lines, with the file's id, format and hints as columns (so
    lines of many small files can be annotated together in one frame)."""
    df, bad, long = split_lines(data, first_line, first_offset, size)
    if bad:
        ctx.problem(f"{bad} line(s) with bytes that are not UTF-8 (kept, shown as U+FFFD)", int(df["line_no"][0]), "warning")
    for line_no, nbytes in long:
        ctx.problem(f"line {line_no} is {nbytes:,} bytes long: stored its first and last {KEEP_BYTES:,} bytes only", line_no, "warning")
    return df.with_columns(
        pl.lit(ctx.file_id, pl.Int32).alias("file_id"),
        pl.lit(ctx.fmt, pl.String).alias("_fmt"),
        pl.lit(ctx.actor, pl.String).alias("actor"),
        pl.lit(ctx.pid, pl.Int64).alias("pid"),
        pl.lit(ctx.node, pl.String).alias("node"),
        pl.lit(ctx.rank, pl.Int32).alias("rank"),
    )


def base_columns(df: pl.DataFrame) -> pl.DataFrame:
    """Add the empty provenance columns and a cleaned ``message``."""
    text = df.get_column("text")
    message = text
    # only lines with an escape, a \r or a no-break space need work (a when/then would run it on all)
    idx = df.select(pl.arg_where(pl.col("text").str.contains(r"[\x1b\r\u00a0]"))).to_series()
    if not idx.is_empty():
        # a paste copied from a web page has no-break spaces for some of its spaces: headers and
        # tracebacks are read with plain ones
        msg = text.gather(idx).str.replace_all(_ANSI, "").str.replace_all("\u00a0", " ", literal=True)
        # progress bars: keep the last non-empty \r segment
        last_seg = msg.str.replace(r"\r+$", "").str.extract(r"([^\r]*)$", 1)
        cleaned = pl.select(pl.when(msg.str.contains("\r", literal=True)).then(last_seg).otherwise(msg)).to_series()
        message = text.clone().scatter(idx, cleaned)
    return df.with_columns(
        pl.lit(None, pl.Datetime("us")).alias("ts"),
        pl.lit(None, pl.String).alias("ts_quality"),
        pl.lit(None, pl.String).alias("level"),
        pl.lit(None, pl.String).alias("header"),
        pl.lit(None, pl.String).alias("logger"),
        pl.lit(None, pl.Int64).alias("tid"),
        pl.lit(None, pl.Int32).alias("local_rank"),
        pl.lit(None, pl.Int32).alias("repeat"),
        pl.lit(None, pl.Int64).alias("event_line"),
        message.alias("message"),
    )


def mark_continuations(df: pl.DataFrame, always: pl.Expr | bool = False) -> pl.DataFrame:
    """In logs where (almost) every record starts with a header, a line without one
    continues the record above it (Ray's multi-line stats dumps, wrapped messages):
    ``event_line`` = the line_no of that record's header line. ``always``: a per-row
    condition (e.g. on the file format) that applies the rule whatever the share."""
    headed = pl.col("header").is_not_null()
    applies = (headed.mean().over("file_id") >= 0.6) | always
    owner = pl.when(headed).then(pl.col("line_no")).forward_fill().over("file_id")
    return df.with_columns(
        pl.when(applies & ~headed & pl.col("event_line").is_null()).then(owner).otherwise(pl.col("event_line")).alias("event_line")
    )


# who wrote a line: the columns a line of a multi-line event takes from its first line
_WRITER = ("rank", "local_rank", "pid", "actor", "node")


def inherit_from_event(df: pl.DataFrame) -> pl.DataFrame:
    """The lines of a multi-line event (a traceback's frames, a record's continuation
    lines) were written by the process that wrote its first line: where a line names no
    rank, pid, actor or node of its own, it takes its event's first line's. (A traceback
    under an ``[... TP0]`` header: its frames are TP0's too.) An event whose first line lies
    in an earlier chunk is left as it is."""
    if not df.select(pl.col("event_line").is_not_null().any()).item():
        return df
    heads = df.select("file_id", pl.col("line_no").alias("event_line"), *(pl.col(c).alias(f"_e_{c}") for c in _WRITER))
    joined = df.join(heads, on=["file_id", "event_line"], how="left", maintain_order="left")
    return joined.with_columns(pl.coalesce(c, f"_e_{c}").alias(c) for c in _WRITER).drop(f"_e_{c}" for c in _WRITER)


def _headed_formats() -> list[str]:
    """The formats whose every record starts with a header (see :func:`mark_continuations`)."""
    return [f.name for f in registry.formats() if f.headed]


def annotate_chunk(df: pl.DataFrame, cctx: ChunkContext) -> tuple[pl.DataFrame, dict[str, pl.DataFrame]]:
    """Run every line-format module over a lines frame (see :func:`lines_frame`)."""
    df = base_columns(df)
    extras: dict[str, list[pl.DataFrame]] = {}
    for line_format in registry.line_formats():
        df, more = line_format.annotate(df, cctx)
        for name, frame in more.items():
            if frame is not None and frame.height:
                extras.setdefault(name, []).append(frame)
    # multi-line events: tracebacks, native crashes, fatal records (their own table too)
    event_line, event_level, events = fatal_events.find_events(df)
    # the lines of an error event carry its level: `WHERE level = 'ERROR'` finds the
    # exception line of a traceback, not only the log records around it
    df = df.with_columns(event_line.alias("event_line"), pl.coalesce(pl.col("level"), event_level).alias("level"))
    if events.height:
        extras.setdefault(fatal_events.FATAL_EVENTS.name, []).append(events)
    df = mark_continuations(df, always=pl.col("_fmt").is_in(_headed_formats()))
    df = inherit_from_event(df)
    df = _finish_timestamps(df, cctx)
    unparsed = df.group_by("file_id").agg(
        (pl.col("header").is_null() & pl.col("event_line").is_null() & pl.col("message").str.strip_chars().ne("")).sum().alias("u"),
        pl.len().alias("n"),
    )
    for fid, u, n in unparsed.iter_rows():
        cctx.files[fid].unparsed_lines += int(u)
        cctx.files[fid].lines += int(n)
    stamps = df.select("file_id", "line_no", pl.col("ts").alias("_line_ts"))
    out = {name: _line_stamped(pl.concat(frames, how="diagonal_relaxed"), stamps) for name, frames in extras.items()}
    return df.select([c.name for c in LINES.columns]), out


def parse_text(stream: BinaryIO, ctx: FileContext, chunk_bytes: int = CHUNK_BYTES) -> ParseOutput:
    """Parse one text log, chunk by chunk, into ``lines`` plus the line-format tables."""
    cctx = ChunkContext({ctx.file_id: ctx})
    line_no = ctx.start_line
    offset = ctx.start_offset
    for chunk, size in iter_chunks(stream, chunk_bytes):
        df = lines_frame(chunk, ctx, line_no, offset, size)
        line_no += df.height
        offset += size
        lines, extras = annotate_chunk(df, cctx)
        yield "lines", lines
        yield from extras.items()


def parse_text_batch(sources: list[tuple[bytes, FileContext]]) -> ParseOutput:
    """Parse many small text files (each given whole) in one frame: the per-file cost of
    the vectorised pipeline is paid once per batch instead of once per file."""
    frames = []
    whole: list[tuple[str, FileContext]] = []
    for data, ctx in sources:
        if not data:
            continue
        try:
            whole.append((data.decode("utf-8"), ctx))
        except UnicodeDecodeError:
            frames.append(lines_frame(data, ctx, ctx.start_line, ctx.start_offset))  # the careful path
    if whole:
        frames.append(_split_many(whole))
    if not frames:
        return
    cctx = ChunkContext({ctx.file_id: ctx for _, ctx in sources})
    lines, extras = annotate_chunk(pl.concat(frames, how="vertical_relaxed") if len(frames) > 1 else frames[0], cctx)
    yield "lines", lines
    yield from extras.items()


def _split_many(files: list[tuple[str, FileContext]]) -> pl.DataFrame:
    """:func:`lines_frame` for many decoded files at once (one split, one explode)."""
    per_file = pl.DataFrame(
        {
            "file_id": [c.file_id for _, c in files],
            "_fmt": [c.fmt for _, c in files],
            "actor": [c.actor for _, c in files],
            "pid": [c.pid for _, c in files],
            "node": [c.node for _, c in files],
            "rank": [c.rank for _, c in files],
            "_l0": [c.start_line for _, c in files],
            "_o0": [c.start_offset for _, c in files],
            "text": [t[:-1] if t.endswith("\n") else t for t, _ in files],
        },
        schema={"file_id": pl.Int32, "_fmt": pl.String, "actor": pl.String, "pid": pl.Int64, "node": pl.String,
                "rank": pl.Int32, "_l0": pl.Int64, "_o0": pl.Int64, "text": pl.String},
    )
    size = pl.col("text").str.len_bytes().cast(pl.Int64) + 1
    df = per_file.with_columns(pl.col("text").str.split("\n")).explode("text")
    df = df.with_columns(
        (pl.int_range(pl.len(), dtype=pl.Int64).over("file_id") + pl.col("_l0")).alias("line_no"),
        (size.cum_sum().over("file_id") - size + pl.col("_o0")).alias("byte_offset"),
    )
    return df.select("line_no", "byte_offset", "text", "file_id", "_fmt", "actor", "pid", "node", "rank")


def _line_stamped(frame: pl.DataFrame, stamps: pl.DataFrame) -> pl.DataFrame:
    """Rows a line-format module derived from lines take the line's final ``ts`` (year
    inferred, inherited), which is only known once the whole chunk is annotated.

    ``stamps`` holds the chunk's lines in frame order, each file's lines together and
    numbered on without gaps, so a row's line is found by position (the file's first
    row + how far its line_no lies past the file's first line), not by a join of every
    row on (file_id, line_no). A line_no outside its file's lines (or null) gets null,
    as the left join it replaces gave."""
    if "ts" not in frame.columns or "line_no" not in frame.columns or "file_id" not in frame.columns:
        return frame
    starts = stamps.with_row_index("_pos").group_by("file_id").agg(
        pl.col("_pos").first().cast(pl.Int64).alias("_pos"), pl.col("line_no").first().alias("_first"), pl.len().alias("_n"),
        ((pl.col("_pos").last() - pl.col("_pos").first() + 1 == pl.len())
         & (pl.col("line_no").last() - pl.col("line_no").first() + 1 == pl.len())).alias("_dense"))
    if not starts.get_column("_dense").all():  # not the layout above: the join
        return frame.join(stamps, on=["file_id", "line_no"], how="left", maintain_order="left").with_columns(
            pl.col("_line_ts").alias("ts")).drop("_line_ts")
    located = frame.select("file_id", "line_no").join(starts, on="file_id", how="left", maintain_order="left")
    past = pl.col("line_no") - pl.col("_first")
    idx = located.select(pl.when((past >= 0) & (past < pl.col("_n"))).then(pl.col("_pos") + past)).to_series()
    return frame.with_columns(stamps.get_column("_line_ts").gather(idx).alias("ts"))


def _finish_timestamps(df: pl.DataFrame, cctx: ChunkContext) -> pl.DataFrame:
    """Year-less stamps take the year of their file's full stamps when it has some (the
    store fixes the rest run-wide); stamp-less lines inherit the previous stamp of
    their file. A big file carries its year and last stamp across chunks."""
    full_year = pl.when(pl.col("ts_quality") == "full").then(pl.col("ts").dt.year()).min().over("file_id")
    carried = {fid: cctx.state.get(("ts", fid)) for fid in cctx.files}
    prev_year = pl.col("file_id").replace_strict({f: (v or (None, None))[0] for f, v in carried.items()}, default=None, return_dtype=pl.Int32)
    prev_ts = pl.col("file_id").replace_strict({f: (v or (None, None))[1] for f, v in carried.items()}, default=None, return_dtype=pl.Datetime("us"))
    df = df.with_columns(pl.coalesce(prev_year, full_year).alias("_year"))
    no_year = (pl.col("ts_quality") == "no_year") & pl.col("_year").is_not_null()
    df = df.with_columns(
        pl.when(no_year).then(pl.col("ts").dt.offset_by(pl.format("{}y", pl.col("_year") - YEARLESS))).otherwise(pl.col("ts")).alias("ts"),
        pl.when(no_year).then(pl.lit("year_inferred")).otherwise(pl.col("ts_quality")).alias("ts_quality"),
    )
    filled = pl.coalesce(pl.col("ts").forward_fill().over("file_id"), prev_ts)
    df = df.with_columns(
        pl.when(pl.col("ts").is_not_null()).then(pl.col("ts_quality")).when(filled.is_not_null()).then(pl.lit("inherited")).alias("ts_quality"),
        filled.alias("ts"),
    )
    last = df.group_by("file_id").agg(pl.col("_year").first(), pl.col("ts").drop_nulls().last())
    for fid, year, ts in last.iter_rows():
        cctx.state[("ts", fid)] = (year, ts)
    return df.drop("_year")


FORMATS = (
    Format(
        "text", "text", parse=parse_text, tables=(LINES, fatal_events.FATAL_EVENTS),
        sniff=(
            # a JSON object no format claimed: its lines, even with control bytes in them
            # (tried before the binary check of forensics.detect)
            Sniff(600, lambda h: h.stripped[:1] == b"{"),
            Sniff(0, lambda h: True),  # any other text: what no format claims
        ),
    ),
)
