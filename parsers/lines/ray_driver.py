"""Ray's driver console: per-worker line prefixes and log deduplication markers.

With ``log_to_driver`` (the default) Ray copies every worker line to the driver's
stdout behind a prefix: ``(WorkerDict pid=123)``, ``(WorkerDict pid=123, ip=10.0.0.2)``,
``(MyActor(index=2) pid=123)`` for an actor class with a ``__repr__``,
``(pid=123)`` for plain tasks, ``(raylet)`` / ``(raylet, ip=...)`` and
``(autoscaler +1m2s)``; on a TTY the prefix is wrapped in ANSI colour codes (removed
before this module runs). vLLM's multiprocess engine uses the same shape
(``(EngineCore_0 pid=123)``, ``(VllmWorkerProcess pid=123)``, ``(APIServer pid=1)``).
Deduplicated lines end with ``[repeated 7x across cluster]`` and, the first time,
Ray's explanation of RAY_DEDUP_LOGS.
"""
from __future__ import annotations

import re

import polars as pl

from ..base import Format, LineFormat, Sniff
from .common import apply_header, g

# vLLM V1's multiprocess workers print their executor rank in the prefix too
# (`(VllmWorker rank=1 pid=123)`): the worker's rank within one engine (its TP/PP place),
# not a global training rank, so it is not kept as the line's rank.
# An actor class with a __repr__ is named by it (Ray's documented way to tell actors apart in
# the prefix: `(MyActor(index=2) pid=482120)`); frameworks that set one may leave an empty
# field behind the pid (`(ActorWorker(actor_infer-0) pid=12266, )`).
# NeMo-RL's workers define their __repr__ as `Class[rank=N]` with N the process's global
# torch.distributed rank ("Customizes the actor's prefix in the Ray logs":
# `(MegatronPolicyWorker[rank=8] pid=N, ip=A)`): the actor is the class, N the line's rank.
# A paste from a terminal may keep the colour codes Ray wraps the prefix in without their
# ESC byte (`[36m(WorkerDict pid=123)[0m msg`): they are part of the prefix.
_LOST_ESC = r"(?:\[[\d;]{1,8}m)?"
_WORKER = (
    r"^(?P<h>" + _LOST_ESC + r"\((?:(?P<actor>[A-Za-z_][\w.<>\-]*(?:\([^()\s]*\))?)(?:\[rank=(?P<rank>\d+)\])? )?(?:rank=\d+ )?pid=(?P<pid>\d+)"
    r"(?:, ip=(?P<ip>[^)\s,]+)|, )?\)" + _LOST_ESC + r" ?)"
)
_SYSTEM = (r"^(?P<h>" + _LOST_ESC + r"\((?P<actor>raylet|autoscaler|gcs_server|monitor|dashboard\w*|log_monitor)"
           r"(?:, ip=(?P<ip>[^)\s,]+)|[ ,][^)]*)?\)" + _LOST_ESC + r" ?)")
_DEDUP = r" ?\[repeated (\d+)x across cluster\](?: \(Ray deduplicates logs by default\..*)?$"


def annotate(df: pl.DataFrame, ctx) -> tuple[pl.DataFrame, dict]:
    msg = pl.col("message")
    starts = msg.str.starts_with("(") | (msg.str.starts_with("[") & msg.str.contains("m(", literal=True))
    # _WORKER twice: a process a Ray worker started prints behind its own prefix, and Ray
    # copies that line behind the worker's (`(LLMRayActor pid=1) (EngineCore_DP0 pid=2) ERROR
    # ...`, vLLM V1's engine core inside a Ray actor); the inner process printed the line
    for pattern in (_WORKER, _WORKER, _SYSTEM):
        fields = {"actor": g("actor"), "node": pl.coalesce(g("ip"), pl.col("node"))}
        if pattern is _WORKER:
            fields["pid"] = g("pid").cast(pl.Int64)
            fields["rank"] = pl.coalesce(g("rank").cast(pl.Int64), pl.col("rank"))
        df = apply_header(df, pattern, None, fields, only_unset=False, prefilter=starts)
    if df.select(pl.col("message").str.contains("x across cluster]", literal=True).any()).item():
        rep = df.get_column("message").str.extract(_DEDUP, 1)
        df = df.with_columns(
            pl.coalesce(rep.cast(pl.Int32), pl.col("repeat")).alias("repeat"),
            pl.col("message").str.replace(_DEDUP, ""),
        )
    return df, {}


# A driver console line: a worker's line copied behind its Ray prefix, colour codes and all.
DRIVER_LINE = re.compile(rb"\n(?:\x1b?\[[\d;]*m)*\((?:[\w.<>\-]+(?:\([^()\s]*\))?(?:\[rank=\d+\])? )?(?:rank=\d+ )?pid=\d+(?:, ip=[^)]+|, )?\)")

FORMATS = (
    LineFormat("ray_driver", 10, annotate),  # first: the prefix hides every header behind it
    # a few prefixed lines make a driver log (the rest is the driver's own output)
    Format("driver", "text", sniff=Sniff(280, lambda h: h.count(DRIVER_LINE) >= 3), software="ray"),
)
