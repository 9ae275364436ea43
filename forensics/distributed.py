"""Ingest on a Ray cluster, where the logs are (``forensics ingest --engine ray``).

A 64-GPU run leaves its logs on the local disks of its nodes. This engine runs one parse
task per alive node, pinned to it (``NodeAffinitySchedulingStrategy(node_id, soft=False)``),
with the local engine's own code: the node walks its paths, plans each file against what
the database already holds of that node (sent to it by the driver), parses its jobs
(:func:`forensics.pipeline.parse_job`, in a process pool of the node's CPUs) and hands
back each job's rows as Arrow tables, through the Ray object store, or as Parquet parts
written to a shared destination (``--parts``: a folder or a ``pyarrow.fs`` URL such as
``s3://bucket/prefix``), hive-partitioned as ``table=<t>/ray_node=<node>/...``. The
driver is the single writer: it loads each job as the local engine does
(:func:`forensics.pipeline.load_job`), or, ``views_only``, leaves the parts where they are
and makes the database a set of views over them.

Logs that every node can read (a URL, or a folder on a shared filesystem, ``--shared``)
are split the other way: the driver lists the files and Ray tasks over slices of that
list parse them on whatever CPUs the cluster has.

Ray is imported only in here, inside the functions that need it: the package imports
without it, and ``--engine ray`` without Ray installed says how to install it.

A node is named (``files.node``, the ``ray_node`` partition) by its label
``forensics-node`` when it has one, else by its host name when no other alive node has
the same, else by its address, else by its Ray node id. A file is the same file again
when it has the same node, root and path: re-running adds nothing, a grown log is read
from where it ended (with ``views_only``: read again whole, the older parts hidden).
"""
from __future__ import annotations

import glob
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator

import pyarrow as pa

from . import pipeline
from .store import FILES, PARTS_KEY as VIEWS_KEY, PROBLEMS, KnownFile, Store, all_tables, attach_parts

RAY_MISSING = "the Ray engine needs Ray, which is not installed: pip install 'forensics[ray]'"
NODE_LABEL = "forensics-node"  # a node label that names the node
NODE_PLACEHOLDER = "{node}"  # in a PATH: replaced, on each node, by that node's name
ID_BLOCK = 1 << 16  # file ids one node may give new files in one ingest (files.file_id is 32 bits)
QUEUE_AHEAD = 4  # parsed jobs a node may have ready before the driver has taken them
SHARED_SLICE_BYTES = 64 << 20  # input bytes per task when a shared file list is split across CPUs


class EngineError(RuntimeError):
    """A problem the user can fix (Ray missing, no cluster, a destination that cannot be
    written); the message says what to do."""


def _ray():
    try:
        import ray
    except ImportError:
        raise EngineError(RAY_MISSING) from None
    return ray


def connect(address: str | None):
    """Ray, connected to the cluster at ``address`` (None: the one this process is
    connected to already, else ``RAY_ADDRESS``, else the one started on this machine)."""
    ray = _ray()
    if ray.is_initialized():
        return ray
    try:
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False,
                 logging_level="ERROR", configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise EngineError(f"cannot connect to a Ray cluster at {address or 'auto'}: {exc}; "
                          "start one (`ray start --head`) or give --address HOST:PORT") from None
    return ray


# -- nodes ----------------------------------------------------------------------------

@dataclass
class Node:
    node_id: str
    name: str
    temp_root: str | None  # the node's Ray temporary folder (where its session_* folders are)
    cpus: int


def alive_nodes(ray) -> list[Node]:
    """The cluster's alive nodes, each with its name (see the module's docstring)."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    hosts = [n.get("NodeManagerHostname") for n in alive]
    addresses = [n.get("NodeManagerAddress") for n in alive]
    nodes = []
    for n in alive:
        label = (n.get("Labels") or {}).get(NODE_LABEL)
        host, address = n.get("NodeManagerHostname"), n.get("NodeManagerAddress")
        if label:
            name = label
        elif host and hosts.count(host) == 1:
            name = host
        elif address and addresses.count(address) == 1:
            name = address
        else:
            name = n["NodeID"]
        socket = n.get("ObjectStoreSocketName") or ""  # <temp>/session_<x>/sockets/plasma_store
        temp_root = os.path.dirname(os.path.dirname(os.path.dirname(socket))) if socket.startswith("/") else None
        nodes.append(Node(n["NodeID"], name, temp_root, int((n.get("Resources") or {}).get("CPU", 1)) or 1))
    return sorted(nodes, key=lambda n: n.name)


def session_log_dirs(temp_root: str) -> list[str]:
    """Every Ray session's log folder under a node's Ray temporary folder (the run that
    failed is often not the latest session); ``session_latest`` is a link to one of them."""
    return sorted(p for p in glob.glob(os.path.join(temp_root, "session_*", "logs"))
                  if os.path.isdir(p) and not os.path.islink(os.path.dirname(p)))


# -- parts: where a node's rows go ----------------------------------------------------

def _filesystem(dest: str):
    """(pyarrow filesystem, base path) of a destination folder or URL."""
    import pyarrow.fs as pafs

    if "://" in dest and not dest.startswith("file://"):
        try:
            return pafs.FileSystem.from_uri(dest)
        except (pa.ArrowInvalid, OSError) as exc:
            raise EngineError(f"--parts {dest}: {exc}") from None
    path = dest[len("file://"):] if dest.startswith("file://") else dest
    return pafs.LocalFileSystem(), os.path.abspath(path)


def part_dir(table: str, node: str, ingest: str) -> str:
    """A part's folder below the destination: hive partitions by table, node and ingest."""
    return f"table={table}/ray_node={_safe(node)}/ingest={ingest}"


def _safe(value: str) -> str:
    """A node name as a path component (a hive value may not hold '/' or '=')."""
    return "".join(c if c.isalnum() or c in "-_.:" else "_" for c in value)


class PartWriter:
    """Writes a node's Arrow tables as Parquet parts under the destination."""

    def __init__(self, dest: str, node: str, ingest: str, spool: bool):
        self.fs, base = _filesystem(dest)
        self.base = base.rstrip("/") + ("/_spool/" + ingest if spool else "")
        self.dest, self.node, self.ingest, self.seq = dest, node, ingest, 0
        self.local = type(self.fs).__name__ == "LocalFileSystem"

    def write(self, table: str, arrow: pa.Table) -> "Part":
        import pyarrow.parquet as pq

        folder = f"{self.base}/{part_dir(table, self.node, self.ingest)}"
        if self.local:
            self.fs.create_dir(folder, recursive=True)
        self.seq += 1
        path = f"{folder}/{uuid.uuid4().hex[:8]}-{self.seq:06d}.parquet"
        pq.write_table(arrow, path, filesystem=self.fs, compression="zstd")
        return Part(path, arrow.nbytes, self.dest)


@dataclass
class Part:
    """A Parquet part at the destination, read by the driver only when it loads it (a big
    file's rows are loaded in pieces, never all in memory): what pipeline.part_size and
    Store.insert_parts take besides spooled files and tables."""

    path: str
    nbytes: int
    dest: str  # the --parts destination it is under (its filesystem)

    def read(self) -> pa.Table:
        import pyarrow.parquet as pq

        fs, _ = _filesystem(self.dest)
        return pq.read_table(self.path, filesystem=fs)


# -- what a node does -----------------------------------------------------------------

@dataclass
class NodeJob:
    """What the driver sends a node's task."""

    name: str
    paths: list[str] | None  # None: the node's Ray session logs
    temp_root: str | None
    known: dict[str, dict[str, KnownFile]]  # root -> relative path -> what the database has
    offsets: dict[int, int]  # file_id -> byte offset of its last line (files without a last newline)
    first_id: int
    exclude: list[str]
    workers: int
    debug: bool
    dest: str | None = None  # parts destination; None: rows go back through the object store
    views_only: bool = False  # parts stay at dest; grown files are read whole
    ingest: str = ""
    files: list[tuple[str, str, str, int]] | None = None  # a shared slice: (root, where, rel, file_id)
    label_node: bool = True  # files.node = this node (False for a shared slice: the layout's hint)


@dataclass
class Plan:
    """A node's first answer: the files it is about to parse, and what it did not parse."""

    node: str
    files: list[tuple[str, str]]  # (root, rel) to parse
    skipped: list[dict]  # files rows of files not parsed (empty, binary, unreadable)
    summary: pipeline.IngestSummary
    roots: list[str] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)  # PATHs that do not exist on the node


@dataclass
class Chunk:
    """One parsed job: its results and parts (Arrow tables, or part paths at ``dest``);
    with ``views_only`` the parts are written already and ``rows`` counts them."""

    node: str
    job: pipeline.JobResult
    rows: dict[str, int] = field(default_factory=dict)
    summary: pipeline.IngestSummary | None = None


class _Offsets:
    """The one thing :func:`pipeline.plan` asks of a store, from what the driver sent."""

    def __init__(self, offsets: dict[int, int]):
        self.offsets = offsets

    def last_line_offset(self, file_id: int, line_no: int) -> int | None:
        return self.offsets.get(file_id)


def _node_roots(job: NodeJob, messages: list[str], absent: list[str]) -> list[str]:
    if job.paths is None:
        temp_root = job.temp_root
        try:
            import ray

            node = ray._private.worker.global_worker.node  # this node's own session folder
            temp_root = os.path.dirname(node.get_session_dir_path()) if node is not None else temp_root
        except (ImportError, AttributeError):  # not in a Ray worker (tests call it directly)
            pass
        if not temp_root:
            messages.append(f"node {job.name}: no Ray temporary folder known; give PATHs")
            return []
        return session_log_dirs(temp_root)
    roots = []
    for given in job.paths:
        path = given.replace(NODE_PLACEHOLDER, job.name)
        if os.path.exists(path):
            roots.append(os.path.abspath(path))
        else:
            absent.append(path)
    return roots


def _plan_node(job: NodeJob, tmp: str) -> tuple[Plan, list[pipeline.FileTask]]:
    summary = pipeline.IngestSummary()
    absent: list[str] = []
    tasks: list[pipeline.FileTask] = []
    skipped: list[dict] = []
    store_like = _Offsets(job.offsets)
    ids = iter(range(job.first_id, job.first_id + ID_BLOCK))
    over: list[str] = []

    def next_id() -> int:
        value = next(ids, None)
        if value is None:
            raise _OutOfIds
        return value

    if job.files is not None:  # a slice of a shared file list: the driver gave the ids
        roots = sorted({root for root, *_ in job.files})
        for root, where, rel, file_id in job.files:
            known = job.known.get(root, {})
            pipeline.plan_files(store_like, root, iter([(where, rel)]), known, lambda f=file_id: f, summary,
                                job.exclude, tasks, skipped)
    else:
        roots = _node_roots(job, summary.messages, absent)
        for root in roots:
            walk_root = root
            if os.path.isfile(root) and pipeline._is_bundle(root):
                walk_root = tempfile.mkdtemp(prefix="bundle-", dir=tmp)
                try:
                    pipeline.extract_bundle(root, pipeline.Path(walk_root), summary.messages)
                except (OSError, EOFError, ValueError) as exc:
                    summary.messages.append(f"{root}: cannot open bundle ({exc.__class__.__name__}: {exc})")
            known = job.known.get(root, {})
            for item in pipeline.walk(walk_root, summary.messages, {os.path.abspath(tmp)}):
                try:
                    pipeline.plan_files(store_like, root, iter([item]), known, next_id, summary, job.exclude, tasks, skipped)
                except _OutOfIds:
                    over.append(item[1])
    if over:
        summary.messages.append(f"node {job.name}: {len(over)} file(s) not read this time (more than {ID_BLOCK:,} new "
                                f"files on one node in one ingest), e.g. {over[0]}; run again to read them")
    for task in tasks:
        if job.views_only and task.start_offset:  # parts are never rewritten: a grown file is read whole
            task.start_line, task.start_offset, task.replace_from_line = 1, 0, None
        if job.label_node:
            task.detected.node = job.name
    for row in skipped:
        if job.label_node:
            row["node"] = job.name
    plan = Plan(job.name, [(t.root, t.rel) for t in tasks], skipped, summary, roots, absent)
    return plan, tasks


class _OutOfIds(Exception):
    pass


def _parsed(tasks: list[pipeline.FileTask], spool: str, workers: int, debug: bool) -> Iterator[pipeline.JobResult]:
    """Each job's result as it is parsed: in this process, or in a pool of ``workers``
    processes (the local engine's) run from a thread, the results handed over in order
    of completion."""
    jobs = pipeline.make_jobs(tasks)
    if workers <= 1 or len(jobs) <= 1:
        for j in jobs:
            yield pipeline.parse_job(j, spool, debug)
        return
    results: queue.Queue = queue.Queue(maxsize=workers * 2)
    done = object()

    def run() -> None:
        try:
            pipeline._run_jobs(jobs, spool, workers, debug, results.put)
            results.put(done)
        except BaseException as exc:  # handed to the consumer, which raises it
            results.put(exc)

    threading.Thread(target=run, name="forensics-node-parse", daemon=True).start()
    while True:
        item = results.get()
        if item is done:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


def _read_ipc(path: str) -> pa.Table:
    import pyarrow.ipc as ipc

    with pa.memory_map(path) as source:
        table = ipc.open_file(source).read_all()
    return table.combine_chunks() if table.num_rows else table


def node_ingest(job: NodeJob) -> Iterator[Plan | Chunk]:
    """What runs on a node (a Ray generator task): its :class:`Plan` first, then one
    :class:`Chunk` per parsed job. Needs no database."""
    tmp = tempfile.mkdtemp(prefix=f"{pipeline.TMP_PREFIX}{os.getpid()}-")
    try:
        plan, tasks = _plan_node(job, tmp)
        writer = PartWriter(job.dest, job.name, job.ingest, spool=not job.views_only) if job.dest else None
        if job.views_only and plan.skipped:
            writer.write(FILES.name, pa.Table.from_pylist(plan.skipped, schema=FILES.arrow_schema))
            plan.summary.count_rows(FILES.name, sum(1 for r in plan.skipped))
        yield plan
        spool = tempfile.mkdtemp(prefix="spool-", dir=tmp)
        for result in _parsed(tasks, spool, job.workers, job.debug):
            parts: dict[str, list] = {}
            for name, paths in result.parts.items():
                for p in paths:
                    arrow = _read_ipc(p)
                    os.unlink(p)
                    parts.setdefault(name, []).append(writer.write(name, arrow) if writer and not job.views_only else arrow)
            result.parts = parts
            if not job.views_only:
                yield Chunk(job.name, result)
                continue
            yield _write_views_chunk(job, writer, result)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_views_chunk(job: NodeJob, writer: PartWriter, result: pipeline.JobResult) -> Chunk:
    """Write a parsed job's rows, then its problems and ``files`` rows, as parts (a node
    that dies between leaves rows no ``files`` row of this ingest names: the views skip
    them)."""
    summary = pipeline.IngestSummary()
    rows: dict[str, int] = {}
    file_rows, problem_rows = [], []
    for res in result.results:
        row, probs = pipeline.file_row(res, summary, job.debug)
        if res.error:
            res.parts = {}
        file_rows.append(row)
        problem_rows.extend(probs)
    failed = {res.task.file_id for res in result.results if res.error}
    for name, tables in result.parts.items():
        for arrow in tables:
            if failed:
                import pyarrow.compute as pc

                arrow = arrow.filter(pc.invert(pc.is_in(arrow["file_id"], pa.array(sorted(failed), pa.int32()))))
            if arrow.num_rows:
                writer.write(name, arrow)
                rows[name] = rows.get(name, 0) + arrow.num_rows
    if problem_rows:
        writer.write(PROBLEMS.name, pa.Table.from_pylist(problem_rows, schema=PROBLEMS.arrow_schema))
        rows[PROBLEMS.name] = len(problem_rows)
    writer.write(FILES.name, pa.Table.from_pylist(file_rows, schema=FILES.arrow_schema))
    rows[FILES.name] = sum(1 for res in result.results if res.task.is_new)
    for k, v in rows.items():
        summary.count_rows(k, v)
    result.parts = {}
    return Chunk(job.name, result, rows, summary)


# -- the driver -----------------------------------------------------------------------

@dataclass
class _NodeState:
    name: str
    planned: list[tuple[str, str]] | None = None
    loaded: set = field(default_factory=set)
    absent: list[str] = field(default_factory=list)
    error: str | None = None


def _known_by_node(store: Store) -> dict[str, dict[str, dict[str, KnownFile]]]:
    """The files already ingested, by node, root and path relative to the root (without
    the PATH's prefix a database of several PATHs stores, :meth:`Store.path_prefix`)."""
    rows = store.con.execute(
        "SELECT node, root, path, file_id, bytes, sha256, lines, ends_with_newline, kind, format FROM files").fetchall()
    cuts: dict[str, int] = {}
    out: dict[str, dict[str, dict[str, KnownFile]]] = {}
    for node, root, path, *rest in rows:
        if root not in cuts:
            prefix = store.path_prefix(root) or ""
            cuts[root] = len(prefix) + 1 if prefix else 0
        out.setdefault(node or "", {}).setdefault(root, {})[path[cuts[root]:]] = KnownFile(*rest)
    return out


def _record_runs(store: Store) -> None:
    """The runs of what was loaded, as the local engine records them: one per PATH (root)
    and the runs inside it; with several PATHs every stored path starts with its PATH's name."""
    roots = [r for (r,) in store.con.execute("SELECT DISTINCT root FROM files ORDER BY 1").fetchall()]
    with store.transaction():
        held = store.path_runs()
        for root in roots:
            if root not in held:
                store.add_path_run(root)
        if len(store.path_runs()) > 1:
            store.ensure_prefixes()
            # rows the nodes wrote now for a PATH that had its prefix already (they plan
            # without the database, so without it)
            for root, (_, _, prefix) in store.path_runs().items():
                if prefix:
                    store.con.execute("UPDATE files SET path = ? || '/' || path WHERE root = ? AND NOT starts_with(path, ?)",
                                      [prefix, root, prefix + "/"])
        for root in roots:
            store.assign_runs(root)


def _last_line_offsets(store: Store) -> dict[int, int]:
    """Byte offset of the last line of each text file that did not end with a newline
    (a grown one is read again from there)."""
    return dict(store.con.execute(
        "SELECT l.file_id, l.byte_offset FROM lines l JOIN files f ON f.file_id = l.file_id AND l.line_no = f.lines "
        "WHERE NOT f.ends_with_newline AND f.kind = 'text'").fetchall())


def _run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


def ingest(paths: list[str] | None, db: str, address: str | None = None, parts: str | None = None,
           views_only: bool = False, shared: bool = False, workers: int | None = None,
           progress: Callable[[int, int, str], None] | None = None, debug: bool = False,
           exclude: list[str] | None = None) -> pipeline.IngestSummary:
    """Ingest on the Ray cluster at ``address`` into ``db`` (see the module's docstring).
    ``paths``: None reads every node's Ray session logs; folders or files, read on every
    node where they exist (``{node}`` in a path stands for the node's name); with
    ``shared`` (implied by a URL), one shared file list split across the cluster's CPUs.
    ``parts``: where the parts go (None: the object store); ``views_only``: leave them
    there and make ``db`` views over them."""
    if views_only and not parts:
        raise EngineError("--views-only needs --parts DIR|URL (the views read the parts where they are)")
    urls = [p for p in (paths or []) if "://" in p]
    shared = shared or bool(urls)
    if shared and not paths:
        raise EngineError("--shared needs PATHs (a folder every node sees, or a URL)")
    ray = connect(address)
    t0 = time.perf_counter()
    nodes = alive_nodes(ray)
    if not nodes:
        raise EngineError("the Ray cluster has no alive node")
    ingest_id = _run_id()
    if views_only:
        return _views_ingest(ray, nodes, paths, db, parts, shared, workers, progress, debug, exclude, ingest_id, t0)
    summary = pipeline.IngestSummary(db=str(db))
    store = pipeline.open_writer(db, defer_views=False)
    batch = pipeline._Batch(store)  # jobs of all nodes grouped into few transactions, as the local engine does
    try:
        for rel in store.drop_unfinished_files():
            summary.messages.append(f"{rel}: its load was interrupted last time; it is read again")
        known = _known_by_node(store)
        offsets = _last_line_offsets(store)
        first = store.next_file_id()
        jobs = (_shared_jobs(paths, known, offsets, first, exclude, workers, debug, parts, ingest_id, summary)
                if shared else
                _node_jobs(nodes, paths, known, offsets, first, exclude, workers, debug, parts, ingest_id))
        try:
            states = run_jobs(ray, jobs, nodes, shared, lambda item, done, total: _load_item(
                store, batch, item, summary, debug, progress, done, total))
            batch.close()
        except BaseException:
            batch.abort()
            raise
        report_nodes(states, paths, summary, shared)
        _record_runs(store)
        store.fix_yearless_timestamps()
        summary.rows_total = store.table_counts()
    finally:
        store.close()
        if parts:
            _remove_spool(parts, ingest_id)
    summary.seconds = time.perf_counter() - t0
    return summary


def _node_jobs(nodes, paths, known, offsets, first, exclude, workers, debug, dest, ingest_id) -> list[tuple[Node, NodeJob]]:
    return [(n, NodeJob(n.name, list(paths) if paths else None, n.temp_root, known.get(n.name, {}), offsets,
                        first + i * ID_BLOCK, list(exclude or []), workers or n.cpus, debug, dest, False, ingest_id))
            for i, n in enumerate(nodes)]


def list_shared(paths: list[str], messages: list[str]) -> list[tuple[str, str, str, int]]:
    """(root, where to read it, relative path, size) of every file under the shared
    ``paths`` (folders or URLs)."""
    import pyarrow.fs as pafs

    found = []
    for given in paths:
        if "://" in given:
            fs, base = _filesystem(given)
            base = base.rstrip("/")
            info = fs.get_file_info(base)
            if info.type == pafs.FileType.File:
                found.append((given, given, info.base_name, info.size))
                continue
            if info.type == pafs.FileType.NotFound:
                messages.append(f"{given}: no such file or folder")
                continue
            for item in sorted(fs.get_file_info(pafs.FileSelector(base, recursive=True)), key=lambda i: i.path):
                if item.type == pafs.FileType.File:
                    rel = item.path[len(base) + 1:]
                    found.append((given.rstrip("/"), given.rstrip("/") + "/" + rel, rel, item.size))
            continue
        if not os.path.exists(given):
            messages.append(f"{pipeline.storable(given)}: no such file or folder")
            continue
        root = pipeline.storable(os.path.abspath(given))
        for abs_path, rel in pipeline.walk(given, messages, set()):
            try:
                size = os.path.getsize(abs_path)
            except OSError:
                size = 0
            found.append((root, abs_path, rel, size))
    return found


def _shared_jobs(paths, known, offsets, first, exclude, workers, debug, dest, ingest_id, summary) -> list[tuple[None, NodeJob]]:
    """Slices of the shared file list, about :data:`SHARED_SLICE_BYTES` of input each,
    ids given here (known files keep theirs)."""
    everyone: dict[str, dict[str, KnownFile]] = {}
    for by_root in known.values():
        for root, files in by_root.items():
            everyone.setdefault(root, {}).update(files)
    next_id = first
    slices: list[list[tuple[str, str, str, int]]] = [[]]
    held = 0
    for root, where, rel, size in list_shared(paths, summary.messages):
        k = everyone.get(root, {}).get(rel)
        if k is not None:
            file_id = k.file_id
        else:
            file_id, next_id = next_id, next_id + 1
        if held and held + size > SHARED_SLICE_BYTES:
            slices.append([])
            held = 0
        slices[-1].append((root, where, rel, file_id))
        held += size
    jobs = []
    for i, files in enumerate(s for s in slices if s):
        roots = {r for r, *_ in files}
        jobs.append((None, NodeJob(f"slice-{i}", None, None, {r: everyone.get(r, {}) for r in roots}, offsets, 0,
                                   list(exclude or []), 1, debug, dest, False, ingest_id, files=files, label_node=False)))
    return jobs


def shared_ingest(job: NodeJob) -> Iterator[Plan | Chunk]:
    """A slice of a shared file list, on whatever node it runs: files given as URLs are
    copied to the node's temporary folder first, then parsed as :func:`node_ingest` does."""
    import ray

    job.name = _current_node_name(ray, job.name)
    tmp = tempfile.mkdtemp(prefix=f"{pipeline.TMP_PREFIX}{os.getpid()}-copies-")
    try:
        local = []
        for root, where, rel, file_id in job.files:
            if "://" in where:
                import pyarrow.fs as pafs

                fs, path = pafs.FileSystem.from_uri(where)
                target = os.path.join(tmp, f"{file_id}-{os.path.basename(rel)}")
                with fs.open_input_stream(path) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                where = target
            local.append((root, where, rel, file_id))
        job.files = local
        yield from node_ingest(job)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _current_node_name(ray, default: str) -> str:
    try:
        labels = ray.get_runtime_context().get_node_labels() or {}
        return labels.get(NODE_LABEL) or ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside a worker (a direct call): the slice's own name
        return default


def run_jobs(ray, jobs: list[tuple[Node | None, NodeJob]], nodes: list[Node], shared: bool,
             handle: Callable[[Plan | Chunk, int, int], None]) -> dict[str, _NodeState]:
    """Run each job as a Ray generator task (pinned to its node, or anywhere for a shared
    slice) and hand every item it yields to ``handle`` in this thread, the single writer.
    A task that fails (its node died) is noted in its state; the others go on."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # a node's task takes no CPU of its own (a post-mortem may run while the cluster is busy);
    # it parses with the node's CPUs; a shared slice takes one CPU
    common = {"max_retries": 0, "_generator_backpressure_num_objects": QUEUE_AHEAD}
    remote_node, remote_shared = ray.remote(node_ingest), ray.remote(shared_ingest)
    # The followers hand over references, not rows: the rows stay in the nodes' object
    # stores until this thread loads them (ray.get), one item at a time, and a follower
    # blocks while the queue is full, so it stops consuming its generator and the node
    # stops after QUEUE_AHEAD items: the driver's memory does not grow with the cluster.
    items: queue.Queue = queue.Queue(maxsize=len(jobs) + 1)
    states: dict[str, _NodeState] = {}
    threads = []
    finished = object()

    def follow(state: _NodeState, gen) -> None:
        try:
            for ref in gen:
                items.put((state, ref))
        except Exception as exc:  # noqa: BLE001 - the node died, its worker crashed: said by name
            items.put((state, exc))
        items.put((state, finished))

    gens = []
    for node, job in jobs:
        state = states.setdefault(job.name, _NodeState(job.name))
        if node is not None:
            gen = remote_node.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
                                      **common).remote(job)
        else:
            gen = remote_shared.options(num_cpus=1, **common).remote(job)
        gens.append(gen)
        t = threading.Thread(target=follow, args=(state, gen), name=f"forensics-follow-{job.name}", daemon=True)
        t.start()
        threads.append(t)
    running, done, total = len(threads), 0, 0
    try:
        while running:
            state, item = items.get()
            if item is finished:
                running -= 1
                continue
            if not isinstance(item, BaseException):
                try:
                    item = ray.get(item)
                except Exception as exc:  # noqa: BLE001 - lost with its node: said by name below
                    item = exc
            if isinstance(item, BaseException):
                state.error = f"{item.__class__.__name__}: {str(item).splitlines()[0] if str(item) else ''}"
                continue
            if isinstance(item, Plan):
                state.planned = list(state.planned or []) + item.files
                state.absent = item.absent
                total += len(item.files)
            else:
                state.loaded.update((r.task.root, r.task.rel) for r in item.job.results)
                done += len(item.job.results)
            handle(item, done, total)
    except BaseException:  # interrupted, or the database failed: the nodes stop parsing
        for gen in gens:
            try:
                ray.cancel(gen, force=True)
            except Exception:  # noqa: BLE001 - a task that ended meanwhile cannot be cancelled
                pass
        raise
    for t in threads:
        t.join()
    return states


def report_nodes(states: dict[str, _NodeState], paths: list[str] | None, summary: pipeline.IngestSummary,
                 shared: bool) -> None:
    """Say which files a failed task did not load, by name, and which PATHs no node had."""
    for state in states.values():
        if state.error is None:
            continue
        who = "a task over the shared file list" if shared else f"node {state.name}"
        if state.planned is None:
            summary.messages.append(f"{who} failed before it listed its files ({state.error}); none of its files was "
                                    "loaded: run the same command again once it is back")
            continue
        missing = [rel for root, rel in state.planned if (root, rel) not in state.loaded]
        if missing:
            shown = ", ".join(missing[:20]) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
            summary.messages.append(f"{who} failed ({state.error}): {len(missing)} of its file(s) not loaded: {shown}; "
                                    "everything else is loaded: run the same command again to load them")
    if paths and not shared:
        everywhere_absent = set(paths)
        for state in states.values():
            if state.planned is not None:
                everywhere_absent &= {p for p in paths if p.replace(NODE_PLACEHOLDER, state.name) in state.absent}
        for p in sorted(everywhere_absent):
            summary.messages.append(f"{pipeline.storable(p)}: no such file or folder on any node")


def _load_item(store: Store, batch: pipeline._Batch, item: Plan | Chunk, summary: pipeline.IngestSummary,
               debug: bool, progress, done: int, total: int) -> None:
    """Load what a node yielded in ``batch``'s open transaction (the caller closes it):
    a plan's rows of files not parsed, or a parsed job (see :func:`pipeline.load_job`)."""
    if isinstance(item, Plan):
        summary.add(item.summary)
        if item.skipped:
            batch.ensure()
            added = 0
            for row in item.skipped:
                if store.con.execute("SELECT 1 FROM files WHERE file_id = ?", [row["file_id"]]).fetchone():
                    store.delete_file_rows(row["file_id"], None)  # known, now empty or unreadable: its rows go
                else:
                    added += 1
                store.record_skipped(row)
            summary.count_rows(FILES.name, added)
            batch.add(len(item.skipped), len(item.skipped))
        return
    job = item.job
    pipeline.load_job(store, batch, job, summary, debug)
    if progress and job.results:
        progress(done, total, job.results[-1].task.rel)


def _remove_spool(dest: str, ingest_id: str) -> None:
    """Remove this ingest's spooled parts at ``dest`` (loaded or not: a re-run parses again)."""
    try:
        fs, base = _filesystem(dest)
        fs.delete_dir(f"{base.rstrip('/')}/_spool/{ingest_id}")
    except (OSError, EngineError):
        pass  # nothing was written there (every node was skipped) or it is gone already


# -- the database as views over parts (``views_only``) ----------------------------------



def _known_from_parts(dest: str) -> tuple[dict[str, dict[str, dict[str, KnownFile]]], int]:
    """What the parts at ``dest`` hold already (the newest ``files`` row of each file), by
    node, root and path, and the highest file id given."""
    import pyarrow.dataset as ds

    fs, base = _filesystem(dest)
    try:
        table = ds.dataset(f"{base.rstrip('/')}/table={FILES.name}", filesystem=fs, format="parquet",
                           partitioning="hive").to_table()
    except (FileNotFoundError, pa.ArrowInvalid):  # none yet
        return {}, 0
    newest: dict[int, dict] = {}
    for row in table.to_pylist():
        seen = newest.get(row["file_id"])
        if seen is None or str(row["ingest"]) > str(seen["ingest"]):
            newest[row["file_id"]] = row
    out: dict[str, dict[str, dict[str, KnownFile]]] = {}
    for r in newest.values():
        out.setdefault(r["node"] or "", {}).setdefault(r["root"], {})[r["path"]] = KnownFile(
            r["file_id"], r["bytes"], r["sha256"], r["lines"], r["ends_with_newline"], r["kind"], r["format"])
    return out, max(newest, default=0)


def _views_ingest(ray, nodes, paths, db, dest, shared, workers, progress, debug, exclude, ingest_id, t0):
    import duckdb

    _check_views_db(db, dest)
    summary = pipeline.IngestSummary(db=str(db))
    known, top = _known_from_parts(dest)
    first = top + 1
    jobs = (_shared_jobs(paths, known, {}, first, exclude, workers, debug, dest, ingest_id, summary)
            if shared else _node_jobs(nodes, paths, known, {}, first, exclude, workers, debug, dest, ingest_id))
    for _, job in jobs:
        job.views_only = True

    def handle(item, done, total):
        summary.add(item.summary)
        if isinstance(item, Chunk) and progress and item.job.results:
            progress(done, total, item.job.results[-1].task.rel)

    states = run_jobs(ray, jobs, nodes, shared, handle)
    report_nodes(states, paths, summary, shared)
    con = duckdb.connect(str(db))
    try:
        make_views(con, dest)
        summary.rows_total = {t.name: int(con.execute(f'SELECT count(*) FROM "{t.name}"').fetchone()[0]) for t in all_tables()}
    finally:
        con.close()
    summary.seconds = time.perf_counter() - t0
    return summary


def _check_views_db(db: str, dest: str) -> None:
    """A views-only database is made anew or over the same parts; never over loaded rows."""
    import duckdb

    if not os.path.exists(db):
        return
    try:
        con = duckdb.connect(str(db), read_only=True)
    except duckdb.Error as exc:
        raise EngineError(f"cannot open database {db}: {exc}") from None
    try:
        kind = con.execute("SELECT table_type FROM information_schema.tables WHERE table_name = 'files'").fetchone()
        url = None
        if kind and kind[0] == "VIEW":
            url = con.execute("SELECT value FROM meta WHERE key = ?", [VIEWS_KEY]).fetchone()
    finally:
        con.close()
    if kind and kind[0] != "VIEW":
        raise EngineError(f"{db} holds loaded rows: give --views-only another --db (or ingest without --views-only)")
    if url and url[0] != dest:
        raise EngineError(f"{db} is made of the parts at {url[0]}, not {dest}: give the same --parts or another --db")


def _parts_glob(dest: str, table: str) -> str:
    if "://" in dest and not dest.startswith("file://"):
        base = dest.rstrip("/")
    else:
        base = _filesystem(dest)[1]
    return f"{base}/table={table}/*/*/*.parquet"


def _has_parts(dest: str, table: str) -> bool:
    import pyarrow.fs as pafs

    fs, base = _filesystem(dest)
    try:
        infos = fs.get_file_info(pafs.FileSelector(f"{base.rstrip('/')}/table={table}", recursive=True))
    except (FileNotFoundError, OSError):
        return False
    return any(i.type == pafs.FileType.File and i.path.endswith(".parquet") for i in infos)


def make_views(con, dest: str) -> None:
    """Make every table of the schema a view over its parts at ``dest`` (the newest
    ingest of each file only), then the analysis views over them."""
    from . import sql_modules
    from .store import SCHEMA_VERSION, _duck_type

    con.execute("CREATE TABLE IF NOT EXISTS meta (key VARCHAR, value VARCHAR)")
    con.execute("DELETE FROM meta")
    con.execute("INSERT INTO meta VALUES ('schema_version', ?), (?, ?)", [str(SCHEMA_VERSION), VIEWS_KEY, dest])
    attach_parts(con)
    read = "read_parquet('{}', hive_partitioning = true, hive_types_autocast = false)"
    bodies: dict[str, str] = {}
    if _has_parts(dest, FILES.name):
        con.execute(f"CREATE OR REPLACE VIEW _parts_files AS SELECT * FROM {read.format(_parts_glob(dest, FILES.name))} "
                    "QUALIFY row_number() OVER (PARTITION BY file_id ORDER BY ingest DESC) = 1")
    for table in all_tables():
        if table.name == "meta":
            continue
        empty = "SELECT " + ", ".join(f'CAST(NULL AS {_duck_type(c.type)}) AS "{c.name}"' for c in table.columns) + " LIMIT 0"
        cols = ", ".join(f'p."{c.name}"' for c in table.columns)
        if not _has_parts(dest, table.name) or not _has_parts(dest, FILES.name):
            body = empty
        elif table.name == FILES.name:
            body = f"SELECT {cols} FROM _parts_files p"
        else:
            body = (f"SELECT {cols} FROM {read.format(_parts_glob(dest, table.name))} p "
                    "SEMI JOIN _parts_files f ON p.file_id = f.file_id AND p.ingest = f.ingest")
        bodies[table.name] = body
        con.execute(f'CREATE OR REPLACE VIEW "{table.name}" AS {body}')
    if "files" in bodies and _has_parts(dest, FILES.name):
        _views_with_runs(con, bodies)
    _views_with_years(con, bodies)
    sql_modules.create(con)


# The runs of a views-only database and each file's run and stored path (with its PATH's
# prefix when there are several PATHs): tables of the database itself, since the parts
# cannot be changed; the ``files`` and ``runs`` views read them.
VIEW_RUNS = "_view_runs"
VIEW_FILE_RUNS = "_view_file_runs"


def _views_with_runs(con, bodies: dict[str, str]) -> None:
    """What :func:`_record_runs` does to loaded rows, for the views: the runs are found by
    the same code, in a scratch database that holds what it reads (the files, the pids
    of the driver logs, the runs found before, whose ids stay), and the answer is kept in
    :data:`VIEW_RUNS` and :data:`VIEW_FILE_RUNS`."""
    cur = con.cursor()  # a connection of its own: the caller's may hold a result not read to its end
    try:
        _record_view_runs(cur, bodies)
    finally:
        cur.close()


def _record_view_runs(con, bodies: dict[str, str]) -> None:
    from . import sql_modules
    from .runs import DRIVER_FORMATS
    from .store import RUNS, insert_sql

    def arrow(c, query: str) -> pa.Table:
        return c.sql(query).to_arrow_table()

    files_cols = ", ".join(f'"{c.name}"' for c in FILES.columns)
    with tempfile.TemporaryDirectory(prefix="forensics-runs-") as tmp:
        scratch = Store(os.path.join(tmp, "runs.duckdb"), defer_views=True)
        s = scratch.con.cursor()  # as above
        try:
            s.register("_files_in", arrow(con, f"SELECT {files_cols} FROM ({bodies['files']})"))
            s.execute(insert_sql(FILES, "_files_in")).fetchall()
            s.unregister("_files_in")
            if sql_modules.has_main_table(con, VIEW_RUNS):
                runs_cols = ", ".join(f'"{c.name}"' for c in RUNS.columns)
                s.register("_runs_in", arrow(con, f"SELECT {runs_cols} FROM main.{VIEW_RUNS}"))
                s.execute(insert_sql(RUNS, "_runs_in")).fetchall()
                s.unregister("_runs_in")
            formats = ", ".join(f"'{f}'" for f in sorted(DRIVER_FORMATS))
            s.register("_pids_in", arrow(con, f"""
                SELECT l.file_id, row_number() OVER () AS line_no, l.pid, '' AS text
                FROM (SELECT DISTINCT file_id, pid FROM ({bodies['lines']}) WHERE pid IS NOT NULL) l
                SEMI JOIN ({bodies['files']}) f ON f.file_id = l.file_id AND f.format IN ({formats})"""))
            s.execute("INSERT INTO lines (file_id, line_no, pid, text) SELECT file_id, line_no, pid, text FROM _pids_in").fetchall()
            s.unregister("_pids_in")
            _record_runs(scratch)
            runs = arrow(s, "SELECT * FROM runs ORDER BY run_id")
            file_runs = arrow(s, "SELECT file_id, path, run_id FROM files")
        finally:
            s.close()
            scratch.close()
    con.register("_runs_out", runs)
    con.register("_file_runs_out", file_runs)
    try:
        con.execute(f"CREATE OR REPLACE TABLE main.{VIEW_RUNS} AS SELECT * FROM _runs_out").fetchall()
        con.execute(f"CREATE OR REPLACE TABLE main.{VIEW_FILE_RUNS} AS SELECT * FROM _file_runs_out").fetchall()
    finally:
        con.unregister("_runs_out")
        con.unregister("_file_runs_out")
    bodies["runs"] = f"SELECT * FROM main.{VIEW_RUNS}"
    bodies["files"] = (f"SELECT p.* REPLACE (coalesce(r.path, p.path) AS path, r.run_id AS run_id) "
                       f"FROM ({bodies['files']}) p LEFT JOIN main.{VIEW_FILE_RUNS} r ON r.file_id = p.file_id")
    for name in ("runs", "files"):
        con.execute(f'CREATE OR REPLACE VIEW "{name}" AS {bodies[name]}').fetchall()


def _views_with_years(con, bodies: dict[str, str]) -> None:
    """What :meth:`Store.fix_yearless_timestamps` does to loaded rows, in the views: a stamp
    printed without a year takes the year most common among the run's full stamps."""
    from .parsers.lines.common import YEARLESS

    row = con.execute("SELECT year(ts) AS y FROM lines WHERE ts_quality = 'full' "
                      "GROUP BY y ORDER BY count(*) DESC LIMIT 1").fetchone()
    if row is None or int(row[0]) == YEARLESS:
        return
    shift = f"to_years({int(row[0]) - YEARLESS})"
    for name, body in bodies.items():
        cols = {c[0] for c in con.execute(f'DESCRIBE "{name}"').fetchall()}
        if "ts" not in cols:
            continue
        if name == "lines":
            yearless = f"year(ts) = {YEARLESS} AND ts_quality IN ('no_year', 'inherited')"
            fixed = (f"CASE WHEN {yearless} THEN ts + {shift} ELSE ts END AS ts, "
                     f"CASE WHEN {yearless} AND ts_quality = 'no_year' THEN 'year_inferred' ELSE ts_quality END AS ts_quality")
        else:  # rows derived from lines carry the line's ts
            fixed = f"CASE WHEN year(ts) = {YEARLESS} THEN ts + {shift} ELSE ts END AS ts"
        con.execute(f'CREATE OR REPLACE VIEW "{name}" AS SELECT * REPLACE ({fixed}) FROM ({body})')


# -- collect: every node's logs, pulled to this machine ---------------------------------

def collect(out: str, address: str | None = None) -> dict:
    """Pull every alive node's Ray session logs into ``out/node_<name>/<file>`` through
    Ray's state API (``list_logs``/``get_log``: the dashboard agents serve them), for a
    cluster about to be torn down. The folder name ``node_<name>`` is one the folder layout
    detection reads, so ``forensics ingest OUT`` gives each file its node."""
    ray = connect(address)
    try:
        from ray.util.state import get_log, list_logs
    except ImportError:
        raise EngineError("collecting logs needs Ray's state API: pip install 'forensics[ray]' (ray[default])") from None
    result: dict = {"out": out, "nodes": {}, "bytes": 0, "messages": []}
    for node in alive_nodes(ray):
        folder = os.path.join(out, f"node_{_safe(node.name)}")
        try:
            listing = list_logs(node_id=node.node_id)
        except Exception as exc:  # noqa: BLE001 - the state API's errors vary (no dashboard, node gone)
            result["messages"].append(f"node {node.name}: cannot list its logs ({exc.__class__.__name__}: {exc})")
            continue
        names = sorted({n for files in listing.values() for n in files if not n.endswith("/")})
        copied = 0
        for name in names:
            target = os.path.abspath(os.path.join(folder, name))
            if not target.startswith(os.path.abspath(folder) + os.sep):
                result["messages"].append(f"node {node.name}: {name!r} skipped (it would land outside {folder})")
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            try:
                with open(target, "wb") as fh:
                    for chunk in get_log(node_id=node.node_id, filename=name, encoding=None):
                        data = chunk if isinstance(chunk, bytes) else chunk.encode("utf-8", "surrogateescape")
                        fh.write(data)
                        result["bytes"] += len(data)
            except Exception as exc:  # noqa: BLE001 - a file rotated away or a node gone: said, the rest goes on
                result["messages"].append(f"node {node.name}: {name}: not copied ({exc.__class__.__name__}: {exc})")
                continue
            copied += 1
        result["nodes"][node.name] = copied
    return result
