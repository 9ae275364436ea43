"""Ray's driver console: per-worker line prefixes and log deduplication markers.

With ``log_to_driver`` (the default) Ray copies every worker line to the driver's
stdout behind a prefix: ``(WorkerDict pid=123)``, ``(WorkerDict pid=123, ip=10.0.0.2)``,
``(pid=123)`` for plain tasks, ``(raylet)`` / ``(raylet, ip=...)`` and
``(autoscaler +1m2s)``; on a TTY the prefix is wrapped in ANSI colour codes (removed
before this module runs). vLLM's multiprocess engine uses the same shape
(``(EngineCore_0 pid=123)``, ``(VllmWorkerProcess pid=123)``, ``(APIServer pid=1)``).
Deduplicated lines end with ``[repeated 7x across cluster]`` and, the first time,
Ray's explanation of RAY_DEDUP_LOGS.
"""
from __future__ import annotations

import polars as pl

from .base import FileContext
from .text import g

_WORKER = (
    r"^(?P<h>\((?:(?P<actor>[A-Za-z_][\w.<>\-]*) )?pid=(?P<pid>\d+)(?:, ip=(?P<ip>[^)\s,]+))?\) ?)"
)
_SYSTEM = r"^(?P<h>\((?P<actor>raylet|autoscaler|gcs_server|monitor|dashboard\w*|log_monitor)(?:, ip=(?P<ip>[^)\s,]+)|[ ,][^)]*)?\) ?)"
_DEDUP = r" ?\[repeated (\d+)x across cluster\](?: \(Ray deduplicates logs by default\..*)?$"


def annotate(df: pl.DataFrame, ctx: FileContext) -> tuple[pl.DataFrame, dict]:
    for pattern in (_WORKER, _SYSTEM):
        m = df.get_column("message").str.extract_groups(pattern)
        hit = m.struct.field("h").is_not_null()
        if not hit.any():
            continue
        df = df.with_columns(m.alias("_m"), hit.alias("_hit"))
        has_pid = "pid" in m.struct.fields
        df = df.with_columns(
            pl.when(pl.col("_hit")).then(g("actor")).otherwise(pl.col("actor")).alias("actor"),
            (pl.when(pl.col("_hit")).then(g("pid").cast(pl.Int64)).otherwise(pl.col("pid")) if has_pid else pl.col("pid")).alias("pid"),
            pl.when(pl.col("_hit")).then(pl.coalesce(g("ip"), pl.col("node"))).otherwise(pl.col("node")).alias("node"),
            pl.when(pl.col("_hit"))
            .then(pl.col("message").str.slice(g("h").str.len_chars()))
            .otherwise(pl.col("message"))
            .alias("message"),
        ).drop("_m", "_hit")
    rep = df.get_column("message").str.extract(_DEDUP, 1)
    if rep.is_not_null().any():
        df = df.with_columns(
            rep.cast(pl.Int32).alias("repeat"),
            pl.col("message").str.replace(_DEDUP, ""),
        )
    return df, {}
