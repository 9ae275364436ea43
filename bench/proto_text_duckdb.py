"""Prototype, not used by forensics: text logs split into lines by DuckDB itself.

    python bench/proto_text_duckdb.py --folder bench/data/text-XXXX   # a folder kept by bench_ingest.py --keep

bench/README.md (bench_ingest.py) explains why the present text ingest tops out near
15-20 MB/s on two cores: hundreds of polars queries per batch run the line formats. This
script measures the first step of the other road, where DuckDB does the per-line work in
SQL. It reads every file of the folder with ``read_blob``, splits it into lines
(``string_split`` / ``unnest``, with each line's number) into a table of a fresh database,
then times a few typical per-line regular expressions over all the lines. It prints wall
and CPU seconds, MB/s, the process's peak RSS, and the line count against the physical
lines of the folder.

It is not an ingest: no provenance beyond file and line, no formats, no timestamps, and
files must be UTF-8 (``decode`` fails otherwise). It only sizes the two costs that a
DuckDB-native design would be made of.
"""
from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

import duckdb

PATTERNS = [
    r"^\((\w+) pid=(\d+)(?:, ip=([\d.]+))?\) ",  # Ray driver prefix
    r"^\[?(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2})",  # ISO timestamp header
    r"NCCL (INFO|WARN)",  # NCCL debug lines
    r"Traceback \(most recent call last\):",
    r"^step:(\d+) - ",  # verl console metrics
]


def physical_lines(folder: Path) -> tuple[int, int]:
    lines = nbytes = 0
    for p in folder.rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            nbytes += len(data)
            lines += data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    return lines, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--folder", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    lines, nbytes = physical_lines(args.folder)
    with tempfile.TemporaryDirectory(prefix="proto-text-") as work:
        con = duckdb.connect(os.path.join(work, "raw.duckdb"))
        con.execute(f"SET threads = {args.threads}")
        con.execute("SET memory_limit = '1GB'")
        con.execute("SET preserve_insertion_order = false")
        t, c = time.perf_counter(), time.process_time()
        # a file that ends with a line break splits into one empty last element: dropped
        con.execute(f"""
            CREATE TABLE raw AS
            WITH f AS (SELECT filename, string_split(decode(content), chr(10)) AS ls
                       FROM read_blob('{args.folder}/**'))
            SELECT filename, line, line_no FROM (
                SELECT filename, unnest(ls) AS line, generate_subscripts(ls, 1) AS line_no, len(ls) AS n FROM f)
            WHERE NOT (line_no = n AND line = '')""")
        load_s, load_cpu = time.perf_counter() - t, time.process_time() - c
        (rows,) = con.execute("SELECT count(*) FROM raw").fetchone()
        print(f"load avg {os.getloadavg()[0]:.1f}; {nbytes / 1e6:.0f} MB: split into lines in {load_s:.1f} s "
              f"({load_cpu:.1f} CPU s, {nbytes / 1e6 / load_s:.1f} MB/s); {rows:,} rows, physical lines {lines:,} "
              f"({'OK' if rows == lines else 'MISMATCH'})")
        t, c = time.perf_counter(), time.process_time()
        counts = con.execute("SELECT " + ", ".join(
            f"count(*) FILTER (WHERE regexp_matches(line, '{p}'))" for p in PATTERNS) + " FROM raw").fetchone()
        s, cpu = time.perf_counter() - t, time.process_time() - c
        print(f"{len(PATTERNS)} regular expressions over every line: {s:.2f} s ({cpu:.2f} CPU s, "
              f"{cpu / len(PATTERNS):.2f} CPU s per pattern); matches {list(counts)}")
        print(f"peak RSS of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
        con.close()


if __name__ == "__main__":
    main()
