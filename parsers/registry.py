"""Which formats there are: ours, and those other packages add without editing this one.

A module that declares formats has a ``FORMATS`` sequence of :class:`~.base.Format` and
:class:`~.base.LineFormat` declarations. Our own modules are listed in ``BUILTIN``; another
package names its module (or a declaration, or a sequence of them) in the entry point
group ``forensics.formats``, e.g. in its ``pyproject.toml``::

    [project.entry-points."forensics.formats"]
    tinylog = "tinylog_forensics.format"

Both go through :func:`_declarations`, the same way. The built-ins are a list here rather
than entry points of our own distribution: a source checkout (and an editable install
whose metadata predates a new module) would otherwise find no format at all.

A package whose entry point does not load, or whose declarations clash with formats,
line formats or tables already known, is left out whole; :func:`problems` says why in
words (the ingest summary shows them) and every other format still works.

This module imports no format module by name: it finds them when first asked
(:func:`formats` etc.), once per process (a parser process finds the same ones: it has
the same ``sys.path``).
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Iterable

from .base import Format, LineFormat, ParseOutput, Sniff, Table

ENTRY_POINT_GROUP = "forensics.formats"

# Our modules that declare formats, in the order their tables are listed (alphabetical by
# module name, the order the schema was always listed in). The order in which rules are
# tried and line formats run is their declared priority / order, not this list's.
BUILTIN = (
    "flight_recorder", "lines.containers", "lines.launchers", "lines.headers", "lines.kernel", "kineto", "lines.nccl", "lines.ray_driver",
    "lines.ray_logs", "ray_timeline", "text", "lines.torch_distributed", "lines.torchrun",
    "lines.verl_metrics", "lines.vllm",
)

# The format whose parse function reads every text format: the text splitter.
SPLITTER = "text"

Parser = Callable[..., ParseOutput]
Declaration = Format | LineFormat


@dataclass(frozen=True)
class Registry:
    formats: dict[str, Format]  # by name, in the order they were declared
    line_formats: tuple[LineFormat, ...]  # in the order they run
    tables: tuple[Table, ...]
    rules: tuple[tuple[int, Format, Sniff], ...]  # every sniff rule, highest priority first
    problems: tuple[str, ...]  # packages left out, in words
    builtin_tables: tuple[Table, ...]  # the tables of our own formats (docs/schema.md)


def _declarations(obj: object, origin: str) -> list[Declaration]:
    """The declarations ``obj`` stands for: a module's ``FORMATS``, a declaration, or a
    sequence of declarations."""
    if isinstance(obj, ModuleType):
        if not hasattr(obj, "FORMATS"):
            raise TypeError(f"{origin}: module {obj.__name__} has no FORMATS")
        obj = obj.FORMATS
    if isinstance(obj, (Format, LineFormat)):
        return [obj]
    if not isinstance(obj, Iterable) or isinstance(obj, (str, bytes)):
        raise TypeError(f"{origin}: {obj!r} is no format declaration nor a sequence of them")
    items = list(obj)
    for item in items:
        if not isinstance(item, (Format, LineFormat)):
            raise TypeError(f"{origin}: {item!r} is neither a Format nor a LineFormat")
    return items


class _Builder:
    def __init__(self):
        self.formats: dict[str, Format] = {}
        self.line_formats: dict[str, LineFormat] = {}
        self.tables: dict[str, Table] = {}

    def clash(self, items: list[Declaration]) -> str | None:
        """Why ``items`` cannot join what is known, or None."""
        seen_formats, seen_lines, seen_tables = set(self.formats), set(self.line_formats), dict(self.tables)
        for item in items:
            names = seen_formats if isinstance(item, Format) else seen_lines
            if item.name in names:
                return f"{type(item).__name__} {item.name!r} is declared already"
            if isinstance(item, Format) and item.kind == "text" and item.parse is not None and item.name != SPLITTER:
                # small text files are read many at a time by the splitter, whatever their format
                return f"text format {item.name!r} has a parse function: the text splitter reads every text format"
            names.add(item.name)
            for table in item.tables:
                if seen_tables.setdefault(table.name, table) != table:
                    return f"table {table.name!r} is declared already, with other columns"
        return None

    def add(self, items: list[Declaration]) -> None:
        for item in items:
            if isinstance(item, Format):
                self.formats[item.name] = item
            else:
                self.line_formats[item.name] = item
            for table in item.tables:
                self.tables.setdefault(table.name, table)


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: (ep.name, ep.value))


def _load() -> Registry:
    b = _Builder()
    for name in BUILTIN:  # ours: a failure here is a bug, and raises
        items = _declarations(importlib.import_module(f"{__package__}.{name}"), name)
        why = b.clash(items)
        if why:
            raise ValueError(f"{name}: {why}")
        b.add(items)
    builtin_tables = tuple(b.tables.values())
    problems = []
    for ep in _entry_points():
        dist = ep.dist.name if ep.dist is not None else "?"
        what = f"format package {ep.name!r} ({ep.value}, from {dist})"
        try:
            items = _declarations(ep.load(), ep.name)
        except Exception as exc:  # its fault, not ours: leave it out, say so, go on
            problems.append(f"{what} not loaded: {type(exc).__name__}: {exc}")
            continue
        why = b.clash(items)
        if why:
            problems.append(f"{what} not loaded: {why}")
            continue
        b.add(items)
    order = {f.name: i for i, f in enumerate(b.formats.values())}
    rules = sorted(((rule.priority, f, rule) for f in b.formats.values() for rule in f.sniff),
                   key=lambda r: (-r[0], order[r[1].name]))
    lines = sorted(b.line_formats.values(), key=lambda lf: lf.order)  # stable: ties keep declaration order
    return Registry(dict(b.formats), tuple(lines), tuple(b.tables.values()), tuple(rules), tuple(problems), builtin_tables)


@functools.lru_cache(maxsize=1)
def registry() -> Registry:
    """The formats of this process, found on first use."""
    return _load()


def formats() -> list[Format]:
    return list(registry().formats.values())


def format_named(name: str) -> Format | None:
    return registry().formats.get(name)


def rules() -> tuple[tuple[int, Format, Sniff], ...]:
    """Every format's sniff rules as (priority, format, rule), in the order they are tried."""
    return registry().rules


def line_formats() -> tuple[LineFormat, ...]:
    """The line formats, in the order the text splitter runs them."""
    return registry().line_formats


def parser_for(fmt: str) -> Parser | None:
    """The parse function for a detected format, or None when no format of that name is
    known (a text format's is the splitter's)."""
    f = format_named(fmt)
    if f is None:
        return None
    if f.parse is None and f.kind == "text":
        f = format_named(SPLITTER)
    return f.parse


def all_tables(builtin_only: bool = False) -> list[Table]:
    """Every table the formats fill; ``builtin_only``: only those of our own formats."""
    r = registry()
    return list(r.builtin_tables if builtin_only else r.tables)


def path_hints(rel: str) -> dict:
    """What the path says about the process that wrote the file (``pid``, ``actor``,
    ``rank``), from every format's ``hints``; the first format to say a thing wins."""
    out: dict = {}
    seen = set()
    for f in registry().formats.values():
        if f.hints is None or f.hints in seen:
            continue
        seen.add(f.hints)
        for key, value in f.hints(rel).items():
            if value is not None and out.get(key) is None:
                out[key] = value
    return out


def problems() -> tuple[str, ...]:
    """Format packages that were left out, and why."""
    return registry().problems
