"""Stage 2: placing each hit — the process it is about, its rank, node and phase, the
traceback it belongs to, and the interval its time lies in (lines without a stamp of their
own inherited the previous one: the truth lies between that and the next stamp)."""
from __future__ import annotations

import bisect
import re
from collections import defaultdict

from .context import Context
from .facts import RunFacts
from .model import PRECISE, Hit


def keyed_rows(ctx: Context, name: str, keys, column: str, sql: str) -> list[tuple]:
    """Run ``sql`` with the (file_id, ``column``) pairs ``keys`` registered as the table
    ``name`` (the hits' lines, looked up in one query instead of one per hit)."""
    keys = list(keys)
    # two list parameters, unnested side by side (no Arrow: the diagnosis imports no pyarrow)
    ctx.con.execute(f'CREATE OR REPLACE TEMP TABLE "{name}" AS SELECT unnest(?::INTEGER[]) AS file_id, unnest(?::BIGINT[]) AS "{column}"',
                    [[a for a, _ in keys], [b for _, b in keys]]).fetchall()
    try:
        return ctx.con.execute(sql).fetchall()
    finally:
        ctx.con.execute(f'DROP TABLE IF EXISTS temp.main."{name}"').fetchall()


def attach_bodies(ctx: Context, hits: list[Hit]) -> None:
    # a line just after a traceback (an exception message continued on indented lines)
    # belongs to it, when the same process printed both (not a raylet's or another
    # worker's line that a console interleaved after it)
    loose = [(h.file_id, h.line_no) for h in hits if h.event_line is None and h.line_no]
    if loose:
        prev = keyed_rows(ctx, "_diag_loose", loose, "line_no",
                          # the lines before each, by equality (a range join of a big file's lines is slow)
                          """SELECT n.file_id, n.line_no, max(l.event_line)
                             FROM (SELECT file_id, line_no, unnest(range(line_no - 3, line_no)) AS prev FROM _diag_loose) n
                             JOIN lines l ON l.file_id = n.file_id AND l.line_no = n.prev
                             JOIN lines me ON me.file_id = n.file_id AND me.line_no = n.line_no
                             WHERE l.event_line IS NOT NULL AND l.pid IS NOT DISTINCT FROM me.pid
                               AND l.actor IS NOT DISTINCT FROM me.actor
                             GROUP BY n.file_id, n.line_no""")
        near = {(a, b): c for a, b, c in prev}
        for h in hits:
            if h.event_line is None and (h.file_id, h.line_no) in near:
                h.event_line = near[(h.file_id, h.line_no)]
    keys = {(h.file_id, h.event_line) for h in hits if h.event_line is not None}
    if not keys:
        return
    rows = keyed_rows(ctx, "_diag_events", keys, "event_line",
                      """SELECT l.file_id, l.event_line, string_agg(l.message, chr(10) ORDER BY l.line_no)
                         FROM lines l SEMI JOIN _diag_events e ON l.file_id = e.file_id AND l.event_line = e.event_line
                         GROUP BY l.file_id, l.event_line""")
    bodies = {(a, b): c for a, b, c in rows}
    for h in hits:
        if h.event_line is not None:
            h.body = bodies.get((h.file_id, h.event_line))


def attach_task_pids(ctx: Context, hits: list[Hit], facts: RunFacts) -> None:
    """A traceback printed under a Ray task header (``RayTaskError(...): ray::X.m() (pid=N``,
    ``Unhandled error ...: ray::X.m() (pid=N``) is worker N's, even when the driver's
    TaskRunner prints it: the nearest such header above the line, within 60 lines (the
    headers: ``facts.task_headers``)."""
    driver = set(ctx.causality.driver_actors)
    heads: dict[int, list[tuple[int, int, str | None]]] = defaultdict(list)
    for file_id, line_no, pid, actor_class, _ in facts.task_headers:
        heads[file_id].append((line_no, pid, actor_class))
    for h in hits:
        if h.line_no is None or h.file_id not in heads:
            continue
        if h.pid is not None and h.actor not in driver:
            continue
        best = None
        for line_no, pid, actor_class in heads[h.file_id]:
            if line_no > h.line_no:
                break
            if h.line_no - line_no <= 60:
                best = (pid, actor_class)
        if best and best[1] not in driver:
            h.task_pid = best[0]


def place(ctx: Context, hits: list[Hit], facts: RunFacts) -> None:
    task_methods = facts.task_methods
    near = _NearBodies(ctx, hits)
    first_metric_line = {fid: ln for fid, ln in ctx.con.execute(
        "SELECT file_id, min(line_no) FROM metrics WHERE step >= 1 GROUP BY file_id").fetchall()}
    for h in hits:
        # an ActorDiedError block is about the actor it names (its `pid:` line below the head)
        dead = facts.death_pid.get((h.file_id, h.line_no)) if h.line_no is not None else None
        if dead is not None and not h.groups.get("pid"):
            h.groups["pid"] = str(dead)
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
        elif h.groups.get("own_rank", "").isdigit():
            h.rank, h.rank_source = int(h.groups["own_rank"]), "text"
        else:
            # `[Rank 3]`, `[rank_3]`; NeMo-RL's worker repr `DTensorPolicyWorker[rank=3]` (the
            # global rank) in a Ray task header's `repr=` names the worker that failed
            m = re.search(r"\[[Rr]ank[ _=]?(\d+)\]", h.message)
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
            ph = ctx.phase_of(h.body, frames_only=True)
            src = "frames" if ph else None
        if ph is None and h.proc is not None:
            # the traceback of the same process: the same failure copied to another file,
            # or the exception a failing line leads to a few lines later
            ph = near.of_process(h)
            src = "frames" if ph else None
        if ph is None and h.proc is not None and h.proc in task_methods:
            ph, src = ctx.phase_of(task_methods[h.proc]), "ray_task"
        if ph is None and h.groups.get("method"):  # the task the line names (a killed task's name)
            ph = ctx.phase_of(h.groups["method"])
            src = "ray_task" if ph else None
        if ph is None and h.actor:  # the role the actor plays (a reference model only runs forwards)
            ph = ctx.phase_of(h.actor)
            src = "actor" if ph else None
        if ph is None and h.event_line is None:  # what the line itself talks about ("tool calls")
            ph = ctx.phase_of(h.message)
            src = "message" if ph else None
        if ph is None and h.event_line is None:
            # the traceback a failing line leads to a few lines later in the same file, whoever printed it
            ph = near.after_in_file(h)
            src = "frames" if ph else None
        h.phase, h.phase_source = ph, src
    _recent_activity(ctx, [h for h in hits if h.phase is None and h.event_line is None and h.line_no])
    for h in hits:
        if h.phase is None and facts.before_first_step(h, first_metric_line):
            h.phase, h.phase_source = "init", "before_first_step"


NEAR_LINES = 40  # how far (in lines) a traceback of another rule's hit still tells a hit's phase


class _NearBodies:
    """The hits with a traceback body whose frames imply a phase, indexed for :func:`place`:
    which one tells the phase of a hit whose own body does not (the nearest, as below).
    Each lookup reads only the candidates of one process and rule, or the few near the line
    in one file (by bisection): a sort of every body of the process for every hit took
    minutes on the 1 GB bench database."""

    def __init__(self, ctx: Context, hits: list[Hit]):
        self.by_rule: dict[tuple, list] = defaultdict(list)  # (proc, rule) -> [(line, index, file, phase)]
        self.by_rule_file: dict[tuple, list] = defaultdict(list)  # (proc, rule, file) -> [(line, index, phase)]
        by_proc_file: dict[tuple, list] = defaultdict(list)  # (proc, file) -> [(line, index, rule, phase)]
        by_file: dict[int, list] = defaultdict(list)  # file -> [(line, index, phase)]
        for i, o in enumerate(hits):
            if not o.body:
                continue
            ph = ctx.phase_of(o.body, frames_only=True)
            if not ph:
                continue
            line, proc = o.line_no or 0, o.proc
            by_file[o.file_id].append((line, i, ph))
            if proc is not None:
                self.by_rule[(proc, o.rule.id)].append((line, i, o.file_id, ph))
                self.by_rule_file[(proc, o.rule.id, o.file_id)].append((line, i, ph))
                by_proc_file[(proc, o.file_id)].append((line, i, o.rule.id, ph))
        # the two read by line window: sorted, with their lines apart for bisect
        self.by_proc_file = {k: _sorted_by_line(rows) for k, rows in by_proc_file.items()}
        self.by_file = {k: _sorted_by_line(rows) for k, rows in by_file.items()}

    @staticmethod
    def _window(indexed: tuple[list, list], lo: int, hi: int) -> list:
        keys, rows = indexed
        return rows[bisect.bisect_left(keys, lo):bisect.bisect_right(keys, hi)]

    def of_process(self, h: Hit) -> str | None:
        """The phase of the nearest body of ``h``'s process: of the same rule in the same file
        (any distance), else of the same rule in another file, else of another rule within
        NEAR_LINES lines in the same file; the nearer line first, then the earlier hit."""
        line, proc = h.line_no or 0, h.proc
        same_file = self.by_rule_file.get((proc, h.rule.id, h.file_id))
        if same_file:
            return min(same_file, key=lambda r: (abs(r[0] - line), r[1]))[2]
        other = self.by_rule.get((proc, h.rule.id))
        if other:  # none of them in h's file (those would be in same_file)
            return min(other, key=lambda r: (abs(r[0] - line), r[1]))[3]
        indexed = self.by_proc_file.get((proc, h.file_id))
        if indexed:
            near = [r for r in self._window(indexed, line - NEAR_LINES, line + NEAR_LINES) if r[2] != h.rule.id]
            if near:
                return min(near, key=lambda r: (abs(r[0] - line), r[1]))[3]
        return None

    def after_in_file(self, h: Hit) -> str | None:
        """The phase of the first body in ``h``'s file that starts 1 to NEAR_LINES lines
        after it, whoever printed it."""
        indexed = self.by_file.get(h.file_id)
        if not indexed:
            return None
        line = h.line_no or 0
        after = self._window(indexed, line + 1, line + NEAR_LINES)
        return after[0][2] if after else None


def _sorted_by_line(rows: list[tuple]) -> tuple[list, list]:
    rows = sorted(rows)  # (line, index, ...): by line, then hit order
    return [r[0] for r in rows], rows


def _recent_activity(ctx: Context, hits: list[Hit], back: int = 10) -> None:
    """The phase the lines just before a failure line talk about (what the process was
    doing: ``POST /update_named_param`` before a socket timeout is a weight sync)."""
    if not hits:
        return
    rows = keyed_rows(ctx, "_diag_recent", {(h.file_id, h.line_no) for h in hits}, "line_no",
                      f"""SELECT n.file_id, n.line_no, string_agg(l.message, chr(10) ORDER BY l.line_no)
                          FROM (SELECT file_id, line_no, unnest(range(line_no - {int(back)}, line_no)) AS prev FROM _diag_recent) n
                          JOIN lines l ON l.file_id = n.file_id AND l.line_no = n.prev
                          WHERE l.event_line IS NULL GROUP BY n.file_id, n.line_no""")
    before = {(a, b): c for a, b, c in rows}
    for h in hits:
        ph = ctx.phase_of(before.get((h.file_id, h.line_no)))
        if ph:
            h.phase, h.phase_source = ph, "recent"

ROLE_RANK = {"cause": 0, "fallback": 1, "symptom": 2, "stop": 3, "end": 4, "finding": 5, "context": 6}
