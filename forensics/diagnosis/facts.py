"""Facts about the run beyond the matched lines: which process is which rank on which
node, the run's configuration, which steps were logged when, which files and switches the
bundle has. Read once per diagnosis from the tables and views."""
from __future__ import annotations

import ast
import re
from collections import Counter, defaultdict
from typing import Any, Iterable

import duckdb

from ..catalogue import TRAIT_PREFIX, Catalogue, SignatureError, derive_keywords
from ..database import format_facts
from .model import Hit


def sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def keyword_sql(column: str, cs: Iterable[str], ci: Iterable[str] = (), lowered: str | None = None) -> str | None:
    """The substring test a regex's keywords make (catalogue.derive_keywords: case-sensitive
    ``cs``, case-insensitive ``ci``), ``(contains(...) OR ...)`` over ``column``; None without
    keywords. Cheap, it keeps the regexes off most rows. ``lowered``: a column holding
    ``lower(column)`` already, for many tests of the same rows."""
    low = lowered or f"lower({column})"
    kw = [f"contains({column}, {sql_str(k)})" for k in cs] + [f"contains({low}, {sql_str(k.lower())})" for k in ci]
    return "(" + " OR ".join(kw) + ")" if kw else None


def run_traits(formats: Counter, software: dict[str, str]) -> set[str]:
    """What the run is made of, as rules ask for it (``requires: [run:ray]``,
    ``class_if_present: {run:ray: ...}``): ``run:<software>`` for every software whose
    logs it holds, as the formats declare it (:attr:`forensics.parsers.base.Format.software`,
    ``software``: by format name, as :func:`forensics.database.format_facts` gives it)."""
    return {TRAIT_PREFIX + software[name] for name in formats if software.get(name)}


def table_exists(con, name: str) -> bool:
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
        self.driver_actors = set(cat.causality.driver_actors)  # the verl driver's actor: its prints are not a rank's
        self.pid_rank: dict[int, int] = {}
        self.pid_node: dict[int, str] = {}
        self.pid_actor: dict[int, str] = {}
        self.node_group: dict[str, str] = {}  # node name -> canonical name (host and IP of one machine)
        self.nranks: int | None = None
        self.config = RunConfig.load(con, cat.engine_args)
        self._load_nodes()
        self._load_ranks()
        self.formats = Counter(dict(con.execute("SELECT format, count(*) FROM files GROUP BY format").fetchall()))
        self.format_facts = format_facts(con)
        self.traits = run_traits(self.formats, self.format_facts.software)
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
                if method and actor not in self.driver_actors:
                    self.task_methods.setdefault(pid, method)
        # the Ray task headers with a pid, read once (the view scans every line): placement
        # reads them too (attach_task_pids)
        self.task_headers: list[tuple[int, int, int, str | None, str | None]] = [tuple(r) for r in self.con.execute(
            "SELECT file_id, line_no, pid, actor_class, method FROM ray_task_errors WHERE pid IS NOT NULL ORDER BY file_id, line_no"
        ).fetchall()]
        for _, _, pid, actor_class, method in self.task_headers:
            if method is None:
                continue
            if actor_class not in self.driver_actors and method != "run":
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
        # the ActorDiedError blocks, read once (the view scans every line)
        deaths = con.execute("SELECT file_id, line_no, pid, pg_index, local_index FROM actor_deaths "
                             "WHERE pid IS NOT NULL ORDER BY file_id, line_no").fetchall()
        # a verl worker of another node's placement group (`WorkerDict_<p>:<l>`, p > 0) holds
        # rank p * <workers per node> + l: only with the run's workers per node
        per_node = self.config.number("trainer.n_gpus_per_node")
        if per_node:
            named = Counter((pid, pg, local) for _, _, pid, pg, local in deaths
                            if pg is not None and pg > 0 and local is not None)
            for (pid, pg, local), n in sorted(named.items()):
                if local < per_node:
                    votes[pid][int(pg) * int(per_node) + int(local)] += weight["actor_name"] * min(int(n), 20)
        if table_exists(con, "nccl_rank_map"):
            try:
                for pid, rank in con.execute("SELECT pid, rank FROM nccl_rank_map WHERE pid IS NOT NULL AND rank IS NOT NULL ORDER BY pid, rank").fetchall():
                    votes[int(pid)][int(rank)] += 3
            except duckdb.Error as exc:
                if "does not exist" not in str(exc):
                    raise
        if self.cat.rank_zero_prints:
            cond = " OR ".join(f"regexp_matches(message, {sql_str(p)})" for p in self.cat.rank_zero_prints)
            for (pid,) in con.execute(f"SELECT DISTINCT pid FROM diag_candidates WHERE pid IS NOT NULL AND ({cond}) ORDER BY pid").fetchall():
                votes[pid][0] += 4
        for pid, c in votes.items():
            (best, n), *rest = c.most_common()
            if not rest or n > rest[0][1]:
                self.pid_rank[pid] = best
        # the dead actor's pid each `ActorDiedError` block names, by the block's first line
        self.death_pid: dict[tuple[int, int], int] = {(f, ln): int(p) for f, ln, p, _, _ in deaths}
        # torchrun's ChildFailedError box: the child its agent saw fail first, per box
        self.first_failed_children: list[tuple[int, int, int | None, int | None]] = []
        if table_exists(con, "child_failures"):
            self.first_failed_children = [tuple(r) for r in con.execute(
                "SELECT file_id, rank, local_rank, pid FROM child_failures WHERE is_root_cause AND rank IS NOT NULL "
                "ORDER BY file_id, line_no").fetchall()]
        row = con.execute(
            """SELECT max(TRY_CAST(regexp_extract(message, ' nranks (\\d+) ', 1) AS INTEGER))
               FROM lines WHERE header = 'nccl' AND contains(message, 'ncclCommInitRank')"""
        ).fetchall()[0][0]
        self.nranks = int(row) if row else None

    def is_rank_actor(self, pid: int | None) -> bool:
        actor = self.pid_actor.get(pid) if pid is not None else None
        return bool(actor) and actor not in self.driver_actors and any(re.search(p, actor) for p in self.cat.rank_actors)

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

    def first_failed_child(self, h: Hit) -> int | None:
        """The global rank torchrun's failure box gives the process of the hit: the box's
        ``Root Cause (first observed failure)`` entry with the hit's pid; else, for a line
        without a pid, the one entry printed in the hit's own file (the launcher's console,
        where the child's traceback was copied), unless the local GPU index the line names
        is another child's local rank."""
        entries = self.first_failed_children
        if not entries:
            return None
        by_pid = {r for _, r, _, p in entries if p is not None and p == h.proc}
        if by_pid:
            return by_pid.pop() if len(by_pid) == 1 else None
        if h.proc is not None:
            return None
        here = [(r, lr) for f, r, lr, _ in entries if f == h.file_id]
        if len({r for r, _ in here}) != 1:
            return None
        rank, local = here[0]
        gpu = h.groups.get("gpu", "")
        if local is not None and gpu.isdigit() and int(gpu) != local:
            return None
        return rank

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


_OVERRIDE_LIST = re.compile(r"overrides: (\[.*\])\s*$")


def _quoted_overrides(msg: str) -> list[str]:
    """The items of a Hydra override list printed as a Python list (``overrides: ['a=1', 'b=x']``);
    [] when the line has none or the list was cut off."""
    m = _OVERRIDE_LIST.search(msg)
    if not m:
        return []
    try:
        items = ast.literal_eval(m.group(1))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return []  # cut off in the paste: the space-separated form above still reads what it can
    return [x for x in items if isinstance(x, str)] if isinstance(items, list) else []


class RunConfig:
    """The run's configuration as its logs show it: Hydra overrides on the command line and
    the resolved config dict verl prints at start-up (a pprint of nested dicts)."""

    TOP_KEYS = ("actor_rollout_ref", "critic", "data", "trainer", "algorithm", "reward_model", "ray_init", "custom_reward_function")

    def __init__(self, values: dict[str, Any], engine: dict[tuple[str, str], Any] | None = None):
        self.values = values
        self.engine = engine or {}  # (engine, argument) -> value, as the engine printed its arguments

    @classmethod
    def load(cls, con, engine_args: dict[str, list[str]] | None = None) -> "RunConfig":
        values: dict[str, Any] = {}
        top = "|".join(cls.TOP_KEYS)
        override = re.compile(rf"(?:^|\s)\+{{0,2}}((?:{top})(?:\.[\w]+)+)=('[^']*'|\"[^\"]*\"|\S+)")
        for (msg,) in con.execute(
            # contains() first: a substring test is several times cheaper than the regex on every line
            f"SELECT message FROM lines WHERE contains(message, '=') AND regexp_matches(message, '(?:^|[\\s''\\[])\\+{{0,2}}(?:{top})\\.[\\w.]+=') "
            "ORDER BY file_id, line_no LIMIT 5000"
        ).fetchall():
            for key, raw in override.findall(msg):
                raw = raw.rstrip("\\").strip()
                if raw:
                    values.setdefault(key, _literal(raw))
            # Hydra's failure line lists the overrides as a Python list of quoted strings:
            # `Error executing job with overrides: ['trainer.nnodes=2', ...]`
            for item in _quoted_overrides(msg):
                key, _, raw = item.partition("=")
                key = key.lstrip("+")
                if raw and re.fullmatch(rf"(?:{top})(?:\.\w+)+", key):
                    values.setdefault(key, _literal(raw))
        dump = cls._config_dump(con)
        for k, v in dump.items():
            values[k] = v  # the resolved config wins over the overrides
        return cls(values, cls._engine_args(con, engine_args or {}))

    @staticmethod
    def _engine_args(con, patterns: dict[str, list[str]]) -> dict[tuple[str, str], Any]:
        """The arguments each engine printed it was started with (catalogue ``engine_args``)."""
        out: dict[tuple[str, str], Any] = {}
        for engine, pats in patterns.items():
            for pat in pats:
                rx = re.compile(pat)
                try:  # a literal every match contains, tested first (cheap) when the pattern has one
                    cs, ci = derive_keywords([pat], f"engine_args.{engine}")
                except SignatureError:
                    cs, ci = (), ()
                pre = keyword_sql("message", cs, ci)
                for (msg,) in con.execute(f"SELECT message FROM lines WHERE {pre + ' AND ' if pre else ''}regexp_matches(message, ?) "
                                          "ORDER BY file_id, line_no LIMIT 50", [pat]).fetchall():
                    m = rx.search(msg or "")
                    try:
                        args = ast.literal_eval(m.group("args")) if m else None
                    except (ValueError, SyntaxError, MemoryError, RecursionError):
                        continue  # cut off or not a literal: nothing to read from it
                    if isinstance(args, dict):
                        for k, v in args.items():
                            out.setdefault((engine, str(k)), v)
        return out

    def engine_arg(self, engine: str, arg: str, config_keys: tuple[str, ...] = ()) -> tuple[Any, str] | None:
        """The value the run gave the engine's argument and where it was read (the engine's
        printed arguments, or a verl key that passes it), or None when it was not set."""
        for key in config_keys:
            if self.values.get(key) is not None:
                return self.values[key], key
        v = self.engine.get((engine, arg))
        return (v, f"as {engine} printed its arguments") if v is not None else None

    @classmethod
    def _config_dump(cls, con) -> dict[str, Any]:
        starts = con.execute(
            f"""SELECT file_id, line_no, pid FROM lines
                WHERE contains(message, '{{''') AND regexp_matches(message, '^\\s*\\{{''(?:{'|'.join(cls.TOP_KEYS)})'': ')
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

