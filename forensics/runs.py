"""Which runs an ingested PATH holds: pure rules over the paths of its files and their
detected formats (no database, no file system), so that an ingest, a re-ingest and an
older database without a ``runs`` table all find the same runs.

A PATH is one run unless its layout says otherwise:

* a Ray session folder (``session_*``) is a run of its own when it has sibling sessions
  (``/tmp/ray`` keeps one per ``ray start``; a bundle with one session is that run);
* a folder whose own files include a log of a known format is one run: its subfolders
  are parts of it (nodes, ``ray_logs/``, ``profiler/``), unless it holds nothing but
  several driver logs (no other file, no subfolder) that each start a run of their own:
  no two name the same worker process (the head and the tail of one console do);
* a folder without such files of its own whose subfolders (two or more) each hold logs is
  a folder of runs: each subfolder is read the same way; unless half of them or more are
  named like parts of one run (``node_*``, ``node-3``, ``head_node``, ``worker_node``,
  ``rank1``, ``ray_logs``, ``logs``, ...): then it is one run (a bundle of a
  ``host-oom-...`` case among others does not make its folder one run);
* files that belong to no run found inside (a README beside bundle folders) stay with the
  PATH, which is then a container and is not diagnosed on its own.

No file name is special (a ``label.json`` plays no part): the formats decide.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

# formats that say nothing about a folder being a run (anything may hold them)
PLAIN_FORMATS = frozenset({"text", "empty", "binary", "unknown", "unreadable"})
DRIVER_FORMATS = frozenset({"driver"})

# a folder named like a part of one run: a node, a rank, a role, or a log folder of one
_PART_OF_A_RUN = re.compile(
    r"^(?:(?:head|worker|master|main)[_-]?node(?:[_-].*)?|(?:node|host|rank|worker|gpu)[_-]?[\w.-]*|"
    r"nodes|hosts|machines|ray_logs|node_logs|logs|log|events|export_events|profiler|profiles?|traces?|"
    r"nccl_debug|nccl_traces?|torchrun_logs|none_.*|attempt_\d+|\d+|old|tensorboard|wandb|metrics|checkpoints?)$",
    re.I)
_SESSION = re.compile(r"^session_(?!latest$)")


@dataclass
class FoundRun:
    rel: str  # folder or file relative to the PATH ('' = the PATH itself)
    kind: str  # path | ray_session | bundle | driver_log
    files: list[str] = field(default_factory=list)


@dataclass
class _Dir:
    files: list[tuple[str, str]] = field(default_factory=list)  # (rel path, format) of its own files
    dirs: dict[str, "_Dir"] = field(default_factory=dict)

    def all_files(self) -> list[str]:
        out = [rel for rel, _ in self.files]
        for d in self.dirs.values():
            out.extend(d.all_files())
        return out


def _tree(files: list[tuple[str, str]]) -> _Dir:
    top = _Dir()
    for rel, fmt in files:
        node = top
        for part in rel.split("/")[:-1]:
            node = node.dirs.setdefault(part, _Dir())
        node.files.append((rel, fmt))
    return top


def _apart(drivers: list[str], pids: dict[str, set[int]] | None) -> bool:
    """Whether the driver logs are of separate runs: each names processes (its workers'
    ``pid=`` prefixes) and no two name the same one (the head and the tail of one console,
    pasted as two files, share their workers)."""
    if pids is None:
        return False
    seen: set[int] = set()
    for f in drivers:
        mine = pids.get(f) or set()
        if not mine or mine & seen:
            return False
        seen |= mine
    return True


def _split(d: _Dir, rel: str, kind: str, pids: dict[str, set[int]] | None = None) -> tuple[list[FoundRun], list[str]]:
    """The runs found in folder ``d`` (at ``rel``) and the files of ``d`` that belong to
    none of them (they stay with the container)."""
    name = rel.rsplit("/", 1)[-1]
    if rel and _SESSION.match(name):
        return [FoundRun(rel, "ray_session", d.all_files())], []
    held = {k: v for k, v in d.dirs.items() if v.all_files()}
    sessions = {k: v for k, v in held.items() if _SESSION.match(k)}
    if len(sessions) >= 2:
        runs = [FoundRun(_join(rel, k), "ray_session", v.all_files()) for k, v in sorted(sessions.items())]
        rest = [f for f, _ in d.files] + [f for k, v in held.items() if k not in sessions for f in v.all_files()]
        rest_formats = [fmt for _, fmt in d.files] + [fmt for k, v in held.items() if k not in sessions for fmt in _formats(v)]
        if any(fmt not in PLAIN_FORMATS for fmt in rest_formats):  # the driver log and such beside the sessions
            runs.append(FoundRun(rel, kind, rest))
            return runs, []
        return runs, rest
    own = [fmt for _, fmt in d.files if fmt not in PLAIN_FORMATS]
    if own:
        drivers = [f for f, fmt in d.files if fmt in DRIVER_FORMATS]
        if (not held and len(drivers) >= 2 and all(fmt in DRIVER_FORMATS or fmt == "empty" for _, fmt in d.files)
                and _apart(drivers, pids)):
            # a folder of nothing but driver consoles: one run each
            runs = [FoundRun(f, "driver_log", [f]) for f in drivers]
            return runs, [f for f, _ in d.files if f not in drivers]
        return [FoundRun(rel, kind, d.all_files())], []
    if len(held) >= 2 and sum(1 for k in held if _PART_OF_A_RUN.match(k)) * 2 < len(held):
        runs: list[FoundRun] = []
        rest = [f for f, _ in d.files]
        for k, v in sorted(held.items()):
            inner, left = _split(v, _join(rel, k), "bundle", pids)
            runs.extend(inner)
            rest.extend(left)
        return runs, rest
    if len(held) == 1 and not d.files:
        (k, v), = held.items()
        inner, left = _split(v, _join(rel, k), kind, pids)
        if len(inner) > 1:
            return inner, left
    return [FoundRun(rel, kind, d.all_files())], []


def _formats(d: _Dir) -> list[str]:
    return [fmt for _, fmt in d.files] + [fmt for v in d.dirs.values() for fmt in _formats(v)]


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name


def find_runs(files: list[tuple[str, str]], pids: dict[str, set[int]] | None = None) -> tuple[list[FoundRun], list[str]]:
    """The runs among the files of one PATH, given as (path relative to the PATH, format):
    the runs found (one covering everything, ``rel == ''``, when the PATH is one run) and
    the files that belong to none of them. ``pids``: the processes each driver log names
    (a folder of driver logs is a folder of runs only when no two share one)."""
    if not files:
        return [], []
    runs, rest = _split(_tree(files), "", "path", pids)
    if len(runs) == 1 and not rest:
        return [FoundRun("", "path", runs[0].files)], []
    return runs, rest
