"""Benchmark: what the Ray engine's driver pays to load the nodes' parts, per GB of input,
from 1 to 3 simulated nodes.

    python bench/bench_ray_driver.py [--mb-per-node 40] [--nodes 3] [--corpus ../shared/corpus] [--keep]

Each simulated node gets a folder of about --mb-per-node MB of text logs (bench_ingest's
builder: copies of the corpus' text files with shifted timestamps, pids and hosts). The
node side (forensics.distributed.node_ingest: plan, parse, Arrow tables) runs here, once
per node, outside the timings; then, for 1, 2, ... --nodes nodes, the driver's side is
timed on a fresh database:

* object store: what the driver does with each item a node yields (unpickling it, as
  ray.get does, then pipeline.load_job into DuckDB), plus the end of the ingest (the
  yearless-timestamp fix and the row counts);
* --parts folder: the same with the rows read back from Parquet parts;
* --views-only: making the views over the parts (the driver's only work), and one query
  (count of lines per level) over the views and over the loaded tables.

CPU seconds are the driver process' own (time.process_time). The machine is shared: the
1-minute load average is printed beside every figure.
"""
from __future__ import annotations

import argparse
import os
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import duckdb  # noqa: E402

from bench_ingest import build  # noqa: E402
from forensics import distributed as D  # noqa: E402
from forensics import pipeline  # noqa: E402
from forensics.store import Store  # noqa: E402


def node_items(folder: Path, i: int, dest: str | None, views_only: bool = False) -> tuple[list, float]:
    """Node ``i``'s items (its file ids in its own block, as the driver gives them)."""
    job = D.NodeJob(f"node{i}", [str(folder)], None, {}, {}, 1 + i * D.ID_BLOCK, [], 1, False, dest, views_only,
                    D._run_id())
    t0 = time.process_time()
    items = list(D.node_ingest(job))
    return items, time.process_time() - t0


def driver_load(db: str, items_by_node: list[list], dest: str | None) -> tuple[float, float, int, float]:
    """Driver CPU s, wall s, rows, and the CPU s of those spent unpickling (what ray.get does)."""
    store = pipeline.open_writer(db, defer_views=False)
    batch = pipeline._Batch(store)
    summary = pipeline.IngestSummary(db=db)
    blobs = [[pickle.dumps(item, protocol=5) for item in items] for items in items_by_node]
    t_cpu, t_wall, unpickle = time.process_time(), time.perf_counter(), 0.0
    try:
        for items in blobs:
            for blob in items:
                t0 = time.process_time()
                item = pickle.loads(blob)  # what ray.get hands the driver
                unpickle += time.process_time() - t0
                D._load_item(store, batch, item, summary, False, None, 0, 0)
        batch.close()
        store.fix_yearless_timestamps()
        rows = sum(store.table_counts().values())
    finally:
        store.close()
    return time.process_time() - t_cpu, time.perf_counter() - t_wall, rows, unpickle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb-per-node", type=int, default=40)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--corpus", default=str(REPO.parent / "shared" / "corpus"))
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    corpus = Path(args.corpus)
    if not corpus.is_dir():
        corpus = REPO / "tests" / "fixtures"
    (REPO / "bench" / "data").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ray-driver-", dir=REPO / "bench" / "data"))
    try:
        folders, sizes = [], []
        for i in range(args.nodes):
            folder = work / f"node{i}"
            folder.mkdir()
            sizes.append(build(folder, corpus, args.mb_per_node))
            folders.append(folder)
        print(f"input: {args.nodes} node folder(s) of {sizes[0] / 1e6:.0f} MB of text logs each (from {corpus}); "
              f"load avg {os.getloadavg()[0]:.1f}")
        store_items, part_items, node_cpu = [], [], []
        for i, folder in enumerate(folders):
            items, cpu = node_items(folder, i, None)
            store_items.append(items)
            node_cpu.append(cpu)
            part_items.append(node_items(folder, i, str(work / "spool"))[0])
            node_items(folder, i, str(work / f"parts{i}"), views_only=True)
        print(f"node side (not the driver's): {sum(node_cpu) / len(node_cpu):.1f} CPU s per node "
              f"({sum(sizes) / 1e9 / sum(node_cpu) * 1e3:.0f} MB/s of one core)")
        print("| nodes | input MB | transport | driver CPU s | of which unpickling | wall s | CPU s per GB | rows | load avg |")
        print("|---|---|---|---|---|---|---|---|---|")
        for n in range(1, args.nodes + 1):
            gb = sum(sizes[:n]) / 1e9
            for label, items, dest in (("object store", store_items, None), ("--parts folder", part_items, str(work / "spool"))):
                db = str(work / f"{n}-{label[:3]}.duckdb")
                cpu, wall, rows, unpickle = driver_load(db, items[:n], dest)
                print(f"| {n} | {gb * 1e3:.0f} | {label} | {cpu:.2f} | {unpickle:.2f} | {wall:.2f} | {cpu / gb:.1f} | {rows:,} | "
                      f"{os.getloadavg()[0]:.1f} |")
                os.unlink(db)
        print()
        print("| nodes | --views-only: make the views, CPU s | query over views s | same query, loaded tables s | load avg |")
        print("|---|---|---|---|---|")
        query = "SELECT level, count(*) FROM lines GROUP BY level"
        for n in range(1, args.nodes + 1):
            dest = work / f"views{n}"
            shutil.rmtree(dest, ignore_errors=True)
            for i in range(n):
                shutil.copytree(work / f"parts{i}", dest, dirs_exist_ok=True)
            db = str(work / f"views{n}.duckdb")
            t0 = time.process_time()
            with duckdb.connect(db) as con:
                D.make_views(con, str(dest))
            make_cpu = time.process_time() - t0
            with duckdb.connect(db, read_only=True) as con:
                t0 = time.perf_counter()
                con.execute(query).fetchall()
                q_views = time.perf_counter() - t0
            loaded = str(work / f"loaded{n}.duckdb")
            driver_load(loaded, store_items[:n], None)
            with duckdb.connect(loaded, read_only=True) as con:
                t0 = time.perf_counter()
                con.execute(query).fetchall()
                q_loaded = time.perf_counter() - t0
            print(f"| {n} | {make_cpu:.2f} | {q_views:.2f} | {q_loaded:.2f} | {os.getloadavg()[0]:.1f} |")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
