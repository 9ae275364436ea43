"""What the line formats share: recognising a header on ``message`` and reading its fields.

A line format (a module of this package) finds its prefix or header with
:func:`apply_header` and reads the named groups of the match with :func:`g`; levels,
timestamps and the placeholder year of year-less stamps are read the same way by all of
them. This module imports none of the line formats, so each of them (and the text
splitter, :mod:`forensics.parsers.text`) can import it.
"""
from __future__ import annotations

import polars as pl

from ..conventions import YEARLESS  # noqa: F401 (the line formats take it from here)


LEVELS = {
    "I": "INFO", "W": "WARNING", "E": "ERROR", "F": "FATAL", "C": "FATAL", "D": "DEBUG",
    "INFO": "INFO", "WARNING": "WARNING", "WARN": "WARNING", "ERROR": "ERROR",
    "CRITICAL": "FATAL", "FATAL": "FATAL", "DEBUG": "DEBUG", "TRACE": "DEBUG",
    "ABORT": "FATAL", "NOTICE": "INFO", "ERR": "ERROR",
}


def normalise_level(expr: pl.Expr) -> pl.Expr:
    return expr.str.to_uppercase().replace_strict(LEVELS, default=None, return_dtype=pl.String)


def apply_header(
    df: pl.DataFrame,
    pattern: str,
    name: str | None,
    fields: dict[str, pl.Expr],
    only_unset: bool = True,
    prefilter: pl.Expr | None = None,
) -> pl.DataFrame:
    """Recognise one header ``pattern`` (anchored, with a ``(?P<h>...)`` group spanning the
    whole header) on ``message``; where it matches, set ``fields`` (expressions over the
    struct column ``_m`` holding the named groups, and over the row's other columns),
    set ``header`` and strip the header from ``message``.

    Rows already claimed by an earlier header are left alone when ``only_unset``.
    ``name`` None: a prefix rather than a header (``header`` is left as it is).
    ``prefilter``: a cheap condition (e.g. ``message.str.starts_with('[')``) that every
    matching row satisfies; the regex then runs on those rows only. The work is done on
    the matching rows and scattered back, so its cost follows the matches, not the chunk.
    """
    cond = pl.repeat(True, pl.len())  # one value per row (a bare literal would give one index)
    if only_unset:
        cond = pl.col("header").is_null()
    if prefilter is not None:
        cond = cond & prefilter
    idx = df.select(pl.arg_where(cond)).to_series()
    if idx.is_empty():
        return df
    m = df.get_column("message").gather(idx).str.extract_groups(pattern)
    hit = m.struct.field("h").is_not_null()
    if not hit.any():
        return df
    idx = idx.filter(hit)
    small = df[idx].with_columns(m.filter(hit).alias("_m"))
    exprs = dict(fields)
    if name is not None:
        exprs["header"] = pl.lit(name, pl.String)
    exprs["message"] = pl.col("message").str.slice(pl.col("_m").struct.field("h").str.len_chars())
    new = small.select(**exprs)
    out = []
    for column in new.columns:
        current = df.get_column(column)
        out.append(current.scatter(idx, new.get_column(column).cast(current.dtype)))
    return df.with_columns(out)


def strip_prefix_of_most_lines(df: pl.DataFrame, pattern: str, fields: dict[str, pl.Expr], min_lines: int = 1) -> pl.DataFrame:
    """Strip the prefix ``pattern`` (as :func:`apply_header`, setting ``fields``) in the
    files of the frame where it begins at least half of the non-empty lines: a tool that
    prefixes every line it copies (a container runtime, a launcher) does so on all of
    them, while a line of some other file may start the same way by chance (a table row,
    ``ValueError: ...``). A frame holds many files: the share is counted per file.
    ``min_lines``: how many lines of the file must carry it at least (for a loose prefix,
    which one line of a paste alone could show by chance)."""
    hit = pl.col("message").str.contains(pattern)
    if not df.select(hit.any()).item():
        return df
    mostly = on_most_lines(hit) & (hit.sum().over("file_id") >= min_lines)
    return apply_header(df, pattern, None, fields, only_unset=False, prefilter=mostly)


def on_most_lines(hit: pl.Expr) -> pl.Expr:
    """``hit`` holds on at least half of the non-empty lines of the line's file (a frame
    holds many files: the share is counted per file)."""
    return hit.sum().over("file_id") * 2 >= (pl.col("message").str.len_bytes() > 0).sum().over("file_id")


def g(name: str) -> pl.Expr:
    """The named group ``name`` of the current header match."""
    return pl.col("_m").struct.field(name)


def coalesce_into(column: str, expr: pl.Expr) -> pl.Expr:
    """Keep an existing value of ``column``; otherwise take ``expr``."""
    return pl.coalesce(pl.col(column), expr)


def parse_ts(expr: pl.Expr) -> pl.Expr:
    """Parse ``YYYY-MM-DD HH:MM:SS[.fraction]`` (``,`` or ``T`` accepted)."""
    return (
        expr.str.replace(",", ".", literal=True)
        .str.replace("T", " ", literal=True)
        .str.to_datetime("%Y-%m-%d %H:%M:%S%.f", strict=False, time_unit="us")
    )


