"""The input formats: one module each, pure functions from a byte stream to frames.

Each format declares itself next to its parser (:class:`~.base.Format`: name, sniff
rules, priority, parse function, tables); the text splitter's line formats live in
:mod:`.lines`. :mod:`.registry` finds the declarations (ours and other packages', through
the entry point group ``forensics.formats``); this package lists none of them. The
functions below are the registry's, for the pipeline and the store: ``parser_for`` gives
a detected format's parse function, ``all_tables()`` every table the formats fill (the
whole database schema apart from the bookkeeping tables of ``forensics.store``).
"""
from __future__ import annotations

from .base import FileContext, Format, LineFormat, ParseOutput, Sniff, Table
from .registry import all_tables, format_named, formats, line_formats, parser_for, problems

__all__ = ["FileContext", "Format", "LineFormat", "ParseOutput", "Sniff", "Table",
           "all_tables", "format_named", "formats", "line_formats", "parser_for", "problems"]
