"""What every stage of a diagnosis shares: the open connection, the catalogue, and the
phase markers (which frames and task names imply which phase of a step)."""
from __future__ import annotations

import re
from datetime import timedelta

import duckdb

from ..catalogue import Catalogue

_FRAME_LINE = re.compile(r'^\s*File "|ray::\S+ \(pid=\d+|^\s+[\w.<>]+ \([^()]+\.py:\d+\)$')  # python, Ray task, py-spy frames


def phase_of(text: str | None, markers: list[tuple[str, re.Pattern, bool]], frames_only: bool = False) -> str | None:
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



class Context:
    """The connection and the catalogue of one diagnosis, with the phase markers compiled."""

    def __init__(self, con: duckdb.DuckDBPyConnection, cat: Catalogue, performance: bool = True):
        self.con = con
        self.cat = cat
        self.performance = performance
        self.causality = cat.causality
        self.markers = [(p, re.compile(rx), o) for p, rx, o in cat.phase_markers]
        self._phases: dict[tuple[str | None, bool], str | None] = {}
        self.same_moment = timedelta(seconds=cat.causality.same_moment_s)

    def phase_of(self, text: str | None, frames_only: bool = False) -> str | None:
        """:func:`phase_of` with this run's markers, memoised (the ranks of a cascade print
        the same tracebacks)."""
        key = (text, frames_only)
        if key not in self._phases:
            self._phases[key] = phase_of(text, self.markers, frames_only)
        return self._phases[key]
