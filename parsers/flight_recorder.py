"""PyTorch Flight Recorder dumps (``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` / ``TORCH_FR_*``).

On a collective timeout each rank writes its ring buffer of recent collectives to
``<TORCH_FR_DUMP_TEMP_FILE prefix><rank>`` (default ``/tmp/nccl_trace_rank_<rank>``) as a
pickle of plain containers::

    {"version": "2.10", "comm_lib_version": "2.28.9",
     "pg_config": {"<pg name>": {"name": .., "desc": "default_pg", "ranks": "[0, 1]"}},
     "pg_status": {"<pg id>": {"last_enqueued_collective": 53, "last_started_collective": -1,
                               "last_completed_collective": 39}},
     "entries": [{"record_id": 0, "pg_id": 0, "process_group": ("0", "default_pg"),
                  "collective_seq_id": 1, "p2p_seq_id": 0, "op_id": 1,
                  "profiling_name": "nccl:all_reduce", "state": "completed", "frames": [..],
                  "time_created_ns": .., "time_discovered_started_ns": .., ...}, ...]}

The dump names no rank of its own: the rank is the one the path suggests, else the digits
that end the file name (the rank torch appends to the prefix).

A pickle from a log folder is untrusted input. It is loaded with an unpickler that
refuses every global (so no class is built and no function is called; only dicts,
lists, tuples, strings, numbers, booleans and None come out); a refusal is reported
as a problem and nothing of the file is loaded. Truncated dumps (a rank killed while
writing) keep the metadata and the complete entries before the cut: they are rebuilt
by a small reader that only knows the container opcodes and never calls anything.
"""
from __future__ import annotations

import copyreg
import io
import json
import pickle
import pickletools
import re
from typing import Any, BinaryIO

import polars as pl
import pyarrow as pa

from .base import FILE_ID, LINE_NO, FileContext, Format, ParseOutput, Sniff, Table, col

MAX_BYTES = 1 << 30  # a dump larger than this is not read
# Values converted per dump: a plain pickle holds about one value per byte, a few per byte
# where it shares references (torch shares the frame dicts of its entries). A small file
# that expands into far more is a shared-reference bomb.
NODES_PER_BYTE = 16
MIN_NODES = 100_000
MAX_DEPTH = 64

_RANK = col("rank", pa.int32(), "Rank that wrote the dump (from the path, else the digits ending the file name).")

FR_DUMPS = Table(
    "fr_dumps",
    "One row per Flight Recorder dump file, also when it could not be (fully) read: `status` says how far it was read.",
    (
        FILE_ID,
        _RANK,
        col("status", pa.string(), "`ok`, `truncated` (complete entries before the cut were kept), `refused` (the pickle asks for a global: not loaded), `corrupt` (not a readable pickle), `unexpected` (a pickle, but not a dump's layout), `too_large`."),
        col("version", pa.string(), "Dump format version (`2.10`)."),
        col("comm_lib_version", pa.string(), "NCCL version recorded in the dump (`comm_lib_version`, older `nccl_version`)."),
        col("n_entries", pa.int64(), "Entries in the dump (read)."),
        col("pg_config", pa.string(), "`pg_config` as JSON text: process group name -> {name, desc, ranks}."),
        col("pg_status", pa.string(), "`pg_status` as JSON text: process group id -> last enqueued/started/completed collective."),
        col("other", pa.string(), "Other top-level keys (e.g. `nccl_comm_state`) as JSON text."),
    ),
)

FR_GROUPS = Table(
    "fr_groups",
    "Process groups of a dump: `pg_config` joined with `pg_status` (linked through the entries' `pg_id`/`process_group`).",
    (
        FILE_ID,
        _RANK,
        col("pg_id", pa.int32(), "Process group id (key of `pg_status`, `pg_id` of the entries)."),
        col("pg_name", pa.string(), "Process group name/GUID (key of `pg_config`)."),
        col("pg_desc", pa.string(), "Description (`default_pg`, ...)."),
        col("ranks", pa.list_(pa.int32()), "Global ranks of the group."),
        col("size", pa.int32(), "Number of ranks of the group."),
        col("last_enqueued", pa.int64(), "`last_enqueued_collective` of `pg_status`."),
        col("last_started", pa.int64(), "`last_started_collective` (-1 when start times are not recorded)."),
        col("last_completed", pa.int64(), "`last_completed_collective`."),
    ),
)

FR_ENTRIES = Table(
    "fr_entries",
    "Collectives and p2p ops recorded by the Flight Recorder of one rank (its ring buffer: the most recent ones).",
    (
        FILE_ID,
        LINE_NO,
        _RANK,
        col("record_id", pa.int64(), "Position in the recorder (increasing)."),
        col("pg_id", pa.int32(), "Process group id."),
        col("pg_name", pa.string(), "Process group name/GUID (`process_group[0]`)."),
        col("pg_desc", pa.string(), "Process group description (`process_group[1]`)."),
        col("collective_seq_id", pa.int64(), "Sequence number among the group's collectives (the watchdog's `SeqNum`); older dumps: `seq_id`."),
        col("p2p_seq_id", pa.int64(), "Sequence number among the group's p2p ops."),
        col("op_id", pa.int64(), "Sequence number counting the ops inside coalesced groups."),
        col("op", pa.string(), "`profiling_name` (`nccl:all_reduce`, `nccl:_all_gather_base`, `nccl:send 0->1`, ...)."),
        col("is_p2p", pa.bool_(), "Point-to-point op."),
        col("state", pa.string(), "`scheduled` (enqueued, not seen started), `started`, `completed`."),
        col("retired", pa.bool_(), "The watchdog retired the work."),
        col("input_sizes", pa.string(), "Input tensor sizes, JSON text (`[[32768000]]`)."),
        col("input_dtypes", pa.string(), "Input dtypes, JSON text (`[\"Float\"]`)."),
        col("output_sizes", pa.string(), "Output tensor sizes, JSON text."),
        col("output_dtypes", pa.string(), "Output dtypes, JSON text."),
        col("time_created", pa.timestamp("us"), "When the work was enqueued (UTC)."),
        col("time_discovered_started", pa.timestamp("us"), "When the watchdog saw it start (null unless timing is enabled)."),
        col("time_discovered_completed", pa.timestamp("us"), "When the watchdog saw it complete."),
        col("duration_ms", pa.float64(), "GPU duration when recorded."),
        col("timeout_ms", pa.int64(), "Timeout of the work."),
        col("thread_name", pa.string(), "Thread that enqueued it (`python3`, `pt_autograd_0`)."),
        col("thread_id", pa.string(), "Its id."),
        col("frames", pa.string(), "Python stack when enqueued, innermost first, one `name (file:line)` per line."),
        col("user_frame", pa.string(), "Innermost frame outside torch's own files (where the program called in)."),
    ),
)


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle asked for a global (a class or function): the file is not loaded."""


class _PlainUnpickler(pickle.Unpickler):
    """Builds only plain containers and scalars: every global and persistent id is refused,
    so nothing from the file can be called."""

    def find_class(self, module: str, name: str):
        raise RefusedGlobal(f"global {module}.{name}")

    def persistent_load(self, pid):
        raise RefusedGlobal(f"persistent id {str(pid)[:80]!r}")


class _TooBig(ValueError):
    """The structure is too deep or too large to convert."""


def rank_from_name(path: str) -> int | None:
    """The rank torch appends to the dump prefix: the digits ending the file name."""
    m = re.search(r"(\d+)(?:\.(?:pkl|pickle|bin))?$", path.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def load_plain(data: bytes) -> tuple[Any, int]:
    """Unpickle ``data`` admitting only plain values; returns (object, bytes consumed).
    Raises :class:`RefusedGlobal` for a global, other exceptions for bad data."""
    if copyreg._extension_cache:
        # pickle's EXT opcodes take an object already in this cache without asking
        # find_class: refuse them up front (the cache is empty unless some code in this
        # process registered extension codes and unpickled them)
        _refuse_extensions(data)
    buf = io.BytesIO(data)
    obj = _PlainUnpickler(buf).load()
    return obj, buf.tell()


def _refuse_extensions(data: bytes) -> None:
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("EXT1", "EXT2", "EXT4"):
                raise RefusedGlobal(f"extension code {arg}")
    except RefusedGlobal:
        raise
    except (ValueError, EOFError):  # bad or cut data: the unpickler says what is wrong
        return


_LOAD_ERRORS = (
    pickle.UnpicklingError, EOFError, ValueError, KeyError, IndexError, TypeError,
    AttributeError, UnicodeDecodeError, OverflowError, RecursionError, MemoryError,
)


def parse_dump(stream: BinaryIO, ctx: FileContext) -> ParseOutput:
    data = stream.read(MAX_BYTES + 1)
    rank = ctx.rank if ctx.rank is not None else rank_from_name(ctx.path)
    dump = {"file_id": ctx.file_id, "rank": rank}
    if len(data) > MAX_BYTES:
        ctx.problem(f"Flight Recorder dump larger than {MAX_BYTES} bytes: not read")
        yield "fr_dumps", pl.DataFrame([{**dump, "status": "too_large"}])
        return
    if rank is None:
        ctx.problem("Flight Recorder dump: no rank in the path or file name", None, "warning")
    partial: set[int] = set()
    try:
        obj, used = load_plain(data)
        status = "ok"
        if used < len(data):
            ctx.problem(f"{len(data) - used} byte(s) after the end of the pickle ignored", None, "warning")
    except RefusedGlobal as exc:
        ctx.problem(f"refused to load the pickle: it asks for {exc} (only plain data is admitted; nothing was run or loaded)")
        yield "fr_dumps", pl.DataFrame([{**dump, "status": "refused"}])
        return
    except _LOAD_ERRORS as exc:
        if not _is_truncation(exc, data):
            ctx.problem(f"not a readable pickle: {exc.__class__.__name__}: {exc}")
            yield "fr_dumps", pl.DataFrame([{**dump, "status": "corrupt"}])
            return
        ctx.truncated = True
        obj, partial, reason = salvage(data)
        status = "truncated"
        ctx.problem(f"Flight Recorder dump truncated after {len(data)} bytes ({reason}); complete entries before the cut kept", None, "truncated")
    if not isinstance(obj, dict) or not isinstance(obj.get("entries", []), list):
        what = type(obj).__name__ if obj is not None else "nothing readable"
        if status == "ok":
            ctx.problem(f"a pickle, but not a Flight Recorder dump (top level: {what})")
            status = "unexpected"
        yield "fr_dumps", pl.DataFrame([{**dump, "status": status}])
        return
    yield from _tables(obj, partial, dump, status, ctx, MIN_NODES + NODES_PER_BYTE * len(data))


def _is_truncation(exc: BaseException, data: bytes) -> bool:
    if isinstance(exc, EOFError):
        return True
    text = str(exc)
    return "truncated" in text or "ran out of input" in text.lower() or (len(data) < 2)


def _tables(obj: dict, partial: set[int], dump: dict, status: str, ctx: FileContext, max_nodes: int) -> ParseOutput:
    budget = [max_nodes]
    raw_entries = obj.get("entries") or []
    entries = [e for e in raw_entries if isinstance(e, dict) and id(e) not in partial]
    dropped_partial = sum(1 for e in raw_entries if isinstance(e, dict) and id(e) in partial)
    not_dicts = sum(1 for e in raw_entries if not isinstance(e, dict))
    if not_dicts:
        ctx.problem(f"{not_dicts} of {len(raw_entries)} entries are not dicts: skipped")
    if dropped_partial:
        ctx.problem(f"{dropped_partial} entry cut off by the truncation: skipped", None, "truncated")
    try:
        other = {k: v for k, v in obj.items() if k not in ("entries", "pg_config", "pg_status", "version", "comm_lib_version", "nccl_version")}
        row = {
            **dump,
            "status": status,
            "version": _text(obj.get("version")),
            "comm_lib_version": _text(obj.get("comm_lib_version", obj.get("nccl_version"))),
            "n_entries": len(entries),
            "pg_config": _json(obj.get("pg_config"), budget),
            "pg_status": _json(obj.get("pg_status"), budget),
            "other": _json(other, budget) if other else None,
        }
        rows = [_entry_row(e, dump, budget) for e in entries]
    except _TooBig as exc:
        ctx.problem(f"Flight Recorder dump not loaded: {exc}")
        yield "fr_dumps", pl.DataFrame([{**dump, "status": "corrupt"}])
        return
    yield "fr_dumps", pl.DataFrame([row], schema_overrides=FR_DUMPS.polars_schema)
    groups = _group_rows(obj, entries, dump)
    if groups:
        yield "fr_groups", pl.DataFrame(groups, schema_overrides=FR_GROUPS.polars_schema, infer_schema_length=None)
    if rows:
        frame = pl.DataFrame(rows, schema=_ENTRY_SCHEMA)
        ns = ["time_created", "time_discovered_started", "time_discovered_completed"]
        frame = frame.with_columns(
            pl.when(pl.col(c) > 0).then(pl.col(c)).cast(pl.Datetime("ns")).cast(pl.Datetime("us")).alias(c) for c in ns
        )
        yield "fr_entries", frame


_ENTRY_SCHEMA = {
    "file_id": pl.Int32, "rank": pl.Int32, "record_id": pl.Int64, "pg_id": pl.Int32, "pg_name": pl.String,
    "pg_desc": pl.String, "collective_seq_id": pl.Int64, "p2p_seq_id": pl.Int64, "op_id": pl.Int64,
    "op": pl.String, "is_p2p": pl.Boolean, "state": pl.String, "retired": pl.Boolean,
    "input_sizes": pl.String, "input_dtypes": pl.String, "output_sizes": pl.String, "output_dtypes": pl.String,
    "time_created": pl.Int64, "time_discovered_started": pl.Int64, "time_discovered_completed": pl.Int64,
    "duration_ms": pl.Float64, "timeout_ms": pl.Int64, "thread_name": pl.String, "thread_id": pl.String,
    "frames": pl.String, "user_frame": pl.String,
}


def _entry_row(e: dict, dump: dict, budget: list[int]) -> dict:
    pg = e.get("process_group")
    pg_name = _text(pg[0]) if isinstance(pg, (list, tuple)) and len(pg) > 0 else None
    pg_desc = _text(pg[1]) if isinstance(pg, (list, tuple)) and len(pg) > 1 else None
    frames = e.get("frames") if isinstance(e.get("frames"), list) else []
    lines, user = [], None
    for f in frames[:200]:
        if not isinstance(f, dict):
            continue
        fname = _text(f.get("filename")) or "?"
        where = f"{_text(f.get('name')) or '?'} ({fname}:{_int(f.get('line'))})"
        lines.append(where)
        if user is None and "/torch/" not in fname and not fname.startswith("<"):
            user = where
    return {
        **dump,
        "record_id": _int(e.get("record_id")),
        "pg_id": _int(e.get("pg_id")),
        "pg_name": pg_name,
        "pg_desc": pg_desc,
        "collective_seq_id": _int(e.get("collective_seq_id", e.get("seq_id"))),
        "p2p_seq_id": _int(e.get("p2p_seq_id")),
        "op_id": _int(e.get("op_id")),
        "op": _text(e.get("profiling_name")),
        "is_p2p": e.get("is_p2p") if isinstance(e.get("is_p2p"), bool) else None,
        "state": _text(e.get("state")),
        "retired": e.get("retired") if isinstance(e.get("retired"), bool) else None,
        "input_sizes": _json(e.get("input_sizes"), budget),
        "input_dtypes": _json(e.get("input_dtypes"), budget),
        "output_sizes": _json(e.get("output_sizes"), budget),
        "output_dtypes": _json(e.get("output_dtypes"), budget),
        "time_created": _int(e.get("time_created_ns")),
        "time_discovered_started": _int(e.get("time_discovered_started_ns")),
        "time_discovered_completed": _int(e.get("time_discovered_completed_ns")),
        "duration_ms": _float(e.get("duration_ms")),
        "timeout_ms": _int(e.get("timeout_ms")),
        "thread_name": _text(e.get("thread_name")),
        "thread_id": _text(e.get("thread_id")),
        "frames": "\n".join(lines) if lines else None,
        "user_frame": user,
    }


def _group_rows(obj: dict, entries: list[dict], dump: dict) -> list[dict]:
    config = obj.get("pg_config") if isinstance(obj.get("pg_config"), dict) else {}
    status = obj.get("pg_status") if isinstance(obj.get("pg_status"), dict) else {}
    id_of: dict[str, int] = {}
    for e in entries:
        pg = e.get("process_group")
        pid = _int(e.get("pg_id"))
        if isinstance(pg, (list, tuple)) and pg and pid is not None:
            id_of.setdefault(_text(pg[0]), pid)
    rows, used = [], set()
    for name, cfg in config.items():
        cfg = cfg if isinstance(cfg, dict) else {}
        name = _text(cfg.get("name", name))
        pg_id = id_of.get(name)
        st_key = str(pg_id) if pg_id is not None and str(pg_id) in status else (name if name in status else None)
        used.add(st_key)
        ranks = _ranks(cfg.get("ranks"))
        rows.append({**dump, "pg_id": pg_id if pg_id is not None else _int(name), "pg_name": name,
                     "pg_desc": _text(cfg.get("desc")), "ranks": ranks,
                     "size": len(ranks) if ranks is not None else None, **_status(status.get(st_key))})
    for key, st in status.items():
        if key not in used:
            rows.append({**dump, "pg_id": _int(key), "pg_name": None, "pg_desc": None, "ranks": None, "size": None, **_status(st)})
    return rows


def _status(st: Any) -> dict:
    st = st if isinstance(st, dict) else {}
    return {
        "last_enqueued": _int(st.get("last_enqueued_collective")),
        "last_started": _int(st.get("last_started_collective")),
        "last_completed": _int(st.get("last_completed_collective")),
    }


def _ranks(value: Any) -> list[int] | None:
    """``ranks`` is printed as text (``"[0, 1]"``) by torch; lists are accepted too."""
    if isinstance(value, str):
        nums = re.findall(r"-?\d+", value)
        return [int(n) for n in nums] if value.strip().startswith("[") else None
    if isinstance(value, (list, tuple)):
        out = [_int(v) for v in value]
        return [v for v in out if v is not None]
    return None


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if -(1 << 63) <= value < (1 << 63) else None
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d{1,18}\s*", value):
        return int(value)
    return None


def _float(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float, bool)):
        return str(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return None


def _plain(value: Any, budget: list[int], depth: int = 0) -> Any:
    """A JSON-able copy of a plain value, within the node and depth budget."""
    budget[0] -= 1
    if budget[0] < 0:
        raise _TooBig("it expands into far more values than its size allows (shared references)")
    if depth > MAX_DEPTH:
        raise _TooBig(f"nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {str(_text(k) if _text(k) is not None else repr(type(k).__name__)): _plain(v, budget, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v, budget, depth + 1) for v in value]
    return repr(type(value).__name__)


def _json(value: Any, budget: list[int]) -> str | None:
    if value is None:
        return None
    return json.dumps(_plain(value, budget), allow_nan=True)


# -- truncated dumps -----------------------------------------------------------------

_PUSH_ARG = {
    "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8",
    "SHORT_BINSTRING", "BINSTRING", "STRING", "BININT", "BININT1", "BININT2", "INT", "LONG", "LONG1", "LONG4",
    "BINFLOAT", "FLOAT", "BYTEARRAY8",
}
_CONSTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}


def salvage(data: bytes) -> tuple[Any, set[int], str]:
    """Rebuild what a truncated pickle holds up to the cut, running only container opcodes.

    Returns (top-level object or None, ids of containers still open at the cut, why the
    reading stopped). Open containers are closed with what they had; callers drop the
    ones that were still being filled (their ids are returned)."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    reason = "cut inside the pickle"
    try:
        for op, arg, _pos in pickletools.genops(data):
            name = op.name
            if name in ("PROTO", "FRAME"):
                continue
            if name == "STOP":
                reason = "complete"
                break
            if name in _PUSH_ARG:
                stack.append(arg)
            elif name in _CONSTS:
                stack.append(_CONSTS[name])
            elif name == "EMPTY_DICT":
                stack.append({})
            elif name == "EMPTY_LIST":
                stack.append([])
            elif name == "EMPTY_TUPLE":
                stack.append(())
            elif name == "MARK":
                marks.append(len(stack))
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[arg] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                stack.append(memo[arg])
            elif name == "SETITEM":
                v, k = stack.pop(), stack.pop()
                stack[-1][k] = v
            elif name in ("SETITEMS", "APPENDS", "TUPLE", "LIST", "DICT", "POP_MARK"):
                items = stack[marks[-1]:]
                del stack[marks.pop():]
                if name == "SETITEMS":
                    stack[-1].update(zip(items[::2], items[1::2]))
                elif name == "APPENDS":
                    stack[-1].extend(items)
                elif name == "TUPLE":
                    stack.append(tuple(items))
                elif name == "LIST":
                    stack.append(list(items))
                elif name == "DICT":
                    stack.append(dict(zip(items[::2], items[1::2])))
            elif name == "APPEND":
                v = stack.pop()
                stack[-1].append(v)
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                items = tuple(stack[-n:])
                del stack[-n:]
                stack.append(items)
            elif name == "POP":
                stack.pop()
            elif name == "DUP":
                stack.append(stack[-1])
            else:
                reason = f"stopped at opcode {name}, which a dump does not use"
                break
    except ValueError as exc:  # genops could not read the next opcode: the cut
        reason = f"cut: {exc}"
    except (IndexError, KeyError, TypeError, AttributeError) as exc:
        reason = f"unreadable before the cut: {exc.__class__.__name__}"
    open_ids: set[int] = set()
    if stack and isinstance(stack[-1], (dict, list)) and not stack[-1] and reason != "complete":
        open_ids.add(id(stack[-1]))  # cut between a container and the MARK of its items
    while marks:
        start = marks.pop()
        items = stack[start:]
        del stack[start:]
        if not stack:
            break
        owner = stack[-1]
        open_ids.add(id(owner))
        if isinstance(owner, dict):
            for k, v in zip(items[::2], items[1::2]):
                try:
                    owner[k] = v
                except TypeError:
                    break
        elif isinstance(owner, list):
            owner.extend(items)
    return (stack[0] if stack else None), open_ids, reason


def _is_pickle(h) -> bool:
    """A pickle of protocol 2 to 5 (its PROTO opcode): what torch writes a dump as."""
    return h.data[:1] == b"\x80" and h.data[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")


FORMATS = (
    Format("flight_recorder", "structured", parse=parse_dump, tables=(FR_DUMPS, FR_GROUPS, FR_ENTRIES),
           sniff=Sniff(900, _is_pickle)),
)
