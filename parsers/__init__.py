"""One module per input format. Each is a pure function from a byte stream to frames.

``FORMATS`` maps a detected format (see ``forensics.detect``) to its parse function;
``all_tables()`` collects every :class:`parsers.base.Table` the modules declare, which
is the whole database schema apart from the bookkeeping tables of ``forensics.store``.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Callable

from .base import FileContext, ParseOutput, Table

Parser = Callable[..., ParseOutput]

TEXT_FORMATS = (
    "text", "driver", "torchrun", "torchrun_rank", "nccl_debug", "kernel", "vllm",
    "ray_worker", "ray_core_worker", "ray_raylet", "ray_gcs_server", "ray_monitor",
    "ray_log_monitor", "ray_dashboard", "ray_dashboard_agent", "ray_runtime_env_agent", "ray_events",
    "metrics_jsonl",  # every line is a line; JSON records also become metrics rows
)


def parser_for(fmt: str) -> Parser | None:
    """The parse function for a detected format, or None when no parser reads it."""
    from . import text

    if fmt in TEXT_FORMATS:
        return text.parse_text
    structured = {
        "kineto_trace": ("kineto", "parse_trace"),
        "ray_timeline": ("ray_timeline", "parse_timeline"),
        "flight_recorder": ("flight_recorder", "parse_dump"),
    }
    if fmt in structured:
        mod_name, fn = structured[fmt]
        try:
            mod = importlib.import_module(f"{__name__}.{mod_name}")
        except ModuleNotFoundError:
            return None
        return getattr(mod, fn, None)
    return None


@functools.lru_cache(maxsize=1)
def _collect_tables() -> tuple[Table, ...]:
    tables: dict[str, Table] = {}
    for info in pkgutil.iter_modules(__path__):
        mod = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(mod).values():
            if isinstance(value, Table):
                tables.setdefault(value.name, value)
    return tuple(tables.values())


def all_tables() -> list[Table]:
    """Every table the parser modules declare (collected once per process)."""
    return list(_collect_tables())


__all__ = ["FileContext", "ParseOutput", "Table", "parser_for", "all_tables", "TEXT_FORMATS"]
