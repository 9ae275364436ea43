"""What every stage of a diagnosis shares: the open connection, the catalogue, and the
phase markers (which frames and task names imply which phase of a step)."""
from __future__ import annotations

import re
from datetime import timedelta

import duckdb

from ..catalogue import Catalogue

_FRAME_LINE = re.compile(r'^\s*File "|ray::\S+ \(pid=\d+|^\s+[\w.<>]+ \([^()]+\.py:\d+\)$')  # python, Ray task, py-spy frames


LineVerdict = tuple[int | None, str | None]  # (first override marker that matches, first other marker's phase)


class Marker:
    """A phase marker's regex with the literals one of which each of its matches contains
    (``keywords``: case-sensitive and case-insensitive ones, or None when there are none):
    a line without any cannot match, and the regex is compiled only when a line has one
    (a diagnosis would otherwise compile every marker at start-up, most of them in vain)."""

    __slots__ = ("pattern", "cs", "ci", "_rx")

    def __init__(self, pattern: str, keywords: tuple[tuple[str, ...], tuple[str, ...]] | None = None):
        self.pattern = pattern
        self.cs, self.ci = keywords if keywords is not None else ((), ())
        self.ci = tuple(k.lower() for k in self.ci)
        self._rx: re.Pattern | None = None if keywords is not None else re.compile(pattern)

    def search(self, line: str) -> "re.Match | None":
        if (self.cs or self.ci) and not any(k in line for k in self.cs):
            # lower() agrees with the regex's case folding on ASCII only: other text is tried
            if not self.ci or (line.isascii() and not any(k in line.lower() for k in self.ci)):
                return None
        if self._rx is None:
            self._rx = re.compile(self.pattern)
        return self._rx.search(line)


def line_verdict(line: str, markers: list[tuple[str, "re.Pattern | Marker", bool]]) -> LineVerdict:
    """What the phase markers say of one line: the index of the first ``override`` marker
    that matches it, and the phase of the first other marker that does (None: none)."""
    first_override = plain = None
    for i, (phase, rx, override) in enumerate(markers):
        if override:
            if first_override is None and rx.search(line):
                first_override = i
        elif plain is None and rx.search(line):
            plain = phase
        if plain is not None and first_override is not None:
            break
    return first_override, plain


LINE_VERDICTS_KEPT = 200_000  # distinct lines whose verdicts a Context keeps at a time


def phase_of(text: str | None, markers: list[tuple[str, "re.Pattern | Marker", bool]], frames_only: bool = False,
             verdicts: dict[str, LineVerdict] | None = None) -> str | None:
    """The phase a traceback (or a task name) implies: an ``override`` phase whose marker
    matches any line wins (the first such marker); otherwise the deepest (last) line that
    matches a marker decides. ``frames_only``: read only the frame and source lines of a
    traceback (not the text of the exception, which may list anything, e.g. every process
    on the node). ``verdicts``: a memo of :func:`line_verdict` by line (the tracebacks of a
    run share most of their frame lines)."""
    if not text:
        return None
    lines = text.split("\n")
    if frames_only:  # frame lines and the source line printed under each
        lines = [ln for i, ln in enumerate(lines)
                 if _FRAME_LINE.search(ln) or (i > 0 and lines[i - 1].lstrip().startswith("File \""))]
    if verdicts is None:
        verdicts = {}
    elif len(verdicts) > LINE_VERDICTS_KEPT:
        verdicts.clear()
    found = []
    for line in lines:
        v = verdicts.get(line)
        if v is None:
            v = verdicts[line] = line_verdict(line, markers)
        found.append(v)
    overrides = [o for o, _ in found if o is not None]
    if overrides:
        return markers[min(overrides)][0]
    for _, plain in reversed(found):
        if plain is not None:
            return plain
    return None


class Context:
    """The connection and the catalogue of one diagnosis, with the phase markers compiled."""

    def __init__(self, con: duckdb.DuckDBPyConnection, cat: Catalogue, performance: bool = True):
        self.con = con
        self.cat = cat
        self.performance = performance
        self.causality = cat.causality
        self.markers = [(p, Marker(rx, kw), o) for (p, rx, o), kw in zip(cat.phase_markers, cat.marker_keywords())]
        self._phases: dict[tuple[str | None, bool], str | None] = {}
        self._line_verdicts: dict[str, LineVerdict] = {}
        self.same_moment = timedelta(seconds=cat.causality.same_moment_s)

    def phase_of(self, text: str | None, frames_only: bool = False) -> str | None:
        """:func:`phase_of` with this run's markers, memoised (the ranks of a cascade print
        the same tracebacks)."""
        key = (text, frames_only)
        if key not in self._phases:
            self._phases[key] = phase_of(text, self.markers, frames_only, self._line_verdicts)
        return self._phases[key]
