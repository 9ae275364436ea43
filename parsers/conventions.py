"""Conventions of the stored rows that the parsers write and the readers of a database
(the diagnosis, the report) rely on. No import here: reading a database needs no parser."""
from __future__ import annotations

YEARLESS = 2000  # placeholder year for formats that print none (a leap year: Feb 29 parses)
