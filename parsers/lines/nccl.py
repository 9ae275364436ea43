"""NCCL debug output (NCCL_DEBUG=INFO/WARN, NCCL_DEBUG_FILE files, or behind Ray prefixes).

Line styles:

* ``<host>:<pid>:<tid> [<cudaDev>] NCCL INFO <msg>``
* ``<host>:<pid>:<tid> [<cudaDev>] <src file>:<line> NCCL WARN <msg>``
* newer NCCL adds a timestamp: ``[YYYY-MM-DD HH:MM:SS] <host>:<pid>:<tid> [<dev>] ...``
* the un-prefixed banner ``NCCL version 2.21.5+cuda12.4`` (newer NCCL also prints it
  as an INFO line).

``[<cudaDev>]`` is the local CUDA device, not the global rank (proxy threads even print
the device of another thread). Ranks come from the communicator lines
(``ncclCommInitRank[Config] comm <ptr> rank <r> nranks <n> cudaDev <d> ... - Init START``):
within one chunk the NCCL lines of a process (host + pid) get the rank it holds in its
largest communicator, and per-collective lines get the rank of their own communicator.
The view ``nccl_rank_map`` (forensics/sql/30_nccl.sql) does the same across files.

Besides recognising the header, this module fills these tables:

* ``nccl_comms``: communicator init/abort/destroy lines;
* ``nccl_topology``: rings, trees, per-peer transports, chosen interfaces and networks;
* ``nccl_env``: ``NCCL_* set by environment to ...`` echoes;
* ``nccl_errors``: WARN lines and the return-code trail (``file.cc:123 -> 2``);
* ``nccl_colls``: per-collective lines of ``NCCL_DEBUG_SUBSYS=COLL``.
"""
from __future__ import annotations

import re

import polars as pl
import pyarrow as pa

from ..base import FILE_ID, LINE_NO, FileContext, Format, LineFormat, Sniff, Table, col
from .common import apply_header, g, normalise_level, parse_ts

HEADER = (
    r"^(?P<h>(?:\[(?P<ts>\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:\.\d+)?)\] )?"
    r"(?P<host>[\w.\-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] (?:(?P<src>[\w./-]+:\d+) )?NCCL (?P<level>INFO|WARN|TRACE|ABORT|ERROR)\b ?)"
)
BANNER = r"^NCCL version (\S+)"

_TS = col("ts", pa.timestamp("us"), "When the line was written (the line's `ts`).")
_NODE = col("node", pa.string(), "Node of the writing process as the line knows it (Ray `ip=` prefix, folder layout, else the NCCL host name).")
_HOST = col("host", pa.string(), "Host name printed in the NCCL header.")
_PID = col("pid", pa.int64(), "Process id printed in the NCCL header.")
_TID = col("tid", pa.int64(), "Thread id printed in the NCCL header.")
_RANK = col("rank", pa.int32(), "Rank of the process: from the line (`[rankN]:`, the file path) or, within the same chunk, from the communicator init line of the same host and pid.")

NCCL_COMMS = Table(
    "nccl_comms",
    "NCCL communicator lines: `ncclCommInitRank[Config]`/`ncclCommSplit ... - Init START|COMPLETE`, "
    "`comm <ptr> rank <r> nRanks <n> nNodes ...`, `... - Abort|Destroy START|COMPLETE`. One row per line; "
    "a communicator is (host, pid, comm).",
    (
        FILE_ID, LINE_NO, _TS, _NODE, _HOST, _PID, _TID,
        col("dev", pa.int32(), "The `[dev]` of the header (local CUDA device of the printing thread)."),
        col("event", pa.string(), "`init_start`, `init_complete`, `abort_start`, `abort_complete`, `destroy_start`, `destroy_complete`, or `info` (the `nNodes/localRanks` summary line)."),
        col("api", pa.string(), "NCCL call named on the line (`ncclCommInitRankConfig`, `ncclCommInitRank`, `ncclCommSplit`), if any."),
        col("comm", pa.string(), "Communicator pointer (`0x13c78d60`); unique only within a process."),
        col("comm_id", pa.string(), "`commId` hash printed by newer NCCL (shared by the ranks of one communicator)."),
        col("rank", pa.int32(), "Rank of this process in the communicator."),
        col("nranks", pa.int32(), "Number of ranks of the communicator."),
        col("cuda_dev", pa.int32(), "`cudaDev` on the line."),
        col("nvml_dev", pa.int32(), "`nvmlDev` on the line."),
        col("bus_id", pa.string(), "PCI `busId` on the line (as printed, hex)."),
        col("n_nodes", pa.int32(), "`nNodes` (summary line)."),
        col("local_ranks", pa.int32(), "`localRanks` (summary line)."),
        col("local_rank", pa.int32(), "`localRank` (summary line)."),
        col("parent", pa.string(), "Parent communicator of `ncclCommSplit`."),
        col("nccl_version", pa.string(), "NCCL version of the process (`2.21.5+cuda12.4`), from the nearest earlier version line of the same file (same pid preferred)."),
    ),
)

NCCL_TOPOLOGY = Table(
    "nccl_topology",
    "NCCL topology and transport facts: ring order per channel, trees, per-peer transport "
    "(`Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM`), chosen bootstrap and network interfaces "
    "(`Bootstrap : Using eth0:10.0.0.1<0>`, `NET/Socket : Using [0]eth0:...`, `NET/IB : Using [0]mlx5_0:1/IB ...`), "
    "network in use, channel counts, other `NET/...` plugin lines.",
    (
        FILE_ID, LINE_NO, _TS, _NODE, _HOST, _PID, _RANK,
        col("kind", pa.string(), "`ring`, `tree`, `transport`, `bootstrap`, `net_if`, `network`, `connected`, `channels`, `net`."),
        col("channel", pa.int32(), "Channel number (`ring`, `transport`)."),
        col("n_channels", pa.int32(), "Channel count: `Channel 00/24` of a ring line, or collective channels of a `channels` line."),
        col("peers", pa.string(), "Ring order (`0 1 2 3`) or tree text (`[0] 1/-1/-1->0->-1 ...`)."),
        col("src_rank", pa.int32(), "`transport`: sending rank."),
        col("dst_rank", pa.int32(), "`transport`: receiving rank."),
        col("transport", pa.string(), "`transport`: `P2P/CUMEM`, `SHM/direct/direct`, `NET/IB/0/GDRDMA`, ... (with `[send]`/`[receive]` for p2p channels); `network`: `IB`/`Socket`; `net_if`: `Socket`/`IB`."),
        col("interface", pa.string(), "Interface(s) chosen (`eth0`, `docker0`, `mlx5_0:1/IB,mlx5_1:1/IB`)."),
        col("address", pa.string(), "Address of the chosen interface (IB: the out-of-band address)."),
        col("detail", pa.string(), "The message."),
    ),
)

NCCL_ENV = Table(
    "nccl_env",
    "Environment settings NCCL echoes: `NCCL_SOCKET_IFNAME set by environment to ib0`.",
    (
        FILE_ID, LINE_NO, _TS, _NODE, _HOST, _PID, _RANK,
        col("var", pa.string(), "Variable name."),
        col("value", pa.string(), "Value as printed (trailing `.` removed)."),
    ),
)

NCCL_ERRORS = Table(
    "nccl_errors",
    "NCCL WARN lines and return-code trails (`NCCL INFO misc/socket.cc:567 -> 2 [Async thread]`). "
    "Consecutive error lines of one process form one error: `first_line` is the line of its WARN "
    "(or of its first trail line when no WARN precedes it).",
    (
        FILE_ID, LINE_NO, _TS, _NODE, _HOST, _PID, _TID, _RANK,
        col("kind", pa.string(), "`warn` (a `NCCL WARN` line) or `rc` (a trail line `file:line -> rc`)."),
        col("src", pa.string(), "NCCL source location (`misc/socket.cc:484`)."),
        col("rc", pa.int32(), "Return code (`rc` rows; on `warn` rows the first code of the trail that follows)."),
        col("rc_name", pa.string(), "`ncclSystemError` (2), `ncclInternalError` (3), `ncclInvalidUsage` (5), `ncclRemoteError` (6), ..."),
        col("thread_tag", pa.string(), "`Async thread`, `Proxy Thread`, `Progress Thread`, ... when printed."),
        col("first_line", pa.int64(), "line_no of the first line of this error (its WARN)."),
        col("trail", pa.string(), "`warn` rows: the trail that follows, `src -> rc` joined by `; `."),
        col("message", pa.string(), "The message (WARN text, or the trail line)."),
    ),
)

NCCL_COLLS = Table(
    "nccl_colls",
    "Per-collective lines of NCCL_DEBUG_SUBSYS=COLL: `AllReduce: opCount 3 sendbuff 0x... recvbuff 0x... "
    "count 1024 datatype 7 op 0 root 0 comm 0x... [nranks=8] stream 0x...`. One row per call as "
    "enqueued by the process (not proof of completion).",
    (
        FILE_ID, LINE_NO, _TS, _NODE, _HOST, _PID, _TID,
        col("rank", pa.int32(), "Rank of the process in this communicator (init line of the same host, pid and comm in the chunk), else the line's rank."),
        col("op", pa.string(), "`AllReduce`, `AllGather`, `ReduceScatter`, `Broadcast`, `Reduce`, `Send`, `Recv`, ..."),
        col("op_count", pa.int64(), "`opCount` (printed in hex; some NCCL versions print 0 for every call)."),
        col("sendbuff", pa.string(), "Send buffer pointer."),
        col("recvbuff", pa.string(), "Receive buffer pointer."),
        col("count", pa.int64(), "Element count."),
        col("datatype", pa.int32(), "ncclDataType_t code."),
        col("dtype", pa.string(), "Its name (`int8`, `int32`, `int64`, `float16`, `float32`, `float64`, `bfloat16`, ...)."),
        col("redop", pa.string(), "Reduction (`sum`, `prod`, `max`, `min`, `avg`, or the code)."),
        col("root", pa.int32(), "Root rank (broadcast/reduce; peer for send/recv)."),
        col("comm", pa.string(), "Communicator pointer."),
        col("nranks", pa.int32(), "`[nranks=N]` when printed."),
        col("stream", pa.string(), "CUDA stream."),
    ),
)

RC_NAMES = {
    0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
    4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress",
}
DTYPES = {
    0: "int8", 1: "uint8", 2: "int32", 3: "uint32", 4: "int64", 5: "uint64", 6: "float16",
    7: "float32", 8: "float64", 9: "bfloat16", 10: "float8e4m3", 11: "float8e5m2",
}
REDOPS = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}

_COMM = (
    r"^(?:(?P<api>nccl\w+):? )?comm (?P<comm>0x[0-9a-fA-F]+|\(nil\)) rank (?P<rank>\d+) n[Rr]anks (?P<nranks>\d+)"
)
_COMM_EVENT = r"- (Init|Abort|Destroy) (START|COMPLETE)\s*$"
_COLL = (
    r"^(?P<op>[A-Za-z]+): opCount (?P<opc>[0-9a-fA-F]+) sendbuff (?P<sb>\S+) recvbuff (?P<rb>\S+) count (?P<cnt>\d+) "
    r"datatype (?P<dt>\d+) op (?P<redop>\d+) root (?P<root>-?\d+)(?: \S+ \S+)*? comm (?P<comm>\S+)"
    r"(?: \[nranks=(?P<nr>\d+)\])?(?: stream (?P<stream>\S+))?"
)
_RC = r"^(?P<src>[\w./-]+\.(?:cc|cu|cpp|c|h|hpp):\d+) -> (?P<rc>\d+)(?: \[(?P<tag>[^\]]+)\])?\s*$"
_ENV = r"^(?P<var>[A-Z][A-Z0-9_]+) set by environment to (?P<value>.*?)\.?\s*$"

# (kind, prefilter literal, pattern); the first pattern that matches a line decides its kind
_TOPOLOGY = [
    ("transport", "via", r"^Channel (?P<ch>\d+)(?:/\d+)? : (?P<src>\d+)\[[^\]]*\] -> (?P<dst>\d+)\[[^\]]*\](?: (?P<dir>\[(?:send|receive)\]))? via (?P<via>\S+)"),
    ("ring", "Channel", r"^Channel (?P<ch>\d+)/(?P<nch>\d+) : (?P<peers>[\d ]+?)\s*$"),
    ("tree", "Trees", r"^Trees (?P<peers>.*)$"),
    ("bootstrap", "Bootstrap", r"^Bootstrap ?: Using (?:\[\d+\])?(?P<if>[\w.\-]+):(?P<addr>[^<\s]+)"),
    ("net_if", "Using", r"^NET/(?P<net>\w+) ?: Using (?P<list>.*)$"),
    ("network", "network", r"^Using network (?P<net>\S+)"),
    ("connected", "Connected", r"^Connected all (?P<what>\w+)"),
    ("channels", "channels", r"^(?P<nch>\d+) coll channels"),
    ("net", "NET", r"^(?P<x>NET/|Failed to initialize NET|Initialized NET|Assigned NET)"),
]

# how every topology line starts (anchored: cheap on the mass of other NCCL lines)
_TOPOLOGY_START = r"^(?:Channel |Trees |Bootstrap|NET/|Using network|Connected all|\d+ coll channels|Failed to initialize NET|Initialized NET|Assigned NET)"


def annotate(df: pl.DataFrame, ctx: FileContext) -> tuple[pl.DataFrame, dict]:
    if not df.get_column("message").str.contains("NCCL", literal=True).any():
        return df, {}
    df = df.with_columns(pl.lit(None, pl.String).alias("_host"), pl.lit(None, pl.String).alias("_dev"))
    df = apply_header(df, HEADER, "nccl", prefilter=pl.col("message").str.contains(" NCCL ", literal=True), fields={
        "ts": parse_ts(g("ts")),
        "ts_quality": pl.when(g("ts").is_not_null()).then(pl.lit("full")),
        "level": normalise_level(g("level")),
        "logger": g("src"),
        "node": pl.coalesce(pl.col("node"), g("host")),
        "pid": g("pid").cast(pl.Int64),
        "tid": g("tid").cast(pl.Int64),
        "_host": g("host"),
        "_dev": g("dev"),
    })
    banner = pl.col("header").is_null() & pl.col("message").str.contains(BANNER)
    df = df.with_columns(
        pl.when(banner).then(pl.lit("nccl")).otherwise(pl.col("header")).alias("header"),
        pl.when(banner).then(pl.lit("INFO")).otherwise(pl.col("level")).alias("level"),
    )
    sub = df.filter(pl.col("header") == "nccl").select(
        "file_id", "line_no", "ts", "node", pl.col("_host").alias("host"), "pid", "tid",
        pl.col("_dev").cast(pl.Int32).alias("dev"), "rank", "level", "logger", "message",
    )
    df = df.drop("_host", "_dev")
    if sub.is_empty():
        return df, {}
    comms = _comms(sub)
    proc_rank = _process_ranks(comms)
    if proc_rank.height:
        # NCCL lines of a process whose communicator line is in this chunk: its rank
        sub = sub.join(proc_rank, on=["file_id", "host", "pid"], how="left", maintain_order="left").with_columns(
            pl.coalesce("rank", "_prank").alias("rank")
        ).drop("_prank")
        df = _fill_line_ranks(df, sub)
    tables = {
        "nccl_comms": comms,
        "nccl_topology": _topology(sub),
        "nccl_env": _env(sub),
        "nccl_errors": _errors(sub),
        "nccl_colls": _colls(sub, comms),
    }
    return df, {k: v for k, v in tables.items() if v is not None and v.height}


def _matching(sub: pl.DataFrame, literal: str, pattern: str) -> tuple[pl.DataFrame, pl.Series]:
    """Rows of ``sub`` whose message contains ``literal`` and matches ``pattern``, and the
    named groups of each match (every pattern has at least one group that a match sets)."""
    cand = sub.filter(pl.col("message").str.contains(literal, literal=True))
    m = cand.get_column("message").str.extract_groups(pattern)
    hit = cand.select(pl.any_horizontal(m.struct.field(n).is_not_null() for n in m.struct.fields)).to_series()
    return cand.filter(hit), m.filter(hit)


def _field(m: pl.Series, name: str, dtype=None) -> pl.Series:
    s = m.struct.field(name)
    return s.cast(dtype, strict=False) if dtype is not None else s


def _comms(sub: pl.DataFrame) -> pl.DataFrame:
    starts = pl.col("message").str.starts_with("comm ") | pl.col("message").str.starts_with("nccl")
    rows, m = _matching(sub.filter(starts), "comm ", _COMM)
    if rows.is_empty():
        return NCCL_COMMS.empty()
    msg = rows.get_column("message")
    ev = msg.str.extract_groups(_COMM_EVENT)
    event = (ev.struct.field("1").str.to_lowercase() + "_" + ev.struct.field("2").str.to_lowercase()).fill_null("info")

    def num(key: str) -> pl.Series:
        return msg.str.extract(rf"\b{key} (\d+)", 1).cast(pl.Int32)

    out = rows.select("file_id", "line_no", "ts", "node", "host", "pid", "tid", "dev").with_columns(
        event.alias("event"),
        _field(m, "api").alias("api"),
        _field(m, "comm").alias("comm"),
        msg.str.extract(r"\bcommId (0x[0-9a-fA-F]+)", 1).alias("comm_id"),
        _field(m, "rank", pl.Int32).alias("rank"),
        _field(m, "nranks", pl.Int32).alias("nranks"),
        num("cudaDev").alias("cuda_dev"),
        num("nvmlDev").alias("nvml_dev"),
        msg.str.extract(r"\bbusId ([0-9a-fA-Fx]+)", 1).alias("bus_id"),
        num("nNodes").alias("n_nodes"),
        num("localRanks").alias("local_ranks"),
        num("localRank").alias("local_rank"),
        msg.str.extract(r"\bparent (0x[0-9a-fA-F]+)", 1).alias("parent"),
    )
    return _with_versions(out, sub)


def _with_versions(comms: pl.DataFrame, sub: pl.DataFrame) -> pl.DataFrame:
    """The NCCL version of each communicator line's process: the nearest earlier version
    line of the same pid in the chunk, else the nearest earlier one of any pid (the
    un-prefixed banner carries no pid of its own)."""
    versions = sub.select(
        "file_id", "line_no", "pid", pl.col("message").str.extract(BANNER, 1).alias("nccl_version")
    ).filter(pl.col("nccl_version").is_not_null())
    if versions.is_empty():
        return comms.with_columns(pl.lit(None, pl.String).alias("nccl_version"))
    comms = comms.sort("file_id", "line_no")
    same_pid = comms.join_asof(
        versions.filter(pl.col("pid").is_not_null()).sort("file_id", "line_no"), on="line_no", by=["file_id", "pid"], strategy="backward",
        check_sortedness=False,
    )
    any_pid = comms.select("file_id", "line_no").join_asof(
        versions.select("file_id", "line_no", pl.col("nccl_version").alias("_v")).sort("file_id", "line_no"), on="line_no", by="file_id", strategy="backward",
        check_sortedness=False,
    )
    return same_pid.with_columns(pl.coalesce("nccl_version", any_pid.get_column("_v")).alias("nccl_version"))


def _process_ranks(comms: pl.DataFrame) -> pl.DataFrame:
    """(host, pid) -> rank in the largest communicator of that process (its global rank
    in the usual layout where the world communicator is the largest)."""
    known = comms.filter(pl.col("rank").is_not_null() & pl.col("host").is_not_null())
    if known.is_empty():
        return pl.DataFrame(schema={"file_id": pl.Int32, "host": pl.String, "pid": pl.Int64, "_prank": pl.Int32})
    return (
        known.sort(["nranks", "line_no"], descending=[True, False])
        .group_by(["file_id", "host", "pid"], maintain_order=True)
        .agg(pl.col("rank").first().alias("_prank"))
    )


def _fill_line_ranks(df: pl.DataFrame, sub: pl.DataFrame) -> pl.DataFrame:
    ranks = sub.select("file_id", "line_no", pl.col("rank").alias("_r")).filter(pl.col("_r").is_not_null())
    if ranks.is_empty():
        return df
    return df.join(ranks, on=["file_id", "line_no"], how="left", maintain_order="left").with_columns(
        pl.coalesce("rank", "_r").alias("rank")
    ).drop("_r")


def _topology(sub: pl.DataFrame) -> pl.DataFrame | None:
    frames = []
    # a line is claimed by the first pattern that matches it (frames hold many files:
    # a line is identified by file and line number)
    sub = sub.filter(pl.col("message").str.contains(_TOPOLOGY_START)).with_columns(
        (pl.col("file_id").cast(pl.Int64) * (1 << 40) + pl.col("line_no")).alias("_key")
    )
    if sub.is_empty():
        return None
    taken = pl.Series("_key", [], dtype=pl.Int64)
    base = ["file_id", "line_no", "ts", "node", "host", "pid", "rank"]
    for kind, literal, pattern in _TOPOLOGY:
        rows, m = _matching(sub.filter(~pl.col("_key").is_in(taken.implode())), literal, pattern)
        if rows.is_empty():
            continue
        taken = pl.concat([taken, rows.get_column("_key")])
        fields = set(m.struct.fields)
        out = rows.select(*base, pl.col("message").alias("detail")).with_columns(pl.lit(kind).alias("kind"))
        if "ch" in fields:
            out = out.with_columns(_field(m, "ch", pl.Int32).alias("channel"))
        if "nch" in fields:
            out = out.with_columns(_field(m, "nch", pl.Int32).alias("n_channels"))
        if "peers" in fields:
            out = out.with_columns(_field(m, "peers").str.strip_chars().alias("peers"))
        if kind == "transport":
            via = _field(m, "via")
            direction = _field(m, "dir")
            out = out.with_columns(
                _field(m, "src", pl.Int32).alias("src_rank"),
                _field(m, "dst", pl.Int32).alias("dst_rank"),
                pl.when(direction.is_not_null()).then(via + " " + direction).otherwise(via).alias("transport"),
            )
        elif kind == "bootstrap":
            out = out.with_columns(_field(m, "if").alias("interface"), _field(m, "addr").alias("address"))
        elif kind == "net_if":
            listing = _field(m, "list")
            out = out.with_columns(
                _field(m, "net").alias("transport"),
                listing.str.extract_all(r"\[\d+\]([\w.\-]+(?::\d+/\w+)?)").list.eval(
                    pl.element().str.replace(r"^\[\d+\]", "")
                ).list.join(",").replace("", None).alias("interface"),
                pl.coalesce(
                    listing.str.extract(r"OOB [\w.\-]+:([^<\s]+)", 1),
                    listing.str.extract(r"\[\d+\][\w.\-]+:([^<\s/]+)<", 1),
                ).alias("address"),
            )
        elif kind == "network":
            out = out.with_columns(_field(m, "net").alias("transport"))
        frames.append(out)
    if not frames:
        return None
    return pl.concat(frames, how="diagonal_relaxed").sort("file_id", "line_no")


def _env(sub: pl.DataFrame) -> pl.DataFrame | None:
    rows, m = _matching(sub, "set by environment", _ENV)
    if rows.is_empty():
        return None
    return rows.select("file_id", "line_no", "ts", "node", "host", "pid", "rank").with_columns(
        _field(m, "var").alias("var"), _field(m, "value").alias("value")
    )


def _errors(sub: pl.DataFrame) -> pl.DataFrame | None:
    msg = pl.col("message")
    is_rc = msg.str.contains(" -> ", literal=True) & msg.str.contains(_RC)
    cand = sub.with_columns(
        (pl.col("level") == "WARNING").alias("_warn"), is_rc.alias("_rc")
    )
    if not cand.select((pl.col("_warn") | pl.col("_rc")).any()).item():
        return None
    # a WARN starts an error; a trail line continues the error of the previous NCCL line of
    # the same process when that line was part of one, else it starts its own
    proc = [pl.col("file_id"), pl.col("pid").fill_null(-1), pl.col("host").fill_null("")]
    is_err = pl.col("_warn") | pl.col("_rc")
    cand = cand.with_columns(is_err.shift(1).over(proc).fill_null(False).alias("_prev"))
    start = pl.col("_warn") | (pl.col("_rc") & ~pl.col("_prev"))
    cand = cand.with_columns(
        pl.when(start).then(pl.col("line_no")).when(is_err).then(None).otherwise(-1).alias("_first")
    ).with_columns(
        pl.col("_first").forward_fill().over(proc).alias("_first")
    ).filter(is_err)
    m = cand.get_column("message").str.extract_groups(_RC)
    rows = cand.select(
        "file_id", "line_no", "ts", "node", "host", "pid", "tid", "rank", "message", "_warn", "logger",
        pl.col("_first").alias("first_line"),
    ).with_columns(
        pl.when(pl.col("_warn")).then(pl.lit("warn")).otherwise(pl.lit("rc")).alias("kind"),
        pl.when(pl.col("_warn")).then(pl.col("logger")).otherwise(m.struct.field("src")).alias("src"),
        m.struct.field("rc").cast(pl.Int32).alias("rc"),
        m.struct.field("tag").alias("thread_tag"),
    )
    trails = rows.filter(pl.col("kind") == "rc").group_by(["file_id", "first_line"]).agg(
        pl.col("rc").first().alias("_trc"),
        (pl.col("src") + " -> " + pl.col("rc").cast(pl.String)).str.join("; ").alias("trail"),
    )
    rows = rows.join(trails, on=["file_id", "first_line"], how="left", maintain_order="left").with_columns(
        pl.coalesce("rc", pl.when(pl.col("kind") == "warn").then(pl.col("_trc"))).alias("rc"),
        pl.when(pl.col("kind") == "warn").then(pl.col("trail")).alias("trail"),
    )
    return rows.with_columns(
        pl.col("rc").replace_strict(RC_NAMES, default=None, return_dtype=pl.String).alias("rc_name")
    ).drop("_warn", "_trc", "logger").sort("line_no")


# COLL lines print `<Op>: opCount %lx sendbuff %p recvbuff %p count %zu datatype %d op %d
# root %d comm %p [nranks=%d] stream %p`: the words sit at fixed places, so a split reads
# them far cheaper than a regex; lines laid out otherwise go through ``_COLL``.
_COLL_WORDS = {1: "opCount", 3: "sendbuff", 5: "recvbuff", 7: "count", 9: "datatype", 11: "op", 13: "root", 15: "comm"}
_COLL_FIELDS = {"op": 0, "opc": 2, "sb": 4, "rb": 6, "cnt": 8, "dt": 10, "redop": 12, "root": 14, "comm": 16}


def _coll_fields(rows: pl.DataFrame) -> pl.DataFrame:
    """The COLL fields of ``rows`` (named as the groups of ``_COLL``), in row order."""
    words = rows.select(pl.col("message").str.split(" ").alias("w"))
    word = lambda i: pl.col("w").list.get(i, null_on_oob=True)  # noqa: E731
    fixed = pl.all_horizontal([word(i) == name for i, name in _COLL_WORDS.items()] + [word(0).str.ends_with(":")])
    after = word(17)
    fields = words.select(
        fixed.fill_null(False).alias("_fixed"),
        *[word(i).alias(name) for name, i in _COLL_FIELDS.items()],
        pl.when(after.str.starts_with("[nranks=")).then(after.str.slice(8).str.strip_suffix("]")).alias("nr"),
        pl.when(after == "stream").then(word(18)).when(word(18) == "stream").then(word(19)).alias("stream"),
    ).with_columns(pl.col("op").str.strip_suffix(":"))
    if fields.get_column("_fixed").all():
        return fields.drop("_fixed")
    other = fields.get_column("_fixed").not_()
    m = rows.filter(other).get_column("message").str.extract_groups(_COLL).struct.unnest()
    idx = pl.arg_where(other, eager=True)
    fields = fields.drop("_fixed")
    return fields.with_columns(
        fields.get_column(c).scatter(idx, m.get_column(c).cast(pl.String)) for c in fields.columns
    )


def _colls(sub: pl.DataFrame, comms: pl.DataFrame) -> pl.DataFrame | None:
    cand = sub.filter(pl.col("message").str.contains(": opCount ", literal=True))
    if cand.is_empty():
        return None
    f = _coll_fields(cand)
    keep = f.get_column("op").is_not_null() & f.get_column("comm").is_not_null()
    rows, f = cand.filter(keep), f.filter(keep)
    if rows.is_empty():
        return None
    out = rows.select("file_id", "line_no", "ts", "node", "host", "pid", "tid", "rank").with_columns(
        f.get_column("op").alias("op"),
        f.get_column("opc").str.to_integer(base=16, strict=False).alias("op_count"),
        f.get_column("sb").alias("sendbuff"),
        f.get_column("rb").alias("recvbuff"),
        f.get_column("cnt").cast(pl.Int64, strict=False).alias("count"),
        f.get_column("dt").cast(pl.Int32, strict=False).alias("datatype"),
        f.get_column("redop").cast(pl.Int32, strict=False).alias("_redop"),
        f.get_column("root").cast(pl.Int32, strict=False).alias("root"),
        f.get_column("comm").alias("comm"),
        f.get_column("nr").cast(pl.Int32, strict=False).alias("nranks"),
        f.get_column("stream").alias("stream"),
    ).with_columns(
        pl.col("datatype").replace_strict(DTYPES, default=None, return_dtype=pl.String).alias("dtype"),
        pl.col("_redop").replace_strict(REDOPS, default=pl.col("_redop").cast(pl.String), return_dtype=pl.String).alias("redop"),
    ).drop("_redop")
    own = comms.filter(pl.col("rank").is_not_null()).group_by(["file_id", "host", "pid", "comm"]).agg(
        pl.col("rank").first().alias("_crank")
    )
    if own.height:
        out = out.join(own, on=["file_id", "host", "pid", "comm"], how="left", maintain_order="left").with_columns(
            pl.coalesce("_crank", "rank").alias("rank")
        ).drop("_crank")
    return out


# An NCCL debug line (the header of :data:`HEADER`, INFO or WARN) at the start of a line.
NCCL_LINE = re.compile(rb"\n(?:\[[\d\- :]+\] )?[\w.\-]+:\d+:\d+ \[\d+\] (?:[\w./-]+:\d+ )?NCCL (?:INFO|WARN)")

FORMATS = (
    LineFormat("nccl", 40, annotate, tables=(NCCL_COMMS, NCCL_TOPOLOGY, NCCL_ENV, NCCL_ERRORS, NCCL_COLLS)),
    Format("nccl_debug", "text", sniff=(
        Sniff(300, lambda h: h.count(NCCL_LINE) > h.lines * 0.5),  # mostly NCCL: an NCCL_DEBUG_FILE
        # often NCCL, and no other kind of log claimed it (a driver log with NCCL in it is a driver log)
        Sniff(250, lambda h: h.count(NCCL_LINE) > h.lines * 0.2),
    ), own_output=True),
)
