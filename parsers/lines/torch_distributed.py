"""PyTorch's C++ (c10 / glog-style) log lines, where ProcessGroupNCCL speaks.

Header styles by torch era:

* >= 2.4: ``[E1130 00:33:22.797275109 ProcessGroupNCCL.cpp:616] msg`` (level letter,
  month without leading zero + 2-digit day, nanoseconds; no year), usually behind a
  ``[rankN]:`` prefix that :mod:`.torchrun` strips;
* 2.2/2.3: ``[E ProcessGroupNCCL.cpp:563] msg`` behind ``[rankN]:``;
* <= 2.1: ``[E ProcessGroupNCCL.cpp:475] msg``;
* python logging of torch.distributed.elastic: ``W0314 10:02:11.123000 140234 torch/distributed/run.py:793] msg``.

What ProcessGroupNCCL says (after those headers and the ``[rankN]:`` prefix are gone)
becomes rows of ``pg_events``: watchdog timeouts (``WorkNCCL(SeqNum=.., OpType=..,
NumelIn=.., NumelOut=.., Timeout(ms)=..) ran for .. milliseconds``), the work counters
(``last enqueued NCCL work: E, last completed NCCL work: C`` in their several wordings),
dump signals, heartbeat-monitor messages, desync reports (``ranks [5] are the lagging
ranks ...``, ``[3] joined but didn't finish collective #12``), ``DistBackendError`` and
NCCL error strings. The process group is printed as ``[PG ID 0 PG GUID 0(default_pg) Rank 0]``
(>= 2.4), ``[PG 1 Rank 1]`` (2.2/2.3) or not at all (<= 2.1); a timeout line that names
no group takes it from the next line of the same rank about the same sequence number.
"""
from __future__ import annotations

import polars as pl
import pyarrow as pa

from ..base import FILE_ID, LINE_NO, FileContext, LineFormat, Table, col
from .common import YEARLESS, apply_header, coalesce_into, g, normalise_level

GLOG_BRACKET = r"^(?P<h>\[(?P<level>[IWEF])(?P<md>\d{3,4}) (?P<time>\d{2}:\d{2}:\d{2}\.\d+)(?: (?P<pid>\d+))? (?P<logger>[\w./<>-]+:\d+)\] ?)"
GLOG_BRACKET_NOTIME = r"^(?P<h>\[(?P<level>[IWEF]) (?P<logger>[\w./<>-]+:\d+)\] ?)"
GLOG = r"^(?P<h>(?P<level>[IWEF])(?P<md>\d{4}) (?P<time>\d{2}:\d{2}:\d{2}\.\d+) +(?P<pid>\d+) (?P<logger>[\w./<>-]+:\d+)\] ?)"


PG_EVENTS = Table(
    "pg_events",
    "What torch.distributed's ProcessGroupNCCL (watchdog, heartbeat monitor, desync debug) and the "
    "Python side (`DistBackendError`) said about collectives: one row per line that says it.",
    (
        FILE_ID,
        LINE_NO,
        col("ts", pa.timestamp("us"), "When the line was written (the line's `ts`)."),
        col("rank", pa.int32(), "Global rank: the line's `[rankN]:` prefix or file, else the `Rank N` inside the message."),
        col("group_rank", pa.int32(), "`Rank N` printed inside the message (rank within the process group)."),
        col("pid", pa.int64(), "Process id of the line, when known."),
        col("node", pa.string(), "Node of the line, when known."),
        col("pg_id", pa.int32(), "Process group id (`PG ID 0`, `PG 1`)."),
        col("pg_name", pa.string(), "Process group name/GUID (`PG GUID 0(...)`), the key of a Flight Recorder `pg_config`."),
        col("pg_desc", pa.string(), "Process group description (`default_pg`, `undefined`, custom names)."),
        col("kind", pa.string(), "`watchdog_timeout`, `work_status`, `watchdog_terminated`, `dump_signal`, `heartbeat`, `abort`, `desync_lagging`, `desync_started`, `desync_not_joined`, `dist_backend_error`, `nccl_error`."),
        col("seq", pa.int64(), "Sequence number of the work concerned (`SeqNum=`, `at work:`, `work sequence id:`, `collective #`)."),
        col("op_type", pa.string(), "`OpType=` (`ALLREDUCE`, `_ALLGATHER_BASE`, `BROADCAST`, ...)."),
        col("numel_in", pa.int64(), "`NumelIn=`."),
        col("numel_out", pa.int64(), "`NumelOut=`."),
        col("timeout_ms", pa.int64(), "`Timeout(ms)=`."),
        col("ran_for_ms", pa.int64(), "`ran for N milliseconds`."),
        col("last_enqueued", pa.int64(), "Last enqueued work sequence number of the group on this rank."),
        col("last_completed", pa.int64(), "Last completed work sequence number of the group on this rank."),
        col("ranks", pa.list_(pa.int32()), "Desync reports: the ranks named (`ranks [5] are the lagging ranks`, `[3] joined but didn't finish`)."),
        col("error", pa.string(), "NCCL error named on the line (`unhandled system error`, `remote process exited or there was a network error`, `ncclRemoteError`, ...)."),
        col("detail", pa.string(), "The message."),
    ),
)

# (kind, pattern) in priority order: the first that matches a line names its kind
_KINDS = [
    ("desync_lagging", r"are the lagging ranks"),
    ("desync_started", r"joined but didn't finish collective"),
    ("desync_not_joined", r"but didn't join collective"),
    ("dist_backend_error", r"DistBackendError"),
    ("watchdog_terminated", r"[Ww]atchdog thread terminated with exception"),
    ("watchdog_timeout", r"Watchdog caught collective operation timeout"),
    ("dump_signal", r"dump signal|dump debug info|signal dumping|[Ff]light ?[Rr]ecorder|failed collective not found"),
    ("work_status", r"[Ll]ast enqueued (?:NCCL )?work"),
    ("heartbeat", r"[Hh]eartbeat|watchdog got stuck"),
    ("abort", r"Some NCCL operations have failed or timed out|taking the entire process down"),
    ("nccl_error", r"NCCL error|\bnccl[A-Za-z]*Error\b|unhandled (?:system|cuda) error|remote process exited|internal error - please report|invalid usage"),
]
_PREFILTER = "|".join(f"(?:{pattern})" for _, pattern in _KINDS)
_PG = r"\[PG (?:ID )?(?P<id>\d+)(?: PG GUID (?P<guid>[^\s(\]]+))?(?: ?\((?P<desc>[^)]*)\))?(?: Rank (?P<rank>\d+))?\]"
_NCCL_ERROR = (
    r"NCCL error(?: in: \S+?)?[,:] (?P<e1>.+?)(?: \(run with|, NCCL version|$)"
    r"|(?P<e2>\bnccl[A-Za-z]*Error\b)"
    r"|(?P<e3>unhandled (?:system|cuda) error|remote process exited or there was a network error|internal error - please report this issue to the NCCL developers)"
)


def pg_events(df: pl.DataFrame) -> pl.DataFrame | None:
    """Rows of ``pg_events`` for the ProcessGroupNCCL / DistBackendError lines of a chunk."""
    msg = pl.col("message")
    cand = df.filter(pl.col("header").fill_null("") != "nccl").filter(msg.str.contains(_PREFILTER))
    if cand.is_empty():
        return None
    kind = pl.lit(None, pl.String)
    for name, pattern in reversed(_KINDS):
        kind = pl.when(msg.str.contains(pattern)).then(pl.lit(name)).otherwise(kind)
    cand = cand.with_columns(kind.alias("kind")).filter(pl.col("kind").is_not_null())
    if cand.is_empty():
        return None
    m = cand.get_column("message")
    pg = m.str.extract_groups(_PG)
    err = m.str.extract_groups(_NCCL_ERROR)

    def num(pattern: str, dtype=pl.Int64) -> pl.Series:
        return m.str.extract(pattern, 1).cast(dtype, strict=False)

    group_rank = pl.coalesce(pg.struct.field("rank"), m.str.extract(r"\[Rank (\d+)\]", 1)).cast(pl.Int32)
    seq = pl.coalesce(
        num(r"SeqNum=(\d+)"), num(r"didn't join collective #(\d+)"), num(r"collective #(\d+)"),
        num(r"at work(?: sequence id)?: (\d+)"), num(r"Timeout at NCCL work: (\d+)"),
    )
    ranks_text = pl.coalesce(
        m.str.extract(r"ranks \[([\d, ]*)\] are the lagging", 1),
        m.str.extract(r"\[([\d, ]+)\] (?:joined but|finished collective)", 1),
    )
    out = cand.select(
        "file_id", "line_no", "ts", "pid", "node", "kind", pl.col("message").alias("detail"), pl.col("rank").alias("_lrank"),
    ).with_columns(
        group_rank.alias("group_rank"),
        pg.struct.field("id").cast(pl.Int32).alias("pg_id"),
        pg.struct.field("guid").alias("pg_name"),
        pg.struct.field("desc").alias("pg_desc"),
        seq.alias("seq"),
        m.str.extract(r"OpType=(\w+)", 1).alias("op_type"),
        num(r"NumelIn=(-?\d+)").alias("numel_in"),
        num(r"NumelOut=(-?\d+)").alias("numel_out"),
        num(r"Timeout\(ms\)=(\d+)").alias("timeout_ms"),
        num(r"ran for (\d+) milliseconds").alias("ran_for_ms"),
        num(r"(?i)last enqueued (?:nccl )?work: (-?\d+)").alias("last_enqueued"),
        num(r"(?i)last completed (?:nccl )?work: (-?\d+)").alias("last_completed"),
        ranks_text.str.split(",").list.eval(pl.element().str.strip_chars().cast(pl.Int32, strict=False)).alias("ranks"),
        pl.coalesce(err.struct.field("e1"), err.struct.field("e2"), err.struct.field("e3")).alias("error"),
    ).with_columns(pl.coalesce("_lrank", "group_rank").alias("rank")).drop("_lrank")
    return _inherit_group(out)


def _inherit_group(ev: pl.DataFrame) -> pl.DataFrame:
    """A line that names no process group (the >= 2.2 `Watchdog caught ...` line) takes the
    group of the next line of the same file, rank and process about the same work, within
    20 lines."""
    key = [pl.col("rank").fill_null(-1).alias("_r"), pl.col("pid").fill_null(-1).alias("_p")]
    ev = ev.with_columns(*key)
    named = ev.filter(pl.col("pg_id").is_not_null() & pl.col("seq").is_not_null()).select(
        "file_id", "line_no", "_r", "_p", "seq",
        pl.col("pg_id").alias("_id"), pl.col("pg_name").alias("_name"), pl.col("pg_desc").alias("_desc"),
    )
    if named.is_empty() or ev.select(pl.col("pg_id").is_null().any()).item() is False:
        return ev.drop("_r", "_p")
    ev = ev.sort("file_id", "line_no").join_asof(
        named.sort("file_id", "line_no"), on="line_no", by=["file_id", "_r", "_p", "seq"], strategy="forward", tolerance=20,
        check_sortedness=False,
    )
    unnamed = pl.col("pg_id").is_null()
    return ev.with_columns(
        pl.when(unnamed).then(pl.col("_id")).otherwise(pl.col("pg_id")).alias("pg_id"),
        pl.when(unnamed).then(pl.col("_name")).otherwise(pl.col("pg_name")).alias("pg_name"),
        pl.when(unnamed).then(pl.col("_desc")).otherwise(pl.col("pg_desc")).alias("pg_desc"),
    ).drop("_r", "_p", "_id", "_name", "_desc")


def glog_ts(md: pl.Expr, time: pl.Expr) -> pl.Expr:
    """glog prints ``<month><dd>`` (month may lack its leading zero) and no year."""
    month = md.str.slice(0, md.str.len_chars() - 2).str.zfill(2)
    day = md.str.slice(-2, 2)
    frac = time.str.slice(0, 15)  # HH:MM:SS.micro (drop nanoseconds)
    return pl.concat_str([pl.lit(f"{YEARLESS}-"), month, pl.lit("-"), day, pl.lit(" "), frac]).str.to_datetime(
        "%Y-%m-%d %H:%M:%S%.f", strict=False, time_unit="us"
    )


def annotate(df: pl.DataFrame, ctx: FileContext) -> tuple[pl.DataFrame, dict]:
    msg = df.get_column("message")
    if msg.str.contains(r"^\[[IWEF]", literal=False).any():
        df = apply_header(df, GLOG_BRACKET, "glog", {
            "ts": glog_ts(g("md"), g("time")),
            "ts_quality": pl.lit("no_year"),
            "level": normalise_level(g("level")),
            "logger": g("logger"),
            "pid": coalesce_into("pid", g("pid").cast(pl.Int64)),
        })
        df = apply_header(df, GLOG_BRACKET_NOTIME, "glog", {
            "level": normalise_level(g("level")),
            "logger": g("logger"),
        })
    if df.get_column("message").str.contains(r"^[IWEF]\d{4} ").any():
        df = apply_header(df, GLOG, "glog", {
            "ts": glog_ts(g("md"), g("time")),
            "ts_quality": pl.lit("no_year"),
            "level": normalise_level(g("level")),
            "logger": g("logger"),
            "pid": coalesce_into("pid", g("pid").cast(pl.Int64)),
        })
    events = pg_events(df)
    return df, ({"pg_events": events} if events is not None and events.height else {})


FORMATS = (LineFormat("torch_distributed", 50, annotate, tables=(PG_EVENTS,)),)
