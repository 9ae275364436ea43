"""Conventions of the stored rows that the parsers write and the readers of a database
(the diagnosis, the report) rely on. No import here: reading a database needs no parser."""
from __future__ import annotations

YEARLESS = 2000  # placeholder year for formats that print none (a leap year: Feb 29 parses)

# A hard-wrapped paste (a terminal cut its lines at a fixed width W): its widest line is at
# least WRAP_MIN_WIDTH characters, at least WRAP_MIN_SHARE of its lines (and 3) are exactly
# that wide, and it has at most WRAP_MAX_LINES lines. The fatal-event parser reads a cut line
# whole by this shape, and the diagnosis matches rules on the whole line by the same.
WRAP_MIN_WIDTH = 60
WRAP_MIN_SHARE = 0.3
WRAP_MAX_LINES = 20_000
