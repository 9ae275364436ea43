"""Diagnosis: from matched signatures and metric trends to root cause, cascade and remediation.

Steps (each a function below):

1. :func:`match` runs the signature catalogue inside DuckDB: one scan of ``lines`` with
   the union of every rule's keywords selects candidate lines into a TEMP table, then one
   ``UNION ALL`` query applies each rule's regular expressions (and negative patterns and
   restrictions) to the candidates only.
2. Every hit is placed: process (pid), rank (the line, ``[Rank N]`` text, the pid->rank
   evidence of the ``rank_pids`` view, the rank missing from a watchdog cascade, the GPU
   index on a node), node, phase (the frames of the traceback the line belongs to, the
   failing Ray task's method, whether training had started), and a time interval (lines
   without their own stamp inherited the previous one: the truth lies between that and
   the next stamp of the file).
3. Hits of one failure seen through several files (a worker's ``.err`` file and the
   driver's prefixed copy) become one event; the copy in the process's own file is cited.
4. The root cause is the earliest concrete cause (role ``cause``, or a metric-trend alarm);
   only when there is none does a ``fallback`` (watchdog timeout, actor death, generic
   exception) become the root. Everything else is the cascade: its symptoms.
5. Remediation quotes the run's own config values (Hydra overrides, the printed config dump),
   and notes say which logging switch would have shown more.

The result is a :class:`Diagnosis`; ``to_dict()`` gives the ``forensics diagnose --json``
shape of ``../shared/contract.md``.
"""
from __future__ import annotations

import ast
import functools
import math
import os
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Iterable

import duckdb
import polars as pl
import pyarrow as pa

from . import detectors
from . import catalogue as sig
from .catalogue import Catalogue, Remedy, Rule
from .store import SettingError, set_memory_limit

MAX_HITS_PER_RULE_FILE = 2000
ORIGIN_FORMATS = {"ray_worker", "kernel", "nccl_debug", "ray_raylet", "ray_gcs_server", "ray_monitor", "vllm"}
DRIVER_ACTORS = {"TaskRunner", "main_task"}  # the verl driver's actor: its prints are not a rank's
PRECISE = ("full", "year_inferred", "no_year")


# -- result types -------------------------------------------------------------------------

@dataclass
class Evidence:
    file: str
    line: int | None
    text: str
    ts: str | None = None
    ts_quality: str | None = None
    rule: str | None = None

    def to_dict(self) -> dict:
        d = {"file": self.file, "line": self.line, "text": self.text}
        if self.ts:
            d["ts"] = self.ts
        if self.ts_quality:
            d["ts_quality"] = self.ts_quality
        if self.rule:
            d["rule"] = self.rule
        return d


@dataclass
class RootCause:
    id: str
    confidence: float
    rank: int | None
    node: str | None
    phase: str | None
    step: int | None
    evidence: list[Evidence]
    symptoms: list[str]
    remediation: list[str]
    title: str = ""
    summary: str = ""
    cascade: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rank_source: str | None = None

    def to_dict(self) -> dict:
        return {
            "id": self.id, "confidence": round(self.confidence, 2), "rank": self.rank, "node": self.node,
            "phase": self.phase, "step": self.step, "evidence": [e.to_dict() for e in self.evidence],
            "symptoms": self.symptoms, "remediation": self.remediation,
            "title": self.title, "summary": self.summary, "cascade": self.cascade, "notes": self.notes,
            "rank_source": self.rank_source,
        }


@dataclass
class Finding:
    id: str
    rank: int | None
    detail: str
    evidence: list[Evidence] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. phase, steps, value, source

    def to_dict(self) -> dict:
        d = {"id": self.id, "rank": self.rank, "detail": self.detail, **self.extra}
        if self.evidence:
            d["evidence"] = [e.to_dict() for e in self.evidence]
        return d


@dataclass
class Diagnosis:
    verdict: str  # "failed" | "healthy"
    root_causes: list[RootCause]
    findings: list[Finding]
    notes: list[str] = field(default_factory=list)
    end_evidence: Evidence | None = None  # what says a healthy run ended well
    seconds: float = 0.0
    rules: int = 0

    def to_dict(self) -> dict:
        d = {
            "verdict": self.verdict,
            "root_causes": [r.to_dict() for r in self.root_causes],
            "findings": [f.to_dict() for f in self.findings],
            "notes": self.notes,
        }
        if self.end_evidence is not None:
            d["end"] = self.end_evidence.to_dict()
        return d

    def headline(self) -> str:
        if self.verdict == "healthy":
            why = f" ({self.end_evidence.file}:{self.end_evidence.line}: {_clip(self.end_evidence.text, 80)})" if self.end_evidence else ""
            return f"healthy{why}"
        r = self.root_causes[0]
        where = []
        if r.rank is not None:
            where.append(f"rank {r.rank}")
        if r.node:
            where.append(f"node {r.node}")
        if r.phase:
            where.append(f"phase {r.phase}")
        if r.step is not None:
            where.append(f"step {r.step}")
        ev = r.evidence[0] if r.evidence else None
        cite = f" — {ev.file}:{ev.line}: {_clip(ev.text, 100)}" if ev else ""
        return f"failed: {r.id} ({r.confidence:.2f})" + (f" on {', '.join(where)}" if where else "") + cite


# -- internal records --------------------------------------------------------------------

@dataclass
class Hit:
    rule: Rule
    file_id: int
    path: str
    fmt: str | None
    line_no: int | None
    ts: datetime | None
    ts_quality: str | None
    level: str | None
    header: str | None
    actor: str | None
    pid: int | None
    node: str | None
    rank: int | None
    event_line: int | None
    message: str
    file_pid: int | None = None
    text: str | None = None
    task_pid: int | None = None  # the worker named by the Ray task header this traceback is printed under
    groups: dict[str, str] = field(default_factory=dict)
    ts_hi: datetime | None = None
    body: str | None = None  # the traceback the line belongs to
    phase: str | None = None
    phase_source: str | None = None
    cls: str = ""
    rank_source: str | None = None
    step: int | None = None
    alarm: detectors.Alarm | None = None

    @property
    def proc(self) -> int | None:
        """The process the line is about (a killed pid named in the text wins)."""
        g = self.groups.get("pid")
        if g and g.isdigit():
            return int(g)
        if self.task_pid is not None:
            return self.task_pid
        return self.pid if self.pid is not None else self.file_pid

    @property
    def cuda_dev(self) -> int | None:
        """The local CUDA device of an NCCL line (``host:pid:tid [dev] NCCL ...``)."""
        if self.header != "nccl" or not self.text:
            return None
        m = re.search(r"[\w.\-]+:\d+:\d+ \[(\d+)\] ", self.text)
        return int(m.group(1)) if m else None

    @property
    def precise(self) -> bool:
        return self.ts is not None and self.ts_quality in PRECISE

    def evidence(self) -> Evidence:
        return Evidence(self.path, self.line_no, self.message.strip() if self.message else "",
                        ts=self.ts.isoformat(sep=" ") if self.ts else None, ts_quality=self.ts_quality, rule=self.rule.id)


@dataclass
class Event:
    """One failure as seen through one or more files (copies of the same lines)."""

    cls: str
    hits: list[Hit]
    role: str

    @property
    def weight(self) -> float:
        return max(h.rule.weight for h in self.hits)

    @property
    def lo(self) -> datetime | None:
        precise = [h.ts for h in self.hits if h.precise]
        if precise:
            return min(precise)
        inherited = [h.ts for h in self.hits if h.ts is not None]
        return max(inherited) if inherited else None

    @property
    def hi(self) -> datetime | None:
        precise = [h.ts for h in self.hits if h.precise]
        if precise:
            return min(precise)
        his = [h.ts_hi for h in self.hits if h.ts_hi is not None]
        return min(his) if his else None

    @property
    def origin(self) -> Hit:
        """The line to cite: in the process's own file before a driver copy, the earliest
        line, unless a clearly more specific line of the same moment follows it."""
        def own(h: Hit) -> int:
            return 0 if (h.fmt in ORIGIN_FORMATS or (h.file_pid is not None and h.file_pid == h.proc)) else 1
        best_own = min(own(h) for h in self.hits)
        pool = [h for h in self.hits if own(h) == best_own]
        first = min(pool, key=lambda h: (h.ts or datetime.max, h.path, h.line_no or 0))
        better = [h for h in pool if h.path == first.path and h.rule.weight >= first.rule.weight + 0.2
                  and (h.ts is None or first.ts is None or abs(h.ts - first.ts) <= timedelta(seconds=2))]
        return max(better, key=lambda h: h.rule.weight) if better else first

    @property
    def rank(self) -> int | None:
        for h in sorted(self.hits, key=lambda h: h.rank_source != "line"):
            if h.rank is not None:
                return h.rank
        return None

    @property
    def precise_any(self) -> bool:
        return any(h.precise for h in self.hits)


# -- 1. matching ---------------------------------------------------------------------------

def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _any_regex(column: str, patterns: Iterable[str]) -> str:
    return "(" + " OR ".join(f"regexp_matches({column}, {_sql_str(p)})" for p in patterns) + ")"


def _rule_sql(idx: int, r: Rule) -> str:
    # the rule's own keywords first: a cheap substring test keeps the regexes off most rows
    kw = [f"contains(message, {_sql_str(k)})" for k in r.keywords]
    kw += [f"contains(lower(message), {_sql_str(k.lower())})" for k in r.keywords_ci]
    conds = ["(" + " OR ".join(kw) + ")"] if kw else []
    conds.append(_any_regex("message", r.patterns))
    if r.negative:
        conds.append("NOT " + _any_regex("message", r.negative))
    if not r.match_code_lines:
        conds.append(f"NOT regexp_matches(message, {_sql_str(sig.CODE_LINE)})")
    w = r.where
    for col in ("header", "format", "level", "actor"):
        if w.get(col):
            conds.append(f"{col} IN ({', '.join(_sql_str(v) for v in w[col])})")
    if w.get("path"):
        conds.append(f"regexp_matches(path, {_sql_str(w['path'])})")
    if w.get("in_traceback") is True:
        conds.append("event_line IS NOT NULL")
    elif w.get("in_traceback") is False:
        conds.append("event_line IS NULL")
    return f"SELECT {idx} AS rule_idx, file_id, line_no FROM diag_candidates WHERE " + " AND ".join(conds)


def match(con: duckdb.DuckDBPyConnection, rules: list[Rule], extra: Iterable[str] = ()) -> pl.DataFrame:
    """Rule hits: one row per (rule, line), at most MAX_HITS_PER_RULE_FILE per rule and file.

    The one scan of ``lines`` keeps, in the TEMP table ``diag_candidates``, the lines that
    contain a rule keyword or match one of the ``extra`` patterns (read by later steps)."""
    # one alternation of plain literals keeps RE2 on its fast path; extra patterns (regexes
    # with anchors and classes) get their own keyword test first
    conds = [f"regexp_matches(l.message, {_sql_str(sig.prefilter_regex(rules))})"]
    for p in extra:
        cs, ci = sig.derive_keywords([p], "extra pattern")
        kw = [f"contains(l.message, {_sql_str(k)})" for k in cs] + [f"contains(lower(l.message), {_sql_str(k.lower())})" for k in ci]
        conds.append(f"(({' OR '.join(kw)}) AND regexp_matches(l.message, {_sql_str(p)}))")
    con.execute(
        f"""CREATE OR REPLACE TEMP TABLE diag_candidates AS
            SELECT l.file_id, l.line_no, l.ts, l.ts_quality, l.level, l.header, l.actor, l.pid, l.node,
                   l.rank, l.event_line, l.message, l.text, f.path, f.format, f.pid AS file_pid
            FROM lines l JOIN files f USING (file_id)
            WHERE {" OR ".join(conds)}"""
    )
    if not rules:
        return pl.DataFrame()
    union = "\nUNION ALL\n".join(_rule_sql(i, r) for i, r in enumerate(rules))
    q = f"""
        WITH m AS ({union}),
        k AS (SELECT * FROM m QUALIFY row_number() OVER (PARTITION BY rule_idx, file_id ORDER BY line_no) <= {MAX_HITS_PER_RULE_FILE})
        SELECT k.rule_idx, c.* FROM k JOIN diag_candidates c USING (file_id, line_no)
        ORDER BY c.file_id, c.line_no, k.rule_idx"""
    return pl.from_arrow(con.sql(q).to_arrow_table())


# -- 2. placing hits ----------------------------------------------------------------------

def _extract(h: Hit) -> None:
    for p in h.rule.extract:
        m = re.search(p, h.message)
        if not m:
            continue
        for k, v in m.groupdict().items():
            if v is not None and k not in h.groups:
                h.groups[k] = v.strip()


def _table_exists(con, name: str) -> bool:
    """A table or view of that name is visible on the connection (TEMP ones included)."""
    return bool(con.execute(
        "SELECT (SELECT count(*) FROM duckdb_tables() WHERE table_name = ?) + (SELECT count(*) FROM duckdb_views() WHERE view_name = ?)",
        [name, name]).fetchall()[0][0])


class RunFacts:
    """What the run says about itself beyond the hits: pid -> rank/node, node aliases,
    world size, config, which steps were logged, which files and switches exist."""

    def __init__(self, con: duckdb.DuckDBPyConnection, cat: Catalogue, performance: bool = True):
        self.con = con
        self.cat = cat
        self.performance = performance
        self.pid_rank: dict[int, int] = {}
        self.pid_node: dict[int, str] = {}
        self.pid_actor: dict[int, str] = {}
        self.node_group: dict[str, str] = {}  # node name -> canonical name (host and IP of one machine)
        self.nranks: int | None = None
        self.config = RunConfig.load(con)
        self._load_nodes()
        self._load_ranks()
        self.formats = Counter(dict(con.execute("SELECT format, count(*) FROM files GROUP BY format").fetchall()))
        self.has_nccl_lines = bool(con.execute("SELECT count(*) FROM lines WHERE header = 'nccl'").fetchall()[0][0])
        self.devices_vary = int(con.execute(
            r"""SELECT count(DISTINCT regexp_extract(text, '[\w.\-]+:\d+:\d+ \[(\d+)\] ', 1)) FROM lines
                WHERE header = 'nccl' AND contains(message, 'Init COMPLETE')""").fetchall()[0][0]) > 1
        self.dedup_lines = int(con.execute("SELECT count(*) FROM lines WHERE repeat IS NOT NULL").fetchall()[0][0])
        row = con.execute("SELECT count(*), max(step) FROM metrics WHERE step >= 1").fetchall()[0]
        self.metric_rows, self.max_step = int(row[0]), row[1]
        self.logs_metrics = bool(con.execute("SELECT count(*) FROM metrics WHERE step = 0").fetchall()[0][0])
        self.last_metric_line = dict(con.execute(
            "SELECT file_id, max(line_no) FROM metrics WHERE step >= 1 GROUP BY file_id").fetchall())
        # when each step was logged, from the stamps of the console lines that carry it
        self.step_times = sorted(con.execute(
            r"""SELECT TRY_CAST(regexp_extract(message, '^step:(\d+) - ', 1) AS BIGINT) AS step, min(ts)
                FROM lines WHERE starts_with(message, 'step:') AND ts IS NOT NULL
                GROUP BY step HAVING step >= 1 ORDER BY step""").fetchall(), key=lambda r: r[1])

    # -- nodes ----------------------------------------------------------------------
    def _load_nodes(self) -> None:
        parent: dict[str, str] = {}

        def find(x: str) -> str:
            while parent.setdefault(x, x) != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        rows = self.con.execute(
            """WITH g AS (SELECT pid, node, actor, count(*) AS n FROM lines
                          WHERE pid IS NOT NULL AND (node IS NOT NULL OR actor IS NOT NULL) GROUP BY ALL)
               SELECT pid, list(DISTINCT node ORDER BY node) FILTER (WHERE node IS NOT NULL),
                      first(node ORDER BY n DESC, node) FILTER (WHERE node IS NOT NULL),
                      first(actor ORDER BY n DESC, actor) FILTER (WHERE actor IS NOT NULL)
               FROM g GROUP BY pid ORDER BY pid""").fetchall()  # ordered throughout: ties broken by name
        for pid, nodes, top, actor in rows:
            nodes = [n for n in (nodes or []) if n]
            for n in nodes[1:]:
                parent[find(n)] = find(nodes[0])
            for n in nodes:
                find(n)
            if top:
                self.pid_node[pid] = top
            if actor:
                self.pid_actor[pid] = actor
        self.node_group = {n: find(n) for n in parent}
        # Ray's memory report lists worker processes as `<pid>\t<GB>\tray::<Class>.<method>`
        self.task_methods: dict[int, str] = {}
        for pid, actor, method in self.con.execute(
            r"""SELECT TRY_CAST(regexp_extract(message, '^(\d+)\s+[\d.]+\s+ray::(\w+)(?:\.(\w+))?', 1) AS BIGINT),
                       regexp_extract(message, '^(\d+)\s+[\d.]+\s+ray::(\w+)(?:\.(\w+))?', 2),
                       regexp_extract(message, '^(\d+)\s+[\d.]+\s+ray::(\w+)(?:\.(\w+))?', 3)
                FROM lines WHERE contains(message, 'ray::') AND regexp_matches(message, '^\d+\s+[\d.]+\s+ray::\w+')
                ORDER BY file_id, line_no"""
        ).fetchall():
            if pid is not None and actor:
                self.pid_actor.setdefault(pid, actor)
                if method and actor not in DRIVER_ACTORS:
                    self.task_methods.setdefault(pid, method)
        for pid, actor_class, method in self.con.execute(
            "SELECT pid, actor_class, method FROM ray_task_errors WHERE pid IS NOT NULL AND method IS NOT NULL ORDER BY file_id, line_no"
        ).fetchall():
            if actor_class not in DRIVER_ACTORS and method != "run":
                self.task_methods.setdefault(pid, method)
        # the order in which each node's raylet started worker processes (actors are created
        # in rank order)
        self.start_order: dict[str, list[int]] = defaultdict(list)
        for node, pid in self.con.execute(
            r"""SELECT coalesce(l.node, f.node), TRY_CAST(regexp_extract(l.message, 'Started worker process with pid (\d+)', 1) AS BIGINT)
                FROM lines l JOIN files f USING (file_id)
                WHERE contains(l.message, 'Started worker process with pid') ORDER BY l.file_id, l.line_no"""
        ).fetchall():
            key = self.node_group.get(node, node) if node else ""
            if pid is not None and pid not in self.start_order[key]:
                self.start_order[key].append(pid)

    def alias(self, a: str, b: str) -> None:
        """Two names of one machine (a kernel log's host name and the IP Ray prints for the
        same pid)."""
        ga, gb = self.node_group.get(a, a), self.node_group.get(b, b)
        if ga != gb:
            for k, v in list(self.node_group.items()):
                if v == gb:
                    self.node_group[k] = ga
            self.node_group[b] = ga
            self.node_group.setdefault(a, ga)

    def same_node(self, a: str | None, b: str | None) -> bool:
        return a is not None and b is not None and self.node_group.get(a, a) == self.node_group.get(b, b)

    def node_count(self) -> int:
        return len({self.node_group.get(n, n) for pid, n in self.pid_node.items() if self.is_rank_actor(pid)})

    # -- ranks ----------------------------------------------------------------------
    def _load_ranks(self) -> None:
        con = self.con
        votes: dict[int, Counter] = defaultdict(Counter)
        weight = {"line": 1, "message": 1, "nccl_init": 3, "actor_name": 5}
        for pid, rank, source, n, node in con.execute("SELECT pid, rank, source, n, node FROM rank_pids ORDER BY pid, rank, source").fetchall():
            if pid is None or rank is None:
                continue
            votes[pid][rank] += weight.get(source, 1) * min(int(n), 20)
        if _table_exists(con, "nccl_rank_map"):
            try:
                for pid, rank in con.execute("SELECT pid, rank FROM nccl_rank_map WHERE pid IS NOT NULL AND rank IS NOT NULL ORDER BY pid, rank").fetchall():
                    votes[int(pid)][int(rank)] += 3
            except duckdb.Error as exc:
                if "does not exist" not in str(exc):
                    raise
        if self.cat.rank_zero_prints:
            cond = " OR ".join(f"regexp_matches(message, {_sql_str(p)})" for p in self.cat.rank_zero_prints)
            for (pid,) in con.execute(f"SELECT DISTINCT pid FROM diag_candidates WHERE pid IS NOT NULL AND ({cond}) ORDER BY pid").fetchall():
                votes[pid][0] += 4
        for pid, c in votes.items():
            (best, n), *rest = c.most_common()
            if not rest or n > rest[0][1]:
                self.pid_rank[pid] = best
        row = con.execute(
            """SELECT max(TRY_CAST(regexp_extract(message, ' nranks (\\d+) ', 1) AS INTEGER))
               FROM lines WHERE header = 'nccl' AND contains(message, 'ncclCommInitRank')"""
        ).fetchall()[0][0]
        self.nranks = int(row) if row else None

    def is_rank_actor(self, pid: int | None) -> bool:
        actor = self.pid_actor.get(pid) if pid is not None else None
        return bool(actor) and actor not in DRIVER_ACTORS and any(re.search(p, actor) for p in self.cat.rank_actors)

    def world_size(self) -> int | None:
        per_node = self.config.number("trainer.n_gpus_per_node")
        nodes = self.config.number("trainer.nnodes")
        if per_node and nodes:
            return int(per_node * nodes)
        return self.nranks

    def gpus_per_node(self) -> int | None:
        v = self.config.number("trainer.n_gpus_per_node")
        if v:
            return int(v)
        nodes = self.config.number("trainer.nnodes")
        if self.nranks and nodes:
            return int(self.nranks // nodes)
        return None

    def single_node(self) -> bool:
        nodes = self.config.number("trainer.nnodes")
        if nodes is not None:
            return nodes == 1
        return self.node_count() <= 1

    def node_base(self, node: str | None, extra_ranks: Iterable[tuple[int, str | None]] = ()) -> int | None:
        """The first global rank of a node: ranks are numbered node by node."""
        gpn = self.gpus_per_node()
        if node is None:
            return 0 if self.single_node() else None
        extra_ranks = list(extra_ranks)
        pairs = [(r, self.pid_node.get(pid)) for pid, r in self.pid_rank.items()] + extra_ranks

        def base_of(n: str) -> int | None:
            known = [r for r, m in pairs if self.same_node(m, n)]
            return (min(known) // gpn) * gpn if known and gpn else None

        b = base_of(node)
        if b is not None:
            return b
        if self.single_node():
            return 0
        # the one node whose ranks are unknown takes the one block of ranks not yet placed
        nnodes = self.config.number("trainer.nnodes")
        if nnodes and gpn:
            groups = {self.node_group.get(n, n) for p, n in self.pid_node.items() if self.is_rank_actor(p)}
            bases = {g: base_of(g) for g in groups}
            unknown = [g for g, v in bases.items() if v is None]
            free = [x for x in range(0, int(nnodes) * gpn, gpn) if x not in bases.values()]
            if len(groups) == int(nnodes) and len(unknown) == 1 and len(free) == 1 and unknown[0] == self.node_group.get(node, node):
                return free[0]
        return None

    def rank_by_pid_order(self, pid: int, node: str | None) -> tuple[int | None, str | None]:
        """Rank actors are created in rank order: on one node the raylet starts their worker
        processes in that order (``Started worker process with pid``) and their pids usually
        rise with the rank. The pid's position in that order, if every process of a known
        rank agrees with it; else the lowest rank of the node that no known process holds."""
        if not self.is_rank_actor(pid):
            return None, None
        node = node or self.pid_node.get(pid)
        single = self.single_node()
        if not single and node is None:
            return None, None
        base = 0 if single else self.node_base(node)
        if base is None:
            return None, None
        on_node = (lambda p: True) if single else (lambda p: self.same_node(self.pid_node.get(p), node))
        started = self.start_order.get(self.node_group.get(node, node) if node else "", []) or \
            (next(iter(self.start_order.values())) if single and len(self.start_order) == 1 else [])
        orders = []
        if pid in started:
            orders.append(("start_order", [p for p in started if self.is_rank_actor(p)]))
        orders.append(("pid_order", sorted(p for p in self.pid_actor if self.is_rank_actor(p) and on_node(p))))
        for source, seq in orders:
            if pid in seq and all(self.pid_rank[p] == base + seq.index(p) for p in seq if p in self.pid_rank):
                return base + seq.index(pid), source
        gpn = self.gpus_per_node()
        held = {r for p, r in self.pid_rank.items() if single or on_node(p)}
        if gpn:
            free = [r for r in range(base, base + gpn) if r not in held]
            if free:
                return free[0], "lowest_free_rank"
        return None, None

    def nearest_rank(self, h: Hit) -> int | None:
        """The rank printed on the nearest line of the same process in the same file."""
        if h.proc is None or h.line_no is None:
            return None
        row = self.con.execute(
            """SELECT rank FROM lines WHERE file_id = ? AND pid = ? AND rank IS NOT NULL
               AND header IS DISTINCT FROM 'nccl' ORDER BY abs(line_no - ?) LIMIT 1""", [h.file_id, h.proc, h.line_no]).fetchall()
        return int(row[0][0]) if row else None

    def before_first_step(self, h: Hit, first_metric_line: dict[int, int]) -> bool:
        """Whether the hit comes before the first training step was logged (by position in a
        file that logs steps, else by time); False when that cannot be told."""
        if not self.metric_rows:
            return self.logs_metrics  # the run logs metrics (validation at step 0) but never trained
        if h.file_id in first_metric_line:
            return (h.line_no or 0) < first_metric_line[h.file_id]
        if not self.step_times or h.ts is None:
            return False
        return h.ts < self.step_times[0][1]

    def last_step_before(self, h: Hit) -> int | None:
        """The last training step logged before the hit: by position when the hit's file
        logs steps, else by time (the stamps of the lines that logged each step)."""
        row = self.con.execute("SELECT max(step), count(*) FROM metrics WHERE step >= 1 AND file_id = ? AND line_no < ?",
                               [h.file_id, h.line_no or 0]).fetchall()[0]
        if row[0] is not None:
            return int(row[0])
        if h.ts is None:
            return None
        before = [s for s, t in self.step_times if t <= h.ts]
        return int(max(before)) if before else None


class RunConfig:
    """The run's configuration as its logs show it: Hydra overrides on the command line and
    the resolved config dict verl prints at start-up (a pprint of nested dicts)."""

    TOP_KEYS = ("actor_rollout_ref", "critic", "data", "trainer", "algorithm", "reward_model", "ray_init", "custom_reward_function")

    def __init__(self, values: dict[str, Any]):
        self.values = values

    @classmethod
    def load(cls, con) -> "RunConfig":
        values: dict[str, Any] = {}
        top = "|".join(cls.TOP_KEYS)
        override = re.compile(rf"(?:^|\s)\+{{0,2}}((?:{top})(?:\.[\w]+)+)=('[^']*'|\"[^\"]*\"|\S+)")
        for (msg,) in con.execute(
            f"SELECT message FROM lines WHERE regexp_matches(message, '(?:^|\\s)\\+{{0,2}}(?:{top})\\.[\\w.]+=') ORDER BY file_id, line_no LIMIT 5000"
        ).fetchall():
            for key, raw in override.findall(msg):
                raw = raw.rstrip("\\").strip()
                if raw:
                    values.setdefault(key, _literal(raw))
        dump = cls._config_dump(con)
        for k, v in dump.items():
            values[k] = v  # the resolved config wins over the overrides
        return cls(values)

    @classmethod
    def _config_dump(cls, con) -> dict[str, Any]:
        starts = con.execute(
            f"""SELECT file_id, line_no, pid FROM lines
                WHERE regexp_matches(message, '^\\s*\\{{''(?:{'|'.join(cls.TOP_KEYS)})'': ')
                ORDER BY file_id, line_no LIMIT 4"""
        ).fetchall()
        for file_id, line_no, pid in starts:
            rows = con.execute(
                """SELECT message FROM lines WHERE file_id = ? AND line_no >= ? AND line_no < ? + 800
                   AND (pid IS NOT DISTINCT FROM ?) ORDER BY line_no""", [file_id, line_no, line_no, pid]).fetchall()
            text, depth = [], 0
            for (m,) in rows:
                text.append(m)
                depth += _bracket_balance(m)
                if depth <= 0:
                    break
            try:
                obj = ast.literal_eval("\n".join(text))
            except (ValueError, SyntaxError):
                continue
            if isinstance(obj, dict):
                return _flatten(obj)
        return {}

    def get(self, key: str) -> Any:
        return self.values.get(key)

    def has(self, key: str) -> bool:
        return key in self.values

    def number(self, key: str) -> float | None:
        v = self.values.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _bracket_balance(s: str) -> int:
    s = re.sub(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", "", s)
    return s.count("{") + s.count("[") + s.count("(") - s.count("}") - s.count("]") - s.count(")")


def _literal(raw: str) -> Any:
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        low = raw.lower()
        if low in ("true", "false"):
            return low == "true"
        if low in ("null", "none"):
            return None
        return raw


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


_FRAME_LINE = re.compile(r'^\s*File "|ray::\S+ \(pid=\d+|^\s+[\w.<>]+ \([^()]+\.py:\d+\)$')  # python, Ray task, py-spy frames


def _phase_of(text: str | None, markers: list[tuple[str, re.Pattern, bool]], frames_only: bool = False) -> str | None:
    """The phase a traceback (or a task name) implies: an ``override`` phase whose marker
    matches any line wins; otherwise the deepest (last) line that matches a marker decides.
    ``frames_only``: read only the frame and source lines of a traceback (not the text of
    the exception, which may list anything, e.g. every process on the node)."""
    if not text:
        return None
    lines = text.split("\n")
    if frames_only:  # frame lines and the source line printed under each
        lines = [ln for i, ln in enumerate(lines)
                 if _FRAME_LINE.search(ln) or (i > 0 and lines[i - 1].lstrip().startswith("File \""))]
    for phase, rx, override in markers:
        if override and any(rx.search(line) for line in lines):
            return phase
    for line in reversed(lines):
        for phase, rx, override in markers:
            if not override and rx.search(line):
                return phase
    return None


# -- the diagnosis ---------------------------------------------------------------------------

class NothingToDiagnose(ValueError):
    """The database holds no log lines and no metrics."""


DIAG_VIEWS = ("tracebacks", "ray_task_errors", "actor_deaths", "watchdog_timeouts", "watchdog_progress", "rank_pids")


def ensure_views(con: duckdb.DuckDBPyConnection) -> None:
    """Databases written by another forensics version lack the diagnosis views or hold old
    ones: the connection gets this version's as TEMP views (forensics/sql/diag_*.sql and
    what they depend on), whether it is read-only or not."""
    from . import sql_modules

    sql_modules.ensure(con, DIAG_VIEWS)


def diagnose(db: str | os.PathLike | None = None, signature_dirs: Iterable[str] = (), *,
             con: duckdb.DuckDBPyConnection | None = None, catalogue: Catalogue | None = None,
             performance: bool = True) -> Diagnosis:
    """Diagnose the run(s) in the database ``db`` (or the open connection ``con``).
    ``performance``: also compute the performance findings (stragglers, slow sync, ...)."""
    t0 = time.perf_counter()
    cat = catalogue or sig.load(signature_dirs)
    own = con is None
    if own:
        if db is None or not os.path.exists(db):
            raise FileNotFoundError(f"no database at {db}: run `forensics ingest PATH --db {db}` first")
        con = duckdb.connect(str(db), read_only=True)
        con.execute("SET enable_progress_bar = false")  # the CLI prints its own output
        try:
            set_memory_limit(con)
        except SettingError:
            con.close()
            raise
    try:
        d = _Diagnoser(con, cat, performance).run()
    finally:
        if own:
            con.close()
    d.seconds = time.perf_counter() - t0
    d.rules = len(cat.rules)
    return d


def headline(db_path: str | os.PathLike) -> str:
    """One line: the verdict, the root cause with its rank/phase and the evidence line."""
    try:
        return diagnose(db_path, performance=False).headline()
    except NothingToDiagnose as exc:
        return f"nothing to diagnose ({exc})"


class _Diagnoser:
    def __init__(self, con: duckdb.DuckDBPyConnection, cat: Catalogue, performance: bool = True):
        self.con = con
        self.cat = cat
        self.performance = performance
        self.markers = [(p, re.compile(rx), o) for p, rx, o in cat.phase_markers]
        self._phases: dict[tuple[str | None, bool], str | None] = {}

    def phase_of(self, text: str | None, frames_only: bool = False) -> str | None:
        """:func:`_phase_of` with this run's markers, memoised (the ranks of a cascade
        print the same tracebacks)."""
        key = (text, frames_only)
        if key not in self._phases:
            self._phases[key] = _phase_of(text, self.markers, frames_only)
        return self._phases[key]

    # -- hits ---------------------------------------------------------------------------
    def hits(self) -> list[Hit]:
        df = match(self.con, self.cat.rules, self.cat.rank_zero_prints)
        out: list[Hit] = []
        for row in df.iter_rows(named=True):
            r = self.cat.rules[row["rule_idx"]]
            h = Hit(rule=r, file_id=row["file_id"], path=row["path"], fmt=row["format"], line_no=row["line_no"],
                    ts=row["ts"], ts_quality=row["ts_quality"], level=row["level"], header=row["header"],
                    actor=row["actor"], pid=row["pid"], node=row["node"], rank=row["rank"],
                    event_line=row["event_line"], message=row["message"] or "", file_pid=row["file_pid"],
                    text=row["text"])
            _extract(h)
            out.append(h)
        return out

    def attach_bodies(self, hits: list[Hit]) -> None:
        # a line just after a traceback (an exception message continued on indented lines)
        # belongs to it
        loose = [(h.file_id, h.line_no) for h in hits if h.event_line is None and h.line_no]
        if loose:
            k = pa.table({"file_id": pa.array([a for a, _ in loose], pa.int32()), "line_no": pa.array([b for _, b in loose], pa.int64())})
            self.con.register("_diag_loose", k)
            try:
                prev = self.con.execute(
                    """SELECT n.file_id, n.line_no, max(l.event_line) FROM _diag_loose n JOIN lines l
                       ON l.file_id = n.file_id AND l.line_no BETWEEN n.line_no - 3 AND n.line_no - 1
                       WHERE l.event_line IS NOT NULL GROUP BY n.file_id, n.line_no""").fetchall()
            finally:
                self.con.unregister("_diag_loose")
            near = {(a, b): c for a, b, c in prev}
            for h in hits:
                if h.event_line is None and (h.file_id, h.line_no) in near:
                    h.event_line = near[(h.file_id, h.line_no)]
        keys = {(h.file_id, h.event_line) for h in hits if h.event_line is not None}
        if not keys:
            return
        k = pa.table({"file_id": pa.array([a for a, _ in keys], pa.int32()), "event_line": pa.array([b for _, b in keys], pa.int64())})
        self.con.register("_diag_events", k)
        try:
            rows = self.con.execute(
                """SELECT l.file_id, l.event_line, string_agg(l.message, chr(10) ORDER BY l.line_no)
                   FROM lines l SEMI JOIN _diag_events e ON l.file_id = e.file_id AND l.event_line = e.event_line
                   GROUP BY l.file_id, l.event_line""").fetchall()
        finally:
            self.con.unregister("_diag_events")
        bodies = {(a, b): c for a, b, c in rows}
        for h in hits:
            if h.event_line is not None:
                h.body = bodies.get((h.file_id, h.event_line))

    def attach_ts_hi(self, hits: list[Hit]) -> None:
        need = [(h.file_id, h.line_no) for h in hits if h.ts_quality not in PRECISE and h.line_no is not None]
        if not need:
            return
        k = pa.table({"file_id": pa.array([a for a, _ in need], pa.int32()), "line_no": pa.array([b for _, b in need], pa.int64())})
        self.con.register("_diag_need", k)
        try:
            rows = self.con.execute(
                """SELECT n.file_id, n.line_no, s.ts FROM _diag_need n ASOF LEFT JOIN
                   (SELECT file_id, line_no, ts FROM lines WHERE ts_quality IN ('full', 'year_inferred', 'no_year')) s
                   ON n.file_id = s.file_id AND s.line_no >= n.line_no""").fetchall()
        finally:
            self.con.unregister("_diag_need")
        nxt = {(a, b): c for a, b, c in rows}
        for h in hits:
            if h.ts_quality not in PRECISE:
                h.ts_hi = nxt.get((h.file_id, h.line_no))

    def attach_task_pids(self, hits: list[Hit]) -> None:
        """A traceback printed under a Ray task header (``RayTaskError(...): ray::X.m() (pid=N``,
        ``Unhandled error ...: ray::X.m() (pid=N``) is worker N's, even when the driver's
        TaskRunner prints it: the nearest such header above the line, within 60 lines."""
        heads: dict[int, list[tuple[int, int, str | None]]] = defaultdict(list)
        for file_id, line_no, pid, actor_class in self.con.execute(
            "SELECT file_id, line_no, pid, actor_class FROM ray_task_errors WHERE pid IS NOT NULL ORDER BY file_id, line_no"
        ).fetchall():
            heads[file_id].append((line_no, pid, actor_class))
        for h in hits:
            if h.line_no is None or h.file_id not in heads:
                continue
            if h.pid is not None and h.actor not in DRIVER_ACTORS:
                continue
            best = None
            for line_no, pid, actor_class in heads[h.file_id]:
                if line_no > h.line_no:
                    break
                if h.line_no - line_no <= 60:
                    best = (pid, actor_class)
            if best and best[1] not in DRIVER_ACTORS:
                h.task_pid = best[0]

    def place(self, hits: list[Hit], facts: RunFacts) -> None:
        task_methods = facts.task_methods
        bodies_by_proc: dict[int, list[Hit]] = defaultdict(list)
        for h in hits:
            if h.body and h.proc is not None:
                bodies_by_proc[h.proc].append(h)
        first_metric_line = {fid: ln for fid, ln in self.con.execute(
            "SELECT file_id, min(line_no) FROM metrics WHERE step >= 1 GROUP BY file_id").fetchall()}
        for h in hits:
            # rank: printed on the line, named in its text, or known for its process
            named = [int(x) for x in re.findall(r"\d+", h.groups.get("ranks", ""))]
            if len(named) == 1:  # a report naming one other rank (the desync report's lagging rank)
                h.rank, h.rank_source = named[0], "text"
            elif h.groups.get("rank", "").isdigit():
                h.rank, h.rank_source = int(h.groups["rank"]), "text"
            elif h.rank is not None:
                # an NCCL header prints the local device, not the rank: the parser filled the
                # rank from the process's communicator lines
                h.rank_source = "pid" if h.header == "nccl" else "line"
            else:
                m = re.search(r"\[[Rr]ank[ _]?(\d+)\]", h.message)
                if m:
                    h.rank, h.rank_source = int(m.group(1)), "text"
                elif h.proc is not None and h.proc in facts.pid_rank:
                    h.rank, h.rank_source = facts.pid_rank[h.proc], "pid"
            # node
            if h.node and h.proc is not None and h.proc in facts.pid_node and facts.pid_node[h.proc] != h.node:
                facts.alias(h.node, facts.pid_node[h.proc])
            if h.groups.get("node"):
                h.node = h.groups["node"]
            elif h.proc is not None and (h.node is None or h.task_pid is not None):
                h.node = facts.pid_node.get(h.proc, h.node)
            # phase: a rule's own phase; the frames of its traceback (or of the same failure's
            # traceback in another file); the failing Ray task's method; training not started
            ph, src = (h.rule.phase, "rule") if h.rule.phase else (None, None)
            if ph is None:
                ph = self.phase_of(h.body, frames_only=True)
                src = "frames" if ph else None
            if ph is None and h.proc is not None:
                # the traceback of the same process: the same failure copied to another file,
                # or the exception a failing line leads to a few lines later
                def near(o: Hit) -> tuple:
                    same = o.rule.id == h.rule.id
                    return (not same, o.file_id != h.file_id, abs((o.line_no or 0) - (h.line_no or 0)))
                for o in sorted(bodies_by_proc.get(h.proc, []), key=near):
                    if o.rule.id != h.rule.id and (o.file_id != h.file_id or abs((o.line_no or 0) - (h.line_no or 0)) > 40):
                        continue
                    ph = self.phase_of(o.body, frames_only=True)
                    if ph:
                        src = "frames"
                        break
            if ph is None and h.proc is not None and h.proc in task_methods:
                ph, src = self.phase_of(task_methods[h.proc]), "ray_task"
            if ph is None and h.event_line is None:  # what the line itself talks about ("tool calls")
                ph = self.phase_of(h.message)
                src = "message" if ph else None
            if ph is None and facts.before_first_step(h, first_metric_line):
                ph, src = "init", "before_first_step"
            h.phase, h.phase_source = ph, src

    ROLE_RANK = {"cause": 0, "fallback": 1, "symptom": 2, "stop": 3, "end": 4, "finding": 5, "context": 6}

    def resolve_classes(self, hits: list[Hit]) -> list[Hit]:
        """Apply event_context / requires / class_if_present / class_by_phase; drop hits
        whose conditions fail. A line matched by rules of several roles keeps the strongest
        role only (an OOM line is not also a generic uncaught exception)."""
        present: set[str] = set()
        kept: list[Hit] = []
        for h in hits:
            r = h.rule
            if r.event_context:
                text = h.body or h.message
                if not any(re.search(p, text) for p in r.event_context):
                    continue
            kept.append(h)
        present = {h.rule.id for h in kept}
        out = []
        for h in kept:
            r = h.rule
            if r.requires and not any(x in present for x in r.requires):
                continue
            cls = None
            for rid, c in r.class_if_present.items():
                if rid in present:
                    cls = c
                    break
            if cls is None and h.phase and h.phase in r.class_by_phase:
                cls = r.class_by_phase[h.phase]
            h.cls = cls or r.class_by_phase.get("default") or r.cls
            out.append(h)
        best: dict[tuple[int, int | None], int] = {}
        for h in out:
            if h.rule.role in ("cause", "fallback", "symptom"):
                k = (h.file_id, h.line_no)
                best[k] = min(best.get(k, 9), self.ROLE_RANK[h.rule.role])
        return [h for h in out if h.rule.role not in ("cause", "fallback", "symptom")
                or self.ROLE_RANK[h.rule.role] == best[(h.file_id, h.line_no)]]

    # -- events -------------------------------------------------------------------------
    @staticmethod
    def events(hits: list[Hit], role: str) -> list[Event]:
        groups: dict[tuple, list[Hit]] = defaultdict(list)
        for h in hits:
            if h.rule.role != role:
                continue
            if h.proc is not None:
                key = (h.cls, "pid", h.proc)
            elif h.event_line is not None:
                key = (h.cls, "tb", h.file_id, h.event_line)
            else:
                key = (h.cls, "line", h.file_id, h.line_no)
            groups[key].append(h)
        return [Event(cls=k[0], hits=v, role=role) for k, v in groups.items()]

    @classmethod
    def compare(cls, a: Event, b: Event) -> int:
        """Earlier first (see :meth:`order_key`); at the same time, file order decides within
        one file (the earlier line happened first), the more specific line across files."""
        ka, kb = cls.order_key(a)[:4], cls.order_key(b)[:4]
        if ka != kb:
            return -1 if ka < kb else 1
        oa, ob = a.origin, b.origin
        if oa.path == ob.path and oa.line_no != ob.line_no:
            return -1 if (oa.line_no or 0) < (ob.line_no or 0) else 1
        ra, rb = cls.order_key(a)[4:], cls.order_key(b)[4:]
        return (ra > rb) - (ra < rb)

    @staticmethod
    def order_key(e: Event):
        """Earliest first. A stamp inherited from an earlier line is a lower bound: at an equal
        time the line that carries its own stamp comes first. Metric alarms without a time
        are ordered by step."""
        lo = e.lo
        o = e.origin
        return (lo is None, lo or datetime.max, not e.precise_any, o.step if o.step is not None else math.inf,
                -e.weight, o.path, o.line_no or 0)

    # -- main -----------------------------------------------------------------------------
    def run(self) -> Diagnosis:
        con = self.con
        if not con.execute("SELECT EXISTS (SELECT 1 FROM lines) OR EXISTS (SELECT 1 FROM metrics)").fetchall()[0][0]:
            raise NothingToDiagnose("the database holds no log lines and no metrics: ingest the run's logs first")
        ensure_views(con)
        hits = self.hits()
        facts = RunFacts(con, self.cat)
        self.attach_task_pids(hits)
        self.attach_bodies(hits)
        self.attach_ts_hi(hits)
        self.place(hits, facts)
        hits = self.resolve_classes(hits)
        alarms = detectors.run(con, self.cat.metric_detectors)
        notes: list[str] = []

        ends = sorted((h for h in hits if h.rule.role == "end"), key=lambda h: (h.ts or datetime.min, h.path, h.line_no or 0))
        stops = sorted((h for h in hits if h.rule.role == "stop"), key=lambda h: (h.ts or datetime.max, h.path, h.line_no or 0))
        causes = self.events(hits, "cause")
        fallbacks = self.events(hits, "fallback")
        symptoms_ev = self.events(hits, "symptom")

        # metric alarms are causes too
        for a in alarms:
            causes.append(self._alarm_event(a))

        # a generic exception after which training went on (more steps logged) was handled
        fallbacks = [e for e in fallbacks if e.weight > 0.3 or not self._training_went_on(e, facts)]
        end_ts = max((h.ts for h in ends if h.ts is not None), default=None)
        stop_ts = stops[0].ts if stops else None
        if ends:
            # a run that reached its end: generic wrappers, fallbacks after the end and peers
            # dropping connections / actors exiting during shutdown are noise
            fallbacks = [e for e in fallbacks if not (end_ts and e.lo and e.lo >= end_ts) and e.weight > 0.3]
            causes = [e for e in causes if not (end_ts and e.lo and e.lo >= end_ts and e.cls in self.SHUTDOWN_NOISE)]
        if stops:
            fallbacks = [e for e in fallbacks if not (stop_ts is None or e.lo is None or e.lo >= stop_ts - timedelta(seconds=5))]
            causes = [e for e in causes if not (stop_ts and e.lo and e.lo > stop_ts)]

        findings = self.findings(hits) + (self.performance_findings(notes) if self.performance else [])
        if not causes and not fallbacks:
            end_ev = (ends[-1].evidence() if ends else (stops[0].evidence() if stops else None))
            if not ends and not stops:
                notes.append("no failure signature matched and no end-of-run marker was found: the logs may be incomplete")
            elif stops and not ends:
                notes.append("the run was stopped on purpose (SIGINT/SIGTERM) with no failure before it")
            return Diagnosis("healthy", [], findings, notes=notes, end_evidence=end_ev)

        # a concrete cause explains a collective timeout only if it could have come before it:
        # one that is stamped clearly after the first watchdog timeout is part of the teardown
        demoted: list[Event] = []
        first_timeout = min((h.ts for h in hits if h.rule.id == "nccl_watchdog_timeout" and h.precise), default=None)
        if first_timeout is not None:
            explaining = [e for e in causes if e.lo is None or e.lo <= first_timeout + self.SAME_MOMENT]
            if not explaining and causes:
                notes.append("concrete errors were logged only after the first collective timeout "
                             f"({first_timeout:%Y-%m-%d %H:%M:%S}); they are treated as its consequences")
                demoted.extend(causes)
                causes = []
        if causes:
            causes.sort(key=functools.cmp_to_key(self.compare))
            root = causes[0]
            root = self._prefer_simultaneous(root, causes)
        else:
            fallbacks.sort(key=lambda e: (-self._fallback_tier(e), *self.order_key(e)))
            root = fallbacks[0]
            root = self._prefer_simultaneous(root, [e for e in fallbacks if self._fallback_tier(e) == self._fallback_tier(root)])
            stalled = self._stalled_capture(hits) if root.cls in ("nccl_timeout", "weight_sync_timeout") else None
            if stalled is not None:
                # the others waited in a collective while this process never finished capturing
                # CUDA graphs: the hang is in capture
                stalled.cls = "cuda_graph"
                root = Event(cls="cuda_graph", hits=[stalled], role="cause")
                notes.append(f"{stalled.path}:{stalled.line_no}: CUDA graph capture began and never finished; "
                             "the collective timeouts of the other processes follow from it")
        incident = self._incident(root, causes, fallbacks + demoted, symptoms_ev, facts, hits)
        others = self._alternatives(root, causes or demoted, incident)
        return Diagnosis("failed", [incident, *others], findings, notes=notes)

    def _training_went_on(self, e: Event, facts: RunFacts) -> bool:
        """More training steps were logged after the event (in its file, or later in time)."""
        h = e.origin
        if facts.last_metric_line.get(h.file_id, 0) > (h.line_no or 0):
            return True
        return bool(e.hi and facts.step_times and facts.step_times[-1][1] > e.hi)

    def _stalled_capture(self, hits: list[Hit]) -> Hit | None:
        """A process that began CUDA graph capture and never reported it finished."""
        started: dict[int, Hit] = {}
        done: set[int] = set()
        for h in hits:
            if h.proc is None:
                continue
            if h.rule.id == "cuda_graph_capture_progress":
                started.setdefault(h.proc, h)
            elif h.rule.id == "cuda_graph_capture_done":
                done.add(h.proc)
        stalled = [h for p, h in started.items() if p not in done]
        return stalled[0] if len(stalled) == 1 else None

    @staticmethod
    def _fallback_tier(e: Event) -> float:
        return round(e.weight, 2)

    SAME_MOMENT = timedelta(seconds=2)
    SHUTDOWN_NOISE = frozenset({"nccl_network", "nccl_timeout", "ray_actor_died", "ray_cluster"})

    def _prefer_simultaneous(self, root: Event, pool: list[Event]) -> Event:
        """Among events of the root's class within a moment of it (one failure printed as
        several lines, e.g. the kernel's "invoked oom-killer" then "Killed process"), cite the
        most specific one (highest weight); a stamped line before an unstamped one."""
        if root.lo is None:
            return root
        same = [e for e in pool if e.cls == root.cls and e.lo is not None and abs(e.lo - root.lo) <= self.SAME_MOMENT
                and (e.precise_any or not root.precise_any) and e.weight >= root.weight + self.CLEARLY_MORE_SPECIFIC]
        if not same:
            return root
        return min(same, key=lambda e: (-e.weight, e.lo, e.origin.path, e.origin.line_no or 0))

    CLEARLY_MORE_SPECIFIC = 0.2  # a weaker preamble line gives way; near-equals keep the earliest line

    def _alarm_event(self, a: detectors.Alarm) -> Event:
        rule = Rule(id=f"metric_{a.detector}", cls=a.cls, role="cause", patterns=(".",), keywords=(), keywords_ci=(),
                    weight=0.9 if a.detector in ("nonfinite", "spike", "entropy_collapse") else 0.75,
                    title=a.detail, phase="train")
        row = self.con.execute("SELECT message FROM lines WHERE file_id = ? AND line_no = ?", [a.file_id, a.line_no]).fetchall()
        h = Hit(rule=rule, file_id=a.file_id, path=a.path, fmt="metrics", line_no=a.line_no, ts=a.ts,
                ts_quality="step_time" if a.ts else None, level=None, header=None, actor=None, pid=None, node=None,
                rank=None, event_line=None, message=row[0][0] if row else a.detail, cls=a.cls, phase="train",
                phase_source="metrics", step=a.step, alarm=a)
        return Event(cls=a.cls, hits=[h], role="cause")

    # -- building the incident ------------------------------------------------------------
    def _incident(self, root: Event, causes: list[Event], fallbacks: list[Event], symptom_events: list[Event],
                  facts: RunFacts, hits: list[Hit]) -> RootCause:
        origin = root.origin
        cls = root.cls
        derived_note = None
        derived_source = "missing_from_cascade"
        # a watchdog cascade in which exactly one rank of the world never timed out is a
        # rank that hung (or died silently) outside the collective
        if root.role == "fallback" and cls == "nccl_timeout":
            missing = self._missing_rank(hits, facts)
            if missing is not None:
                derived_note = (f"every rank but {missing} reported the collective timeout; rank {missing} never reached "
                                f"the collective (stuck outside it, or died without a trace)")
            else:
                missing = self._lagging_rank(root)
                if missing is None:
                    missing = self._behind_by_counters()
                if missing is not None:
                    derived_source = "lagging"
                    derived_note = (f"rank {missing} never enqueued the collective the other ranks timed out in "
                                    "(its watchdog counters / the desync analysis show it behind): it was stuck outside the collective")
            if missing is not None:
                cls = "rank_hang"
        if cls == "rank_hang" and derived_note:
            rank, rank_source = missing, derived_source  # type: ignore[possibly-undefined]
        else:
            rank, rank_source = self._root_rank(root, hits, facts, [*causes, *fallbacks])
        node = origin.node or next((h.node for h in root.hits if h.node), None)
        if node is None and rank is not None:
            node = next((facts.pid_node[p] for p, r in facts.pid_rank.items() if r == rank and p in facts.pid_node), None)
        phase = origin.phase or next((h.phase for h in root.hits if h.phase), None)
        if phase is None:  # other lines of the same failure (the killed worker, the driver's copy)
            phases = Counter(h.phase for e in [*causes, *fallbacks] if e.cls == cls for h in e.hits
                             if h.phase and h.phase_source in ("frames", "ray_task", "rule"))
            if phases:
                phase = phases.most_common(1)[0][0]
        if phase is None:  # the step phase the workers' failing Ray tasks were in
            run_phases = {self.phase_of(m) for m in facts.task_methods.values()} - {None}
            if len(run_phases) == 1:
                phase = run_phases.pop()
        step = origin.step
        if step is None:
            last = None
            for h in root.hits:
                s = facts.last_step_before(h)
                if s is not None:
                    last = s if last is None else max(last, s)
            if last is not None and phase != "init":
                step = last + 1

        evidence = self._evidence(root, causes + fallbacks, cls)
        if derived_note:  # the lagging rank's own lines, when it printed any, come first
            own = sorted((h for h in hits if h.rank == rank and h.rule.role in ("fallback", "cause")),
                         key=lambda h: (h.ts or datetime.max, h.path, h.line_no or 0))
            if own:
                evidence = [own[0].evidence(), *[e for e in evidence if (e.file, e.line) != (own[0].path, own[0].line_no)]][:6]
        # symptoms: the other classes seen after the root
        root_keys = {id(h) for h in root.hits}
        sym_classes: list[str] = []
        cascade_hits: list[Hit] = []
        for e in [*fallbacks, *symptom_events, *causes]:
            if any(id(h) in root_keys for h in e.hits):
                continue
            if e.cls == cls and e.role != "fallback":
                continue
            if e.lo and root.lo and e.hi and e.hi < root.lo:
                continue  # clearly before the root: not its effect
            cascade_hits.extend(e.hits)
            if e.role in ("fallback", "symptom") and any(h.rule.symptom for h in e.hits) and e.cls != cls and e.cls not in sym_classes:
                sym_classes.append(e.cls)
        info = self.cat.classes.get(cls)
        title = info.title if info else cls
        conf = self._confidence(root, cls, derived_note is not None)
        notes: list[str] = []
        if derived_note:
            notes.append(derived_note)
        if root.role == "fallback":
            notes.append("no concrete cause (OOM, crash, hardware, network, data error) was found before this; "
                         "it is reported as the root cause for lack of an earlier one")
        supported: set[str] = set()
        for h in hits:  # lines that support the reading (the interface NCCL chose, the ROCm platform, ...)
            if h.rule.role == "context" and h.cls == cls and h.rule.id not in supported and len(supported) < 3:
                supported.add(h.rule.id)
                notes.append(f"supporting: {h.rule.title or h.rule.id} ({h.path}:{h.line_no}: {_clip(h.message, 120)})")
        notes.extend(self._time_notes(root, origin))
        notes.extend(self._missing_evidence_notes(cls, facts, root))
        summary = self._summary(root, cls, rank, origin)
        cascade = self._cascade(cascade_hits, cls, rank)
        remediation = self._remediation(cls, root, phase, facts.config)
        return RootCause(id=cls, confidence=conf, rank=rank, node=node, phase=phase, step=step, evidence=evidence,
                         symptoms=sym_classes, remediation=remediation, title=title, summary=summary,
                         cascade=cascade, notes=notes, rank_source=rank_source)

    def _lagging_rank(self, root: Event) -> int | None:
        """The one rank the desync analysis (``desync`` view, when present) finds behind the
        others in the timed-out group: it never enqueued the collective or a desync report
        named it."""
        if not _table_exists(self.con, "desync"):
            return None
        try:
            rows = self.con.execute("SELECT DISTINCT rank FROM desync WHERE status = 'behind' AND rank IS NOT NULL").fetchall()
        except duckdb.Error as exc:
            if "does not exist" in str(exc) or "not found" in str(exc):
                return None
            raise
        behind = {r for (r,) in rows}
        timed_out = {h.rank for h in root.hits if h.rank is not None}
        if len(behind) == 1 and not behind & timed_out:
            return behind.pop()
        return None

    def _behind_by_counters(self) -> int | None:
        """The one rank whose watchdog counters show it never enqueued the collective the
        others timed out in (``last enqueued NCCL work`` below that work's sequence number)."""
        rows = self.con.execute(
            "SELECT coalesce(pg, '0'), rank, work, last_enqueued FROM watchdog_progress WHERE rank IS NOT NULL AND work IS NOT NULL").fetchall()
        by_pg: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
        for pg, rank, work, enq in rows:
            by_pg[pg].append((rank, work, enq))
        behind: set[int] = set()
        for pg, items in by_pg.items():
            seq = Counter(w for _, w, _ in items).most_common(1)[0][0]
            lag = {r for r, _, enq in items if enq is not None and enq < seq}
            ok = {r for r, _, enq in items if enq is not None and enq >= seq}
            if lag and ok and not lag & ok:
                behind |= lag
        return behind.pop() if len(behind) == 1 else None

    def _missing_rank(self, hits: list[Hit], facts: RunFacts) -> int | None:
        world = facts.world_size()
        timed_out = {h.rank for h in hits if h.rule.id == "nccl_watchdog_timeout" and h.rank is not None}
        if not world or not timed_out or len(timed_out) != world - 1 or max(timed_out) >= world:
            return None
        (missing,) = set(range(world)) - timed_out
        return missing

    def _root_rank(self, root: Event, hits: list[Hit], facts: RunFacts, pool: list[Event]) -> tuple[int | None, str | None]:
        """The global rank of the root cause, from the most direct evidence available."""
        origin = root.origin
        ordered = [origin, *(h for h in root.hits if h is not origin)]
        for h in ordered:  # printed on the line or named in its text
            if h.rank is not None and h.rank_source in ("line", "text"):
                return h.rank, h.rank_source
        for h in ordered:  # the nearest line of the same process that prints a rank
            r = facts.nearest_rank(h)
            if r is not None:
                return r, "same_process"
        for h in ordered:  # what the run says about the process elsewhere
            if h.rank is not None:
                return h.rank, h.rank_source
        # other lines of the same failure (the killed worker named by Ray, the driver's copy)
        same = {h.rank for e in pool if e.cls == root.cls and e is not root for h in e.hits if h.rank is not None}
        if len(same) == 1:
            return same.pop(), "same_failure"
        watchdog = [(h.rank, h.node) for h in hits if h.rule.id == "nccl_watchdog_timeout" and h.rank is not None]
        # the local device of an NCCL line, or the GPU index of an OOM message, on its node
        # (under Ray every worker sees its one GPU as device 0: only informative when the
        # run shows processes on other devices)
        for h in ordered:
            local = h.cuda_dev
            if local is None and h.groups.get("gpu", "").isdigit():
                local = int(h.groups["gpu"])
            gpn = facts.gpus_per_node()
            if local is not None and (gpn is None or local < gpn) and (local > 0 or facts.devices_vary):
                base = facts.node_base(h.node, watchdog)
                if base is not None:
                    return base + local, "local_device"
        missing = self._missing_rank(hits, facts)
        procs = {h.proc for h in root.hits if h.proc is not None}
        if missing is not None and not any(p in facts.pid_rank for p in procs):
            return missing, "missing_from_cascade"
        for h in ordered:
            if h.proc is not None:
                r, source = facts.rank_by_pid_order(h.proc, h.node)
                if r is not None:
                    return r, source
        return None, None

    def _confidence(self, root: Event, cls: str, derived: bool) -> float:
        c = root.weight
        if root.role == "fallback":
            c = min(c + 0.1, 0.7)
        if len({h.path for h in root.hits}) > 1:
            c += 0.03
        if not root.precise_any and root.lo is None and root.role == "cause":
            c -= 0.05
        if derived:
            c = 0.6
        return max(0.05, min(0.99, c))

    def _evidence(self, root: Event, pool: list[Event], cls: str) -> list[Evidence]:
        first = root.origin
        out = [first]
        seen_files = {first.path}
        rest = sorted((h for h in root.hits if h is not first), key=lambda h: (h.path, h.line_no or 0))
        # other lines of the same class (other ranks, the driver's final exception)
        for e in sorted((e for e in pool if e.cls == cls and e is not root), key=self.order_key):
            rest.extend(sorted(e.hits, key=lambda h: (h.path, h.line_no or 0)))
        for h in rest:
            if len(out) >= 6:
                break
            if h.path in seen_files and len(out) >= 3:
                continue
            if any(h.path == o.path and h.line_no == o.line_no for o in out):
                continue
            out.append(h)
            seen_files.add(h.path)
        ev = [h.evidence() for h in out]
        if first.alarm is not None:
            for p, ln in first.alarm.also[:3]:
                row = self.con.execute("SELECT l.message FROM lines l JOIN files f USING (file_id) WHERE f.path = ? AND l.line_no = ?",
                                       [p, ln]).fetchall()
                ev.append(Evidence(p, ln, row[0][0] if row else "", rule=first.rule.id))
        return ev

    def _time_notes(self, root: Event, origin: Hit) -> list[str]:
        if origin.alarm is not None:
            return []
        if root.precise_any:
            q = next(h.ts_quality for h in root.hits if h.precise)
            if q in ("year_inferred", "no_year"):
                return ["the root cause's time is printed without a year; the year was inferred from other stamps of the run"]
            return []
        if root.lo is not None:
            when = (f"between {root.lo:%Y-%m-%d %H:%M:%S} and {root.hi:%Y-%m-%d %H:%M:%S}" if root.hi
                    else f"at or after {root.lo:%Y-%m-%d %H:%M:%S}")
            return [f"the root-cause line carries no timestamp of its own: it happened {when} "
                    "(times taken from neighbouring lines; the order was decided with that uncertainty)"]
        return ["the root-cause line has no timestamp and none could be inferred; the order of events was taken from file positions"]

    def _missing_evidence_notes(self, cls: str, facts: RunFacts, root: Event) -> list[str]:
        notes = []
        if cls in ("nccl_timeout", "rank_hang", "nccl_network", "weight_sync_timeout") and not facts.has_nccl_lines:
            notes.append("no NCCL debug lines in the logs: NCCL_DEBUG=INFO (NCCL_DEBUG_SUBSYS=INIT,NET,COLL) would show interfaces, communicators and collectives")
        if cls in ("nccl_timeout", "rank_hang") and not facts.formats.get("flight_recorder"):
            notes.append("no flight-recorder dumps: TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 record each rank's last collectives on a timeout")
        if facts.dedup_lines:
            notes.append(f"Ray deduplicated {facts.dedup_lines} line(s) on the driver ([repeated Nx across cluster]); RAY_DEDUP_LOGS=0 keeps every worker's copy")
        if cls in ("host_oom_ray", "ray_actor_died", "gpu_hardware") and not facts.formats.get("kernel"):
            notes.append("no kernel log in the bundle: dmesg -T / journalctl -k of each node shows the OOM killer and Xid errors")
        if cls in ("ray_actor_died",) and root.role == "fallback" and not facts.formats.get("ray_worker"):
            notes.append("only the driver's view is here: the dead worker's own worker-*.err under /tmp/ray/session_*/logs usually has its error")
        if cls in ("oom_generation", "cuda_graph", "weight_sync_timeout") and facts.config.get("actor_rollout_ref.rollout.disable_log_stats") is True:
            notes.append("actor_rollout_ref.rollout.disable_log_stats is True here: set it False (and VLLM_LOGGING_LEVEL=INFO) to see the engine's KV-cache and memory statistics")
        info = self.cat.classes.get(cls)
        if info:
            for d in info.debug:
                names = set(re.findall(r"[A-Za-z_]+(?:[._=][A-Za-z_]+)+", d))
                if not any(name in n for n in notes for name in names):
                    notes.append(d)
        return notes

    def _summary(self, root: Event, cls: str, rank: int | None, origin: Hit) -> str:
        what = self._describe(origin) or origin.rule.title or cls
        who = f"rank {rank}" if rank is not None else (f"pid {origin.proc}" if origin.proc is not None else "the run")
        return f"{who}: {what}"

    @staticmethod
    def _describe(h: Hit) -> str | None:
        tpl = h.rule.describe
        if not tpl:
            return None
        vals = dict(h.groups)
        for k, v in list(vals.items()):
            if k.endswith("_ms") and v.isdigit():
                vals[k[:-3] + "_s"] = f"{int(v) / 1000:g}"
        try:
            return tpl.format_map(defaultdict(lambda: "?", vals))
        except (ValueError, IndexError):
            return tpl

    def _cascade(self, hits: list[Hit], cls: str, rank: int | None) -> list[str]:
        by_desc: dict[str, list[Hit]] = defaultdict(list)
        for h in hits:
            d = self._describe(h) or h.rule.title or h.rule.id
            by_desc[d].append(h)
        lines = []
        cause = f"{cls}" + (f" on rank {rank}" if rank is not None else "")
        ordered = sorted(by_desc.items(), key=lambda kv: min((h.ts or datetime.max) for h in kv[1]))
        for desc, hs in ordered[:12]:
            ranks = sorted({h.rank for h in hs if h.rank is not None})
            files = sorted({h.path for h in hs})
            who = (_ranks_text(ranks) if ranks else "driver" if all(h.fmt == "driver" for h in hs)
                   else files[0] if len(files) == 1 else f"{len(files)} files")
            same = all(h.cls == cls for h in hs)
            lines.append(f"{who}: {desc}" + (" (the same failure seen by other processes)" if same else f" — caused by {cause}"))
        return lines

    def _remediation(self, cls: str, root: Event, phase: str | None, config: RunConfig) -> list[str]:
        items: list[Remedy] = []
        for h in root.hits:
            for r in h.rule.remediation:
                if r not in items:
                    items.append(r)
        info = self.cat.classes.get(cls)
        if info:
            items.extend(r for r in info.remediation if r not in items)
        out: list[str] = []
        keys: set[str] = set()
        for r in items:
            if r.key and r.key in keys:
                continue  # the rule's own advice on this key comes first
            text = _remedy_text(r, config)
            if text and text not in out:
                out.append(text)
                if r.key:
                    keys.add(r.key)
        return out[:8]

    def _alternatives(self, root: Event, causes: list[Event], incident: RootCause) -> list[RootCause]:
        """Other concrete causes of a different class: listed after the root cause with a
        lower confidence (they may be consequences or a second, independent failure)."""
        out: list[RootCause] = []
        seen = {incident.id}
        for e in sorted(causes, key=self.order_key):
            if e is root or e.cls in seen:
                continue
            seen.add(e.cls)
            o = e.origin
            info = self.cat.classes.get(e.cls)
            out.append(RootCause(
                id=e.cls, confidence=max(0.05, min(0.5, e.weight * 0.5)), rank=e.rank, node=o.node, phase=o.phase,
                step=o.step, evidence=[o.evidence()], symptoms=[], remediation=[], title=info.title if info else e.cls,
                summary=self._describe(o) or o.rule.title or e.cls,
                notes=["also seen; later than (or as early as) the root cause above"],
            ))
            if len(out) >= 3:
                break
        return out

    def performance_findings(self, notes: list[str]) -> list[Finding]:
        """Stragglers, slow weight sync, rollout long tail, step-time jumps
        (:mod:`forensics.findings`, over the phase-attribution views)."""
        try:
            from . import findings as findings_mod
            from . import phases as phases_mod
        except ImportError as exc:
            notes.append(f"performance findings unavailable: {exc}")
            return []
        try:
            phases_mod.attach(self.con)
            rows = findings_mod.findings(self.con)
        except (duckdb.Error, ValueError, KeyError, OSError) as exc:
            notes.append(f"performance findings unavailable: {exc.__class__.__name__}: {exc}")
            return []
        out = []
        for r in rows:
            r = dict(r)
            ev = [Evidence(e.get("file"), e.get("line"), e.get("text", "")) for e in r.pop("evidence", None) or []]
            out.append(Finding(str(r.pop("id")), r.pop("rank", None), str(r.pop("detail", "")), ev, r))
        return out

    def findings(self, hits: list[Hit]) -> list[Finding]:
        by_id: dict[str, list[Hit]] = defaultdict(list)
        for h in hits:
            if h.rule.role == "finding":
                by_id[h.rule.finding or h.rule.id].append(h)
        out = []
        for fid, hs in by_id.items():
            hs.sort(key=lambda h: (h.ts or datetime.max, h.path, h.line_no or 0))
            ranks = {h.rank for h in hs if h.rank is not None}
            detail = (self._describe(hs[0]) or hs[0].rule.title or fid) + f" ({len(hs)} line(s))"
            out.append(Finding(fid, next(iter(ranks)) if len(ranks) == 1 else None, detail, [hs[0].evidence()]))
        return out


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    parts, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return "ranks " + ",".join(parts)


def _fmt_value(v: Any) -> str:
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _remedy_text(r: Remedy, config: RunConfig) -> str | None:
    why = f" ({r.why})" if r.why else ""
    if r.key is None:
        return r.text
    cur = config.get(r.key) if config.has(r.key) else None
    suggestion = None
    if r.to is not None:
        suggestion = r.to
    elif r.scale is not None and isinstance(cur, (int, float)) and not isinstance(cur, bool):
        new = cur * r.scale
        if r.min is not None:
            new = max(new, r.min)
        if r.max is not None:
            new = min(new, r.max)
        suggestion = max(1, int(round(new))) if isinstance(cur, int) else round(new, 4)
    if config.has(r.key):
        if suggestion is not None and _fmt_value(suggestion) == _fmt_value(cur):
            return None  # already what we would suggest
        if suggestion is not None:
            return f"{r.key} is {_fmt_value(cur)} here; try {_fmt_value(suggestion)}{why}"
        return f"{r.key} is {_fmt_value(cur)} here{why}"
    if suggestion is not None:
        return f"{r.key}: try {_fmt_value(suggestion)}{why}"
    if r.scale is not None:
        direction = "lower" if r.scale < 1 else "raise"
        return f"{r.key}: {direction} it{why}"
    return f"{r.key}{why}" if why else r.key


def _clip(s: str, n: int) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 1] + "…"


# -- text output ---------------------------------------------------------------------------

def render(d: Diagnosis, verbose: bool = False) -> str:
    """The readable report of ``forensics diagnose``."""
    lines: list[str] = []
    if d.verdict == "healthy":
        lines.append("verdict: healthy")
        if d.end_evidence:
            e = d.end_evidence
            lines.append(f"  ended: {e.file}:{e.line}: {_clip(e.text, 160)}")
    else:
        lines.append("verdict: failed")
        for i, r in enumerate(d.root_causes):
            label = "root cause" if i == 0 else "also"
            lines.append("")
            lines.append(f"{label}: {r.id} — {r.title} (confidence {r.confidence:.2f})")
            how = {"pid_order": "by pid order", "start_order": "by worker start order", "lowest_free_rank": "guessed",
                   "missing_from_cascade": "the rank missing from the timeouts", "lagging": "behind in the collectives",
                   "local_device": "from the local GPU index",
                   "same_process": "from the process's other lines", "pid": "from the process's pid"}.get(r.rank_source or "")
            where = [(f"rank {r.rank}" + (f" ({how})" if how else "")) if r.rank is not None else "rank unknown",
                     f"node {r.node}" if r.node else None, f"phase {r.phase}" if r.phase else None,
                     f"step {r.step}" if r.step is not None else None]
            lines.append("  " + ", ".join(w for w in where if w))
            if r.summary:
                lines.append(f"  {r.summary}")
            for j, e in enumerate(r.evidence if (i == 0 or verbose) else r.evidence[:1]):
                ts = f" [{e.ts}{'' if e.ts_quality in (None, 'full') else ', ' + e.ts_quality}]" if e.ts else ""
                lines.append(f"  {'evidence' if j == 0 else '        '}: {e.file}:{e.line}{ts}")
                lines.append(f"            {_clip(e.text, 200)}")
            if r.symptoms:
                lines.append(f"  symptoms: {', '.join(r.symptoms)}")
            if r.cascade:
                lines.append("  cascade:")
                for c in r.cascade:
                    lines.append(f"    - {c}")
            if r.remediation:
                lines.append("  remediation:")
                for m in r.remediation:
                    lines.append(f"    - {m}")
            if r.notes and i == 0:
                lines.append("  notes:")
                for n in r.notes:
                    lines.append(f"    - {n}")
    if d.findings:
        lines.append("")
        lines.append("findings:")
        for f in d.findings:
            lines.append(f"  - {f.id}{'' if f.rank is None else f' (rank {f.rank})'}: {f.detail}")
    for n in d.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)
