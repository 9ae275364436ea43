"""torchrun / torch.distributed.elastic output.

* ``--tee`` prefixes ``[default0]:`` (``[<role><local_rank>]:``) on the launcher's console;
* torch's rank-prefixed stderr ``[rank3]:`` (uncaught exceptions, c10d lines), and PyTorch
  Lightning's ``[rank: 3] `` before the messages it logs per rank;
* per-rank log files ``<log_dir>/<run_id>/attempt_<n>/<rank>/stdout.log|stderr.log``
  (the rank comes from the path, see :func:`rank_from_path`);
* the ``ChildFailedError`` summary box, whose ``Root Cause (first observed failure)``
  section names the rank, exit code and pid of the first child that failed.
"""
from __future__ import annotations

import re

import polars as pl
import pyarrow as pa

from ..base import FILE_ID, LINE_NO, FileContext, Format, LineFormat, Sniff, Table, col
from .common import apply_header, g

CHILD_FAILURES = Table(
    "child_failures",
    "Failures listed in torchrun's ChildFailedError box (one row per `[n]:` entry).",
    (
        FILE_ID,
        LINE_NO,
        col("is_root_cause", pa.bool_(), "True for the entry under `Root Cause (first observed failure)`."),
        col("rank", pa.int32(), "Global rank of the failed child."),
        col("local_rank", pa.int32(), "Its local rank."),
        col("host", pa.string(), "Host it ran on."),
        col("exitcode", pa.int32(), "Exit code (negative: killed by that signal)."),
        col("pid", pa.int64(), "Child pid."),
        col("error_file", pa.string(), "Error file, if any."),
        col("traceback", pa.string(), "The `traceback :` text (e.g. `Signal 6 (SIGABRT) received by PID 123`)."),
        col("time", pa.string(), "The `time :` field as printed."),
    ),
)

_TEE = r"^(?P<h>\[(?P<role>[A-Za-z_]+?)(?P<lr>\d+)\]:)"
# torch's `[rank3]:`; PyTorch Lightning's rank-prefixed messages `[rank: 3] ` (the global rank too)
_RANK = r"^(?P<h>\[rank(?:(?P<rank>\d+)\]: ?|: (?P<lrank>\d+)\] ))"
_CLIPPED_RANK = r"^(?P<h>rank(?P<rank>\d+)\]: ?)"
_PATH_RANK = re.compile(r"(?:^|/)attempt_\d+/(\d+)/(?:stdout|stderr|error)\.(?:log|json)$")


def rank_from_path(path: str) -> int | None:
    m = _PATH_RANK.search(path)
    return int(m.group(1)) if m else None


def annotate(df: pl.DataFrame, ctx: FileContext) -> tuple[pl.DataFrame, dict]:
    # prefixes are matched (and stripped) on the rows that can carry them only
    starts = pl.col("message").str.starts_with("[")
    df = apply_header(df, _TEE, None, {"local_rank": g("lr").cast(pl.Int32)}, only_unset=False,
                      prefilter=starts & ~pl.col("message").str.contains(r"^\[rank\d+\]:"))
    df = apply_header(df, _RANK, None, {"rank": pl.coalesce(g("rank"), g("lrank")).cast(pl.Int32)}, only_unset=False,
                      prefilter=pl.col("message").str.starts_with("[rank"))
    # a paste that starts inside a prefix: its first line lost the `[` (`rank2]: TypeError ...`)
    df = apply_header(df, _CLIPPED_RANK, None, {"rank": g("rank").cast(pl.Int32)}, only_unset=False,
                      prefilter=(pl.col("line_no") == 1) & pl.col("message").str.starts_with("rank"))
    extra = {}
    if df.get_column("message").str.contains("ChildFailedError", literal=True).any() or df.get_column("message").str.contains("Root Cause (first observed failure)", literal=True).any():
        extra["child_failures"] = child_failures(df)
    return df, extra


_FIELD = re.compile(r"^\s*(time|host|rank|exitcode|error_file|traceback)\s*:\s?(.*)$")


def child_failures(df: pl.DataFrame) -> pl.DataFrame:
    """Read the ChildFailedError box: ``Root Cause`` / ``Other Failures`` sections with
    ``[n]:`` entries followed by ``key : value`` lines."""
    rows = []
    section = None
    cur = None
    # the box is at most a few dozen lines; scan only lines near its markers
    sub = df.filter(
        pl.col("message").str.contains(r"Failures:|Root Cause|^\s*\[\d+\]:|^\s*(time|host|rank|exitcode|error_file|traceback)\s*:|^\s*=+\s*$|^\s*-+\s*$")
    ).select("file_id", "line_no", "message")
    for file_id, line_no, message in sub.iter_rows():
        if "Root Cause (first observed failure)" in message:
            section, cur = "root", None
            continue
        if re.match(r"^\s*Failures:", message):
            section, cur = "other", None
            continue
        if section is None:
            continue
        if re.match(r"^\s*\[\d+\]:", message):
            cur = {"file_id": file_id, "line_no": line_no, "is_root_cause": section == "root"}
            rows.append(cur)
            continue
        m = _FIELD.match(message)
        if m and cur is not None:
            key, val = m.group(1), m.group(2).strip()
            if key == "rank":
                mm = re.match(r"(\d+)(?: \(local_rank: (\d+)\))?", val)
                if mm:
                    cur["rank"] = int(mm.group(1))
                    if mm.group(2):
                        cur["local_rank"] = int(mm.group(2))
            elif key == "exitcode":
                mm = re.match(r"(-?\d+)(?: \(pid: (\d+)\))?", val)
                if mm:
                    cur["exitcode"] = int(mm.group(1))
                    if mm.group(2):
                        cur["pid"] = int(mm.group(2))
            else:
                cur[key] = val
        elif re.match(r"^\s*=+\s*$", message) and cur is not None and section == "root":
            section = None
    if not rows:
        return CHILD_FAILURES.empty()
    return pl.DataFrame(rows, schema_overrides=CHILD_FAILURES.polars_schema, infer_schema_length=None)


def process_hints(path: str) -> dict:
    """What a per-rank log path says: the rank (whatever the file's format)."""
    return {"rank": rank_from_path(path)}


# A tee prefix ([default0]:) or a torch.distributed glog line of the launcher.
TORCHRUN_LINE = re.compile(rb"\n(?:\[\w+\d+\]:|[IWE]\d{4} [\d:.]+ \d+ torch/distributed/)")

FORMATS = (
    LineFormat("torchrun", 20, annotate, tables=(CHILD_FAILURES,)),  # [rankN]: before the headers behind it
    # a file of torchrun's log_dir layout: whatever is in it, it is that rank's output
    Format("torchrun_rank", "text", sniff=Sniff(350, lambda h: h.of(rank_from_path) is not None), hints=process_hints),
    Format("torchrun", "text", sniff=Sniff(260, lambda h: h.count(TORCHRUN_LINE) >= 3)),
)
