"""Prefixes that multi-node launchers put in front of every line they relay.

* Open MPI ``mpirun --tag-output``: ``[<job>,<rank>]<stdout>:`` / ``<stderr>:`` — the
  MPI world rank, kept in ``rank``;
* ``pdsh`` (DeepSpeed's multi-node runner) and ``srun --label``: ``<host>: `` or
  ``<task>: `` — the host (or Slurm task number) the line came from, kept in ``node``
  where the line names none. The name is a lower-case host name or address that holds a
  digit (``worker-1``, ``10.0.0.3``, ``gpu-node07``, ``3``), which keeps ``ValueError:``,
  ``INFO:`` and ``vllm.v1.engine.exceptions.EngineDeadError:`` out, and at least two lines
  must carry it;
* SkyPilot's job log: ``(head, rank=0, pid=N) `` and ``(worker1, rank=1, pid=N, ip=A) ``
  (older releases name the instance first: ``(node-2, head, rank=0, pid=N)``; one node:
  ``(task, pid=N)``). Its ``rank`` is the node's rank and its pid the job's shell on that
  node, which every training process there prints through: only the node is kept (the
  address, else the instance or role name).
* Metaflow's task log: ``<date> <time.ms> [<run>/<step>/<task> (pid N)] `` and, for a task
  run on AWS Batch / Kubernetes, the job's id in brackets (``[<uuid>] ``): the time is kept;
  the pid is the task's process, which every line of the step prints through (its children's
  too), so it is not kept. The program's own header behind it is then read.

As with container prefixes, a prefix is stripped only in a file where it begins most
lines, so that the headers, rank prefixes and tracebacks behind it are read.
"""
from __future__ import annotations

import polars as pl

from ..base import LineFormat
from .common import coalesce_into, g, parse_ts, strip_prefix_of_most_lines

_MPI_TAG = r"^(?P<h>\[(?P<job>\d+),(?P<rank>\d+)\]<(?:stdout|stderr|stddiag)>: ?)"
_HOST = r"^(?P<h> *(?P<host>[a-z0-9._-]*[0-9][a-z0-9._-]*): )"
_SKYPILOT = (r"^(?P<h>\((?:(?P<inst>[\w.-]+), )?(?P<role>head|worker\d+|task)(?:, rank=\d+)?, pid=\d+"
             r"(?:, ip=(?P<ip>[\w.:-]+))?\) )")

_METAFLOW = (r"^(?P<h>(?P<ts>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d{3}) \[[\w-]+/\w+/\d+ \(pid \d+\)\] "
             r"(?:\[[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\] )?)")


def annotate(df: pl.DataFrame, ctx) -> tuple[pl.DataFrame, dict]:
    df = strip_prefix_of_most_lines(df, _MPI_TAG, {"rank": coalesce_into("rank", g("rank").cast(pl.Int32))})
    df = strip_prefix_of_most_lines(df, _HOST, {"node": coalesce_into("node", g("host"))}, min_lines=2)
    if df.select(pl.col("message").str.starts_with("(").any()).item():
        df = strip_prefix_of_most_lines(df, _SKYPILOT, {"node": coalesce_into("node", pl.coalesce(g("ip"), g("inst"), g("role")))},
                                        min_lines=2)
    if df.select(pl.col("message").str.contains(r"^\d{4}-\d{2}-\d{2} [\d:.]+ \[").any()).item():
        df = strip_prefix_of_most_lines(df, _METAFLOW, {"ts": parse_ts(g("ts")), "ts_quality": pl.lit("full")}, min_lines=2)
    return df, {}


FORMATS = (
    LineFormat("launchers", 6, annotate),  # after container prefixes, before every header
)
