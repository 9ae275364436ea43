"""Rows derived from lines take their line's final timestamp: found by position in the
chunk, with the same answer as a join on (file_id, line_no)."""
from datetime import datetime

import polars as pl

from forensics.parsers.text import _line_stamped


def _stamps(rows):
    return pl.DataFrame(rows, schema={"file_id": pl.Int32, "line_no": pl.Int64, "_line_ts": pl.Datetime("us")}, orient="row")


def _joined(frame, stamps):
    return frame.join(stamps, on=["file_id", "line_no"], how="left", maintain_order="left").with_columns(
        pl.col("_line_ts").alias("ts")).drop("_line_ts")


T = [datetime(2026, 1, 1, 0, 0, s) for s in range(10)]
FRAME = pl.DataFrame(
    {"file_id": [2, 1, 1, 2, 1, 3, 1], "line_no": [5, 1, 3, 7, None, 1, 9], "ts": [None] * 7, "value": list(range(7))},
    schema={"file_id": pl.Int32, "line_no": pl.Int64, "ts": pl.Datetime("us"), "value": pl.Int64},
)


def test_by_position_equals_the_join():
    # file 1: lines 1-3, file 2: lines 5-7 (a chunk of a grown file starts past 1)
    stamps = _stamps([(1, 1, T[0]), (1, 2, None), (1, 3, T[2]), (2, 5, T[5]), (2, 6, T[6]), (2, 7, T[7])])
    got = _line_stamped(FRAME, stamps)
    assert got.equals(_joined(FRAME, stamps))
    # line 3 of file 1, line 7 of file 2; a null line_no, an unknown file, a line past the file's: null
    assert got.get_column("ts").to_list() == [T[5], T[0], T[2], T[7], None, None, None]


def test_lines_not_in_file_order_fall_back_to_the_join():
    # file 1's lines in two places of the chunk: positions would point at file 2's rows
    stamps = _stamps([(1, 1, T[0]), (2, 5, T[5]), (1, 2, T[1]), (1, 3, T[2]), (2, 6, T[6]), (2, 7, T[7])])
    got = _line_stamped(FRAME, stamps)
    assert got.equals(_joined(FRAME, stamps))
    assert got.get_column("ts").to_list()[:4] == [T[5], T[0], T[2], T[7]]
