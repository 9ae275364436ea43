"""Fatal events: exceptions, native crashes and fatal log records as structured rows.

A failure reaches a log in a handful of shapes, whoever printed it:

* a Python traceback (``Traceback (most recent call last):``, frames, the exception line),
  possibly chained (``The above exception was the direct cause ...`` / ``During handling
  of the above exception ...``), possibly only its tail (a paste that starts at a frame
  line, or at the exception line before a chain), with frames whose indentation was lost;
* a Ray wrapper (``RayTaskError(KeyError): ray::TaskRunner.run() (pid=..)``) followed by
  the remote traceback and the wrapped exception;
* a native crash: ``*** SIGSEGV received at time=...`` with ``PC: @ 0x...`` frames (Ray's
  handler, re-logged by ``logging.cc``), ``Fatal Python error: ...`` with a faulthandler
  stack (``File "...", line N in f``);
* a C++ exception (``terminate called after throwing an instance of 'X'`` / ``what():``,
  ``Unhandled exception: X. what(): ...``, a c10 ``Exception raised from ...`` stack) or a
  fatal log record (glog ``F``, Ray's ``C``, Python ``CRITICAL``) with its stack dump;
* an IDE debugger's report (``Exception has occurred: KeyError``) or Hydra's ``Error
  executing job with overrides`` before a traceback;
* a process exit: a non-zero exit code, ``Segmentation fault (core dumped)``, ``Killed``.

:func:`find_events` reads the lines of a chunk (after the line formats removed their
prefixes and headers, so ``(WorkerDict pid=1) ``, ``[rank3]: ``, ``ERROR 07-10 ... [core.py:459]``
are gone and each process's stream is followed apart by its pid/rank/actor) and returns,
for every line that belongs to an event, the event's first line (``lines.event_line``),
and one row per event for the ``fatal_events`` table: the exception types of the chain,
the wrapped type, the message, the frames with the package each belongs to, the Ray task
(actor class and method) the failure happened in, and the line that shows the failure.

Whether an event ended the run (a crash) or was logged and survived is not decided here:
the diagnosis does that with what it knows of the whole run.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import polars as pl
import pyarrow as pa

from .base import FILE_ID, Table, col
from .conventions import WRAP_MAX_LINES, WRAP_MIN_SHARE, WRAP_MIN_WIDTH

FRAME_TYPE = pa.struct([
    pa.field("part", pa.int32()),
    pa.field("file", pa.string()),
    pa.field("line", pa.int32()),
    pa.field("function", pa.string()),
    pa.field("package", pa.string()),
    pa.field("code", pa.string()),
    pa.field("at", pa.int64()),
    pa.field("code_at", pa.int64()),
])
CHAIN_TYPE = pa.struct([
    pa.field("type", pa.string()),
    pa.field("message", pa.string()),
    pa.field("line_no", pa.int64()),
    pa.field("relation", pa.string()),
])

FATAL_EVENTS = Table(
    "fatal_events",
    "One row per exception, native crash or fatal log record found in the text logs (a "
    "traceback with its chained causes is one event). Built by the text parser from the "
    "lines of each process's stream; whether the event ended the run is for the diagnosis "
    "to decide. Join `lines` on (file_id, event_line = line_no) for the event's text.",
    (
        FILE_ID,
        col("line_no", pa.int64(), "First line of the event (its `lines.event_line`)."),
        col("last_line", pa.int64(), "Last line of the event."),
        col("exc_line", pa.int64(), "The line that shows the failure: the root exception's line (the first of a chain; under a Ray wrapper, the remote exception's line when it is there, else the wrapper's), the first signal line of a native crash, the fatal record; evidence cites it."),
        col("kind", pa.string(), "`python` (traceback or exception line), `native` (fatal signal, faulthandler stack), `cpp` (C++ exception, terminate), `fatal_log` (a FATAL/CRITICAL record), `exit` (a non-zero exit, a kill)."),
        col("exc_type", pa.string(), "Type of the root exception as printed (`omegaconf.errors.ConfigAttributeError`, `torch.OutOfMemoryError`, `c10::DistBackendError`); for a Ray wrapper whose remote exception line is missing, the wrapped type; the signal (`SIGSEGV`) of a native crash."),
        col("exc_name", pa.string(), "Last component of `exc_type` (`ConfigAttributeError`)."),
        col("message", pa.string(), "Message of the root exception (with its indented continuation lines), or the fatal text."),
        col("outer_type", pa.string(), "Type of the last exception of the chain (what the process finally raised), when it differs from the root's."),
        col("outer_message", pa.string(), "Message of that last exception."),
        col("wrapper", pa.string(), "A wrapper the failure was reported through: `RayTaskError`, `ActorDiedError`, `RayActorError`, `ChildFailedError`, `hydra`, `debugger`, `EngineDeadError`, ...; or how Python reported an exception it did not raise further: `ignored` (`Exception ignored in`, at garbage collection or exit), `atexit`, `thread` (a thread other than the main one), `asyncio` (null: none)."),
        col("wrapped_type", pa.string(), "The exception type a Ray wrapper names (`RayTaskError(KeyError)` -> `KeyError`)."),
        col("types", pa.list_(pa.string()), "Every exception type of the event in print order (root first), wrappers and wrapped types included."),
        col("chain", pa.list_(CHAIN_TYPE), "The exceptions of the event in print order: type, message, line, and how each relates to the one before (`cause`, `context`, `remote`, null for the first)."),
        col("frames", pa.list_(FRAME_TYPE), "Python frames, outermost first within each part (faulthandler stacks are reversed to that order): part index, file, line, function, package (`vllm`, `sglang`, `verl`, `torch`, `ray`, `deepspeed`, `megatron`, `transformers`, `trl`, `openrlhf`, ..., `python` for the standard library, `user` for anything else), the source line shown, and where in the log the frame line (`at`) and its source line (`code_at`) are."),
        col("package", pa.string(), "Package of the innermost frame of the root exception (where it was raised)."),
        col("user_frame", pa.string(), "The innermost frame that is not library code (`my_reward.py:17 in compute_score`), when there is one."),
        col("signal", pa.string(), "Fatal signal of a native crash or an exit (`SIGSEGV`, `SIGKILL`)."),
        col("exit_code", pa.int32(), "Exit code of an `exit` event."),
        col("ray_actor", pa.string(), "Ray actor class of the failing task (`TaskRunner`, `WorkerDict`, `LLMActor`), from a `ray::Class.method()` line; with nested wrappers, the innermost task's."),
        col("ray_method", pa.string(), "Ray task / actor method that failed (`run`, `generate_sequences`, `backload_to_gpu`)."),
        col("ray_pid", pa.int64(), "pid of the process the Ray task ran in (from `(pid=N, ...)`)."),
        col("ray_ip", pa.string(), "IP of that process's node."),
        col("pid", pa.int64(), "pid of the stream that printed the event (line prefix or file)."),
        col("rank", pa.int32(), "Rank of that stream, when known."),
        col("actor", pa.string(), "Actor / role of that stream."),
        col("node", pa.string(), "Node of that stream."),
        col("ts", pa.timestamp("us"), "Time of the event's first line (see `lines.ts`)."),
        col("lines", pa.int32(), "Number of lines the event spans."),
        col("cut_off", pa.bool_(), "The text stops before the exception line (a paste or a log cut short): `exc_type` is `unknown`, or the type a `raise X(\"...\")` source line in the innermost frame shows (then `message` is that string's start); `exc_line` is the innermost frame's source line."),
    ),
)

# ---- line shapes ------------------------------------------------------------------------

# torch.distributed.checkpoint's CheckpointException relays each failed rank's traceback
# under a head that names it: `Traceback (most recent call last): (RANK 2)`
_TB_HEAD = re.compile(r"Traceback \(most recent call last\):(?: \(RANK \d+\))?\s*$")
_CHAIN = re.compile(r"^\s*(?P<what>The above exception was the direct cause of the following exception|"
                    r"During handling of the above exception, another exception occurred):\s*$")
# Python: `File "x.py", line 3, in f`; faulthandler: `File "x.py", line 3 in f`; a paste may
# have lost the indentation
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)(?P<comma>,)? in (?P<func>\S.*?)\s*$')
_FRAME_NOFUNC = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)\s*$')
_TRUNCATED_FRAME = re.compile(r'^\s*File "[^"]*$')  # a frame line the paste cut off
_CARET = re.compile(r"^\s*[\^~]+\s*$")
# a frame's source line that raises: what a traceback cut off before its end was raising
_CANCELLED = re.compile(r"(?:^|\.)CancelledError$")
_RAISE = re.compile(r"""^raise (?P<type>(?:[A-Za-z_]\w*\.)*[A-Z]\w*)\((?:f?["'](?P<msg>[^"']*))?""")
_EXC_STRICT = re.compile(
    r"^(?P<type>(?:[A-Za-z_]\w*\.)*(?:[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failure|Fault)\w*|KeyError|StopIteration|Exception))"
    r"(?:\((?P<wrapped>[\w.]+)\))?(?::\s?(?P<msg>.*)|\s*)$")
_EXC_LOOSE = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)(?:\((?P<wrapped>[\w.]+)\))?(?::\s?(?P<msg>.*)|\s*)$")
# a named actor's task carries the actor's name first (`ray::lm_policy-0-2:DTensorPolicyWorker.__init__()`,
# `ray::RayTest:0:RayCOMMTester.__init__()`: the name given to `.options(name=...)`, then `:`)
_RAY_NAME = r"(?:[\w\-]+(?::[\w\-]+)*:)?"
_RAY_TASK = re.compile(r"ray::" + _RAY_NAME + r"(?:(?P<cls>[A-Za-z_][\w<>]*(?:\.[A-Za-z_][\w<>]*)*)\.)?(?P<method>[A-Za-z_]\w*)\(\)?\s*(?:\(pid=(?P<pid>\d+)(?:, ip=(?P<ip>[^,)\s]+))?)?")
_RAY_TASK_HEADER = re.compile(r"(?i)(?:exception|error|failed).*ray::" + _RAY_NAME + r"[\w.<>]+\(\)? \(pid=\d+")  # Ray's / a framework's task-failure header
_RAY_TASK_LINE = re.compile(r"^\s*ray::\S+\(\)?\s*(?:\(pid=\d+.*)?$")
_SIGNAL = re.compile(r"\*\*\* (?P<sig>SIG[A-Z]+) received at time=\d+")
_NATIVE_FRAME = re.compile(r"^\s*(?:PC: )?@\s+(?:0x[0-9a-fA-F]+|\.\.\. and at least \d+ more frames)")
_FATAL_PY = re.compile(r"^Fatal Python error: (?P<what>.+?)\s*$")
_FH_STACK = re.compile(r"^(?:Stack|Current thread 0x[0-9a-fA-F]+|Thread 0x[0-9a-fA-F]+)(?: \(most recent call first\))?:\s*$")
_FH_EXTRA = re.compile(r"^(?:Extension modules: |<no Python frame>|\s+<no Python frame>)")
_TERMINATE = re.compile(r"terminate called after throwing an instance of '(?P<type>[^']+)'")
_WHAT = re.compile(r"^\s*what\(\):\s*(?P<msg>.*)$")
_UNHANDLED = re.compile(r"Unhandled exception: (?P<type>\S+?)\.? what: (?P<msg>.*)$")
_CPP_STACK = re.compile(r"^\*\*\* (?:StackTrace Information|Check failure stack trace:) \*\*\*\s*$|^Exception raised from .* \(most recent call first\):\s*$")
_CPP_FRAME = re.compile(r"^\s*frame #\d+: |^\s+\S.*(?:\(\)|\+0x[0-9a-f]+\)?|\) \[0x[0-9a-f]+\])\s*$|^\s+(?:main|__libc_start_main|_start|clone)\s*$")
_HYDRA = re.compile(r"^Error executing job with overrides: ")
# IPython / Jupyter: `ValueError      Traceback (most recent call last)`, numbered source lines
# with `--->` at the one that ran, frames as `File path:N, in f(...)` or `path.py in f(...)`
_IPY_HEAD = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)\s{2,}Traceback \(most recent call last\)\s*$")
_IPY_FRAME = re.compile(r"^(?:File (?P<f1>\S+?):(?P<l1>\d+), in (?P<fn1>[^(\s]+)|(?P<f2>\S+\.pyx?|<ipython-input-[^>]+>) in (?P<fn2>[^(\s]+)"
                        r"|Cell In\s?\[\d+\], line (?P<l3>\d+))")
_IPY_SOURCE = re.compile(r"^\s*(?:-*>\s*)?\d+\s|^\s*\d+ frames?\s*$|^-{10,}\s*$|^\s*\.\.\.\s*$")
# an exception Python (or asyncio, or a thread) reports and goes on: at garbage collection or
# interpreter exit, in an atexit hook, in a thread that is not the main one
_REPORTED = re.compile(r"^(?P<what>Exception ignored in|Error in atexit\._run_exitfuncs|Exception in thread|"
                       r"Task exception was never retrieved|Exception in callback)\b")
_REPORTED_WRAPPER = {"Exception ignored in": "ignored", "Error in atexit._run_exitfuncs": "atexit",
                     "Exception in thread": "thread", "Task exception was never retrieved": "asyncio",
                     "Exception in callback": "asyncio"}
_DEBUGGER = re.compile(r"^(?:Exception has occurred|发生异常|例外が発生しました): (?P<type>[\w.]+)")
# how a shell names the signal that ended a process
_SIGNAL_WORDS = "Segmentation fault|Bus error|Aborted|Illegal instruction|Floating point exception|Killed"
_SIGNAL_OF_WORD = {"Segmentation fault": "SIGSEGV", "Bus error": "SIGBUS", "Aborted": "SIGABRT",
                   "Illegal instruction": "SIGILL", "Floating point exception": "SIGFPE", "Killed": "SIGKILL"}
# the same words from a shell in a Chinese locale (glibc's zh_CN signal names; `(核心已转储)`
# is `(core dumped)`): a console pasted from such a machine ends in them
_LOCALISED_SIGNAL_OF_WORD = {"段错误": "SIGSEGV", "总线错误": "SIGBUS", "已放弃": "SIGABRT", "非法指令": "SIGILL",
                             "浮点数例外": "SIGFPE", "已杀死": "SIGKILL"}
_SIGNAL_OF_WORD.update(_LOCALISED_SIGNAL_OF_WORD)
_LOCALISED_SIGNAL_WORDS = "|".join(_LOCALISED_SIGNAL_OF_WORD)
_EXIT = re.compile(
    r"(?:exit(?:ed)? with (?:non-?zero )?(?:exit )?(?:code|status)[ :=]+|exitcode\s*[:=]\s*|exit code:?\s+|failed with exit code\s+"
    r"|exits with return code = )(?P<code>-?\d+)\b"
    r"|^(?P<segv>Segmentation fault|Bus error|Aborted|Illegal instruction|Floating point exception)(?: \(core dumped\))?\s*$"
    r"|^(?P<killed>Killed)\s*$"
    r"|^(?P<localised>" + _LOCALISED_SIGNAL_WORDS + r")(?: ?[(（]核心已转储[)）])?\s*$"
    # bash's report of a job a signal ended: `./run.sh: line 12:  1188 Killed   python ...`,
    # interactively `[1]+  Killed   python ...`
    r"|^(?:\S+: line \d+: +\d+ |\[\d+\][+-]? +)(?P<jobsig>" + _SIGNAL_WORDS + r")(?: \(core dumped\))?(?:\s|$)")
_FATAL_SIGNAL_NUMBERS = {4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE", 9: "SIGKILL", 11: "SIGSEGV"}
# a shell (and docker, Kubernetes, an IDE) reports a process a signal ended as 128 + the
# signal's number (137 is SIGKILL, 139 SIGSEGV); Python's subprocess, and the launchers built
# on it (DeepSpeed's, torch elastic), as minus the number (-9)
_SIGNAL_OF_EXIT_CODE = {**{128 + n: s for n, s in _FATAL_SIGNAL_NUMBERS.items()},
                        **{-n: s for n, s in _FATAL_SIGNAL_NUMBERS.items()}}
_PROGRESS = re.compile(r"\d+%\|[^|]*\||\d+it/s\]|\[\d+:\d+<")
_SIGNAL_EXIT = re.compile(r"Signal (?P<num>\d+) \((?P<sig>SIG[A-Z]+)\) received")

_STARTS = (r"Traceback \(most recent call last\)|The above exception was|During handling of the above|File \"|"
           r"\*\*\* SIG|Fatal Python error|terminate called after throwing|Unhandled exception: |^\s*what\(\):|"
           r"StackTrace Information|Check failure stack trace|Error executing job with overrides|"
           r"^Exception ignored in|^Error in atexit|^Exception in thread|^Task exception was never retrieved|^Exception in callback|"
           r"\s{2,}Traceback \(most recent call last\)\s*$|"
           r"Exception has occurred: |发生异常: |例外が発生しました: |RayTaskError|ray::" + _RAY_NAME + r"[\w.<>]+\(\)? \(pid=|"
           r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)\w*(?:\(\w+\))?:|^Exception: |"
           r"exit(?:ed)? with (?:non-?zero )?(?:exit )?(?:code|status)|exitcode\s*[:=]|exit code|exits with return code|"
           r"^(?:Segmentation fault|Bus error|Aborted|Illegal instruction|Floating point exception|Killed)|"
           r"^(?:" + _LOCALISED_SIGNAL_WORDS + r")|"
           r"^\S+: line \d+: +\d+ (?:" + _SIGNAL_WORDS + r")|^\[\d+\][+-]? +(?:" + _SIGNAL_WORDS + r")|"
           r"^\s*(?:PC: )?@\s+0x")

# Where a frame's file lives: the package it belongs to. Installed code sits under
# site-packages / dist-packages; a checkout of a framework keeps the framework's own folder
# name (`/workspace/TTRL/verl/verl/workers/...`, `/workspace/code/vllm/vllm/config.py`).
_KNOWN_PACKAGES = (
    "vllm", "sglang", "verl", "torch", "ray", "deepspeed", "megatron", "transformers", "trl", "openrlhf",
    "accelerate", "peft", "datasets", "pyarrow", "omegaconf", "hydra", "flash_attn", "transformer_engine",
    "apex", "numpy", "pandas", "tensordict", "math_verify", "xformers", "triton", "safetensors", "huggingface_hub",
    "swift", "areal", "realhf", "nemo_aligner", "nemo", "lightllm", "tokenizers", "wandb", "urllib3", "requests",
    "httpx", "aiohttp", "uvicorn", "fastapi", "starlette", "openai", "grpc", "zmq", "msgspec", "pydantic",
)
_SITE = re.compile(r"(?:site|dist)-packages/(?P<pkg>[A-Za-z_][\w]*)")
_STDLIB = re.compile(r"/(?:lib|Lib)/python\d+(?:\.\d+)?/(?!site-packages|dist-packages)")
_WIN_STDLIB = re.compile(r"^[A-Za-z]:[\\/].*[\\/]Lib[\\/](?!site-packages)")


def frame_package(path: str) -> str:
    """The package a traceback frame's file belongs to (see :data:`FRAME_TYPE`): the folder
    under site-/dist-packages; ``python`` for the standard library and launcher scripts;
    for a checkout, the project folder that repeats (``verl/verl/``) or else the outermost
    known framework folder on the path; ``user`` for anything else."""
    p = path.replace("\\", "/")
    m = _SITE.search(p)
    if m:
        return _canonical(m.group("pkg"))
    if _STDLIB.search(p) or _WIN_STDLIB.search(path) or p.startswith("<frozen ") or re.search(r"/(?:s?bin|Scripts)/[^/]+$", p):
        return "python"
    if p.endswith((".pyx", ".pxi")) and "/" in p and not p.startswith("/"):
        return _canonical(p.split("/", 1)[0])  # Cython sources print their package-relative path
    parts = [x for x in p.split("/") if x][:-1]
    for a, b in zip(parts, parts[1:]):
        if a.lower() == b.lower() and a.isidentifier():  # a project checkout: <name>/<name>/...
            name = _canonical(b)
            return name if name in _KNOWN_PACKAGES else "user"
    for name in parts:
        c = _canonical(name)
        if c in _KNOWN_PACKAGES:
            return c
    return "user"


def _canonical(name: str) -> str:
    low = name.lower()
    return "megatron" if low.startswith("megatron") else low


# ---- events -----------------------------------------------------------------------------

@dataclass
class _Part:
    relation: str | None = None  # how this part relates to the previous: cause / context / remote
    type: str | None = None
    wrapped: str | None = None
    message: str | None = None
    line_no: int | None = None
    frames: list[dict] = field(default_factory=list)
    reverse_frames: bool = False  # faulthandler: most recent call first


@dataclass
class _Event:
    kind: str
    first: int  # row index of the first line
    last: int = -1
    parts: list[_Part] = field(default_factory=list)
    exc_row: int | None = None  # row of the line that shows the failure
    wrapper: str | None = None
    signal: str | None = None
    exit_code: int | None = None
    ray: dict | None = None
    fatal_text: str | None = None

    def part(self, relation: str | None = None) -> _Part:
        p = _Part(relation=relation)
        self.parts.append(p)
        return p


def _ray_task(msg: str) -> dict | None:
    m = _RAY_TASK.search(msg)
    if not m or not m.group("method"):
        return None
    return {"cls": m.group("cls"), "method": m.group("method"),
            "pid": int(m.group("pid")) if m.group("pid") else None, "ip": m.group("ip")}


_WRAPPER_TYPES = ("RayTaskError", "ActorDiedError", "RayActorError", "ChildFailedError", "ActorUnschedulableError",
                  "TaskUnschedulableError", "WorkerCrashedError", "RaySystemError", "EngineDeadError")


def _short(t: str | None) -> str | None:
    return t.rsplit(".", 1)[-1].rsplit("::", 1)[-1] if t else t


class _Stream:
    """The rows of one process's stream of one file, in line order."""

    def __init__(self, rows: list[int], msgs: list[str], levels: list[str | None], headers: list[str | None]):
        self.rows = rows
        self.msgs = msgs
        self.levels = levels
        self.headers = headers

    def msg(self, k: int) -> str:
        return self.msgs[self.rows[k]].rstrip()


def _blank(s: str) -> bool:
    return not s.strip()


def _python_event(st: _Stream, k: int, ev: _Event, state: str = "expect") -> int:
    """Read a Python traceback (and what chains onto it) from position ``k``; return the
    position after its last line.

    ``state``: ``expect`` (after a traceback header or a chain line: frames, a ``ray::``
    task line or the exception line come next), ``frames`` (inside the frames), ``message``
    (after the exception line: its continuation, a chain line, or a Ray wrapper's remote
    traceback). Frames whose indentation the paste lost are told from the exception line
    by shape: one source line follows each frame line, the exception line comes last."""
    n = len(st.rows)
    part = ev.parts[-1]
    own = st.headers[st.rows[ev.first]]  # the header the event's own lines carry (vLLM prints it on every line)

    def foreign(j: int) -> bool:  # a record of another kind (an NCCL line among vLLM-headed traceback lines)
        h = st.headers[st.rows[j]]
        return h is not None and h != own

    # a traceback pasted with every line indented (a quoted block, a console that adds a
    # margin): its header's indentation is the margin, taken off every line that has it, so
    # the exception line is told from the frames' source lines
    head = st.msgs[st.rows[ev.first]]
    margin = len(head) - len(head.lstrip(" ")) if head.lstrip(" ").startswith("Traceback") and _TB_HEAD.search(head) else 0

    def raw_at(j: int) -> str:
        r = st.msgs[st.rows[j]]
        return r[margin:] if margin and r[:margin] == " " * margin else r

    def msg_at(j: int) -> str:
        return raw_at(j).rstrip()

    indented = None  # whether this traceback's frame lines are indented (as Python prints them)
    after_frame = False  # the previous line was a frame line
    while k < n:
        raw = raw_at(k)
        m = raw.rstrip()
        if _PROGRESS.search(m) and '"' not in m:
            k += 1  # a progress bar redrawn in the middle (another thread's tqdm)
            continue
        if _TB_HEAD.search(m):
            if state == "message":
                break  # a new traceback with no chain line: another event
            state, after_frame = "expect", False
            ev.last, k = k, k + 1
            continue
        c = _CHAIN.match(m)
        if c:
            if state != "message":
                break
            part = ev.part("cause" if "direct cause" in c.group("what") else "context")
            state, after_frame = "expect", False
            ev.last, k = k, k + 1
            continue
        fr = _FRAME.match(m) or _FRAME_NOFUNC.match(m)
        if fr:
            if state == "message":
                if _is_ray_wrapper(part):
                    part = ev.part("remote")  # the remote traceback printed under a RayTaskError header
                else:
                    break
            if indented is None:
                indented = raw[:1] in (" ", "\t")
            part.frames.append({"file": fr.group("file"), "line": int(fr.group("line")), "function": fr.groupdict().get("func"),
                                "code": None, "row": st.rows[k], "code_row": None})
            state, after_frame = "frames", True
            ev.last, k = k, k + 1
            continue
        if state == "message":
            if _blank(m):
                # the message may go on after a blank line (Dynamo's advice) when a chain line follows
                j, text = k + 1, []
                while j < n and j - k <= 10 and not _CHAIN.match(msg_at(j)):
                    mj = msg_at(j)
                    if _TB_HEAD.search(mj) or _FRAME.match(mj) or _starts_other(mj) or foreign(j):
                        break
                    if not _blank(mj):
                        text.append(mj.strip())
                    j += 1
                if j < n and _CHAIN.match(msg_at(j)):
                    if text:
                        part.message = (part.message + "\n" if part.message else "") + "\n".join(text)
                    k = j
                    continue
                if _is_ray_wrapper(part) and k + 1 < n and _FRAME.match(msg_at(k + 1)):
                    k += 1
                    continue
                break
            if foreign(k) or _starts_other(m):
                break
            if _CARET.match(m) and _is_ray_wrapper(part):
                ev.last, k = k, k + 1  # Python 3.11's markers under the task line (`^^^^`), their indentation lost
                continue
            e = _EXC_STRICT.match(m)
            if e and _is_ray_wrapper(part) and part.wrapped and _short(e.group("type")) == _short(part.wrapped):
                # the wrapped exception right under its RayTaskError header (a remote part with no frames)
                part = ev.part("remote")
                _set_exception(ev, part, e, st.rows[k])
                ev.last, k = k, k + 1
                continue
            if raw[:1] in (" ", "\t") or _continues_message(m, k - ev.last):
                part.message = (part.message + "\n" if part.message else "") + m.strip()
                ev.last, k = k, k + 1
                continue
            break
        # state: expect / frames
        if _TRUNCATED_FRAME.match(m) or _CARET.match(m):
            ev.last, k = k, k + 1
            continue
        if state == "expect" and _RAY_TASK_LINE.match(m):
            ev.ray = ev.ray or _ray_task(m)
            ev.last, k = k, k + 1
            continue
        if _blank(m) or (foreign(k) and state == "frames"):
            if state == "expect" and _blank(m):
                k += 1
                continue
            # Python prints no blank line inside the frames: a blank line or another record (an
            # NCCL or glog line of the same process) between frames was written in between by
            # another thread; the traceback goes on when frames follow
            j = k + 1
            while j < n and j - k <= 8 and (_blank(msg_at(j)) or foreign(j)):
                j += 1
            if j < n and j - k <= 8 and _FRAME.match(msg_at(j)):
                k = j
                continue
            break
        if state == "frames" and raw[:1] in (" ", "\t") and (indented or after_frame):
            if part.frames and part.frames[-1]["code"] is None:
                part.frames[-1]["code"], part.frames[-1]["code_row"] = m.strip(), st.rows[k]
            after_frame = False
            ev.last, k = k, k + 1
            continue
        strict = _EXC_STRICT.match(m)
        loose = _EXC_LOOSE.match(m)
        # a source line that only looks like `Type(Wrapped)` (`run_ppo(config)`, `train(args)`)
        # is the frame's code: an exception's type starts with a capital (or `_`)
        if state == "frames" and not indented and after_frame and not strict and not (loose and _plausible_type(loose.group("type"))) and not _starts_other(m):
            part.frames[-1]["code"], part.frames[-1]["code_row"] = m.strip(), st.rows[k]  # the frame's source line, its indentation lost
            after_frame = False
            ev.last, k = k, k + 1
            continue
        e = strict or (_EXC_LOOSE.match(m) if state == "frames" else None)
        if e and (_plausible_type(e.group("type")) or (state == "frames" and indented and e.group("msg") is not None)):
            _set_exception(ev, part, e, st.rows[k])
            state = "message"
            ev.last, k = k, k + 1
            continue
        if state == "frames" and indented and k + 1 < n and (_FRAME.match(msg_at(k + 1)) or raw_at(k + 1)[:1] in (" ", "\t")):
            k += 1  # a line of another stream printed between two frames: not part of the traceback
            continue
        break
    return k


def _is_ray_wrapper(part: _Part) -> bool:
    """The part's exception line is a RayTaskError header: the remote traceback follows it."""
    return bool(part.type) and _short(part.type) == "RayTaskError"


def _plausible_type(t: str) -> bool:
    last = t.rsplit(".", 1)[-1]
    return bool(last) and (last[0].isupper() or last[0] == "_") and len(t) <= 200


def _continues_message(m: str, gap: int) -> bool:
    """A non-indented line after the exception line that still belongs to its message:
    the well-known multi-line tails (CUDA's, torchrun's box, SGLang's suggestions)."""
    return gap <= 6 and bool(re.match(
        r"^(?:CUDA kernel errors might be|For debugging consider passing|Compile with .TORCH_USE_CUDA_DSA|"
        r"Search for .cudaErrorMemoryAllocation|=+$|-+$|\S+ FAILED$|Failures:$|<NO_OTHER_FAILURES>$|Root Cause \(|"
        r"\[\d+\]:$|Possible solutions:|\d\. |The actor is dead because|The actor never ran|"
        r"Worker exit type:|The worker died|The task .* failed|You can suppress this exception)", m))


def _starts_other(m: str) -> bool:
    return bool(_SIGNAL.search(m) or _FATAL_PY.match(m) or _TERMINATE.search(m) or _HYDRA.match(m) or _DEBUGGER.match(m)
                or _CPP_STACK.match(m) or _UNHANDLED.search(m))


def _set_exception(ev: _Event, part: _Part, e: re.Match, row: int) -> None:
    t = e.group("type")
    wrapped = e.group("wrapped")
    msg = e.group("msg")
    short = _short(t)
    if short in _WRAPPER_TYPES and ev.wrapper in (None, "hydra", "ray_task", "debugger"):  # not over a reported-and-survived one
        ev.wrapper = short  # the wrapper that carries the failure, over the job runner's report
    if short == "RayTaskError" or "ray::" in (msg or ""):
        task = _ray_task(msg or "")
        if task:
            ev.ray = task  # nested wrappers: the innermost task is the one that failed
    part.type = t
    part.wrapped = wrapped
    part.message = (msg or "").strip() or None
    part.line_no = row
    if ev.exc_row is None:
        ev.exc_row = row


def _native_event(st: _Stream, k: int, ev: _Event) -> int:
    """A native crash: signal lines and their PC/@ frames (Ray's handler, re-logged by
    logging.cc), ``Fatal Python error`` and the faulthandler stack(s)."""
    n = len(st.rows)
    part = ev.part()
    part.reverse_frames = True
    blank_run = 0
    while k < n:
        m = st.msg(k)
        s = _SIGNAL.search(m)
        if s:
            ev.signal = ev.signal or s.group("sig")
            if ev.exc_row is None:
                ev.exc_row = st.rows[k]
            ev.last, k, blank_run = k, k + 1, 0
            continue
        if _NATIVE_FRAME.match(m):
            ev.last, k, blank_run = k, k + 1, 0
            continue
        f = _FATAL_PY.match(m)
        if f:
            if ev.fatal_text is None:
                ev.fatal_text = f.group("what")
            if ev.exc_row is None:
                ev.exc_row = st.rows[k]
            if part.type is None:
                part.type = f.group("what")
                part.line_no = st.rows[k]
            ev.last, k, blank_run = k, k + 1, 0
            continue
        if _FH_STACK.match(m) or _FH_EXTRA.match(m):
            ev.last, k, blank_run = k, k + 1, 0
            continue
        fr = _FRAME.match(m) or _FRAME_NOFUNC.match(m)
        if fr:
            part.frames.append({"file": fr.group("file"), "line": int(fr.group("line")), "function": fr.groupdict().get("func"), "code": None})
            ev.last, k, blank_run = k, k + 1, 0
            continue
        if _TRUNCATED_FRAME.match(m):
            ev.last, k, blank_run = k, k + 1, 0
            continue
        if _blank(m) and blank_run < 2:
            blank_run += 1
            k += 1
            continue
        break
    if part.type is None and ev.signal:
        part.type = ev.signal
        part.line_no = ev.exc_row
    return k


def _cpp_event(st: _Stream, k: int, ev: _Event) -> int:
    """``terminate called after throwing ...`` / ``what():``, ``Unhandled exception``, a
    fatal record and the C++ stack dump after it."""
    n = len(st.rows)
    part = ev.part()
    first = True
    while k < n:
        m = st.msg(k)
        t = _TERMINATE.search(m)
        u = _UNHANDLED.search(m)
        w = _WHAT.match(m)
        if first:
            first = False
            if t:
                part.type, part.line_no = t.group("type"), st.rows[k]
            elif u:
                part.type, part.message, part.line_no = u.group("type"), u.group("msg").strip(), st.rows[k]
            elif w:  # the text starts at what(): the exception's type was on the line before
                part.message, part.line_no = w.group("msg").strip(), st.rows[k]
            else:  # a fatal record: its message is the text
                part.message, part.line_no = m.strip(), st.rows[k]
            ev.exc_row = st.rows[k]
            ev.last, k = k, k + 1
            continue
        if w and part.message is None:
            part.message = w.group("msg").strip()
            ev.last, k = k, k + 1
            continue
        if _CPP_STACK.match(m) or _CPP_FRAME.match(m) or (w is not None):
            ev.last, k = k, k + 1
            continue
        if st.msgs[st.rows[k]][:1] in (" ", "\t") and not _blank(m) and ev.last == k - 1 and st.headers[st.rows[k]] is None:
            if part.message is not None and not _CPP_FRAME.match(m):
                part.message += "\n" + m.strip()
            ev.last, k = k, k + 1
            continue
        break
    return k


def _ipython_event(st: _Stream, k: int, ev: _Event, head_type: str) -> int:
    """An IPython / Jupyter traceback: the header names the type; frames are ``File path:N,
    in f(...)`` (or ``path.py in f(...)``) blocks of numbered source lines, ``---->`` at the
    line that ran; the exception line ends it."""
    n = len(st.rows)
    part = ev.part()
    ev.last = k
    k += 1
    while k < n:
        m = st.msg(k)
        fr = _IPY_FRAME.match(m)
        if fr:
            file = fr.group("f1") or fr.group("f2") or "<cell>"
            line = fr.group("l1") or fr.group("l3") or 0
            part.frames.append({"file": file, "line": int(line), "function": fr.group("fn1") or fr.group("fn2"),
                                "code": None, "row": st.rows[k], "code_row": None})
            ev.last, k = k, k + 1
            continue
        if _IPY_SOURCE.match(m):
            if "->" in m and part.frames:  # the line that ran
                part.frames[-1]["code"] = re.sub(r"^\s*-*>\s*\d+\s", "", m).strip()
                part.frames[-1]["code_row"] = st.rows[k]
            ev.last, k = k, k + 1
            continue
        if _blank(m):
            k += 1
            continue
        e = _EXC_STRICT.match(m) or _EXC_LOOSE.match(m)
        if e and _plausible_type(e.group("type")):
            _set_exception(ev, part, e, st.rows[k])
            ev.last, k = k, k + 1
            return _python_event(st, k, ev, "message")
        break
    if part.type is None:  # cut off: the header named the type
        part.type, part.line_no = head_type, st.rows[ev.first]
        ev.exc_row = st.rows[ev.first]
    return k


def _segment(st: _Stream, k: int, fatal: list[bool]) -> tuple[_Event | None, int]:
    """The event starting at position ``k`` of the stream (None when none starts there)."""
    m = st.msg(k)
    row = st.rows[k]
    if fatal[row] and not _TB_HEAD.search(m):
        ev = _Event("fatal_log", k)
        if _SIGNAL.search(m):
            ev.kind = "native"
            return ev, _native_event(st, k, ev)
        return ev, _cpp_event(st, k, ev)
    if _SIGNAL.search(m) or _NATIVE_FRAME.match(m) or _FATAL_PY.match(m):
        ev = _Event("native", k)
        return ev, _native_event(st, k, ev)
    if _TERMINATE.search(m) or _UNHANDLED.search(m) or _CPP_STACK.match(m) or _WHAT.match(m):
        ev = _Event("cpp", k)
        return ev, _cpp_event(st, k, ev)
    if _TB_HEAD.search(m):
        ev = _Event("python", k)
        ev.part()
        if not m.lstrip().startswith("Traceback"):
            ev.exc_row = row  # `Scheduler hit an exception: Traceback ...`: the line says what happened
        return ev, _python_event(st, k, ev)
    ipy = _IPY_HEAD.match(m)
    if ipy:
        ev = _Event("python", k)
        return ev, _ipython_event(st, k, ev, ipy.group("type"))
    rep = _REPORTED.match(m)
    if rep:
        # the report's first line, then its traceback (or, for `Exception ignored in`, the
        # exception line alone)
        ev = _Event("python", k)
        ev.wrapper = _REPORTED_WRAPPER[rep.group("what")]
        ev.part()
        ev.last = k
        j = k + 1
        if j < len(st.rows) and _TB_HEAD.search(st.msg(j)):
            return ev, _python_event(st, j, ev)
        if j < len(st.rows):
            e = _EXC_STRICT.match(st.msg(j))
            if e and _plausible_type(e.group("type")):
                _set_exception(ev, ev.parts[-1], e, st.rows[j])
                ev.last = j
                return ev, _python_event(st, j + 1, ev, "message")
        return None, k + 1
    h = _HYDRA.match(m)
    if h:
        ev = _Event("python", k)
        ev.wrapper = "hydra"
        ev.part()
        ev.last = k
        j = k + 1
        if j < len(st.rows) and _TB_HEAD.search(st.msg(j)):
            return ev, _python_event(st, j, ev)
        return None, k + 1
    d = _DEBUGGER.match(m)
    if d:
        ev = _Event("python", k)
        ev.wrapper = "debugger"
        part = ev.part()
        part.reverse_frames = True  # the debugger lists the innermost frame first
        part.type, part.line_no = d.group("type"), row
        ev.exc_row = row
        ev.last = k
        j = k + 1
        msg_lines = []
        while j < len(st.rows) and not (_FRAME.match(st.msg(j)) or _FRAME_NOFUNC.match(st.msg(j))) and j - k <= 3 and not _blank(st.msg(j)):
            msg_lines.append(st.msg(j).strip())
            ev.last = j
            j += 1
        part.message = "\n".join(msg_lines) or None
        # frames follow (the debugger lists them after the exception)
        k2 = j
        while k2 < len(st.rows):
            mm = st.msg(k2)
            fr = _FRAME.match(mm) or _FRAME_NOFUNC.match(mm)
            if fr:
                part.frames.append({"file": fr.group("file"), "line": int(fr.group("line")), "function": fr.groupdict().get("func"), "code": None})
            elif _blank(mm):
                if k2 + 1 < len(st.rows) and (_FRAME.match(st.msg(k2 + 1)) or st.msgs[st.rows[k2 + 1]][:1] in (" ", "\t")):
                    k2 += 1
                    continue
                break
            elif st.msgs[st.rows[k2]][:1] in (" ", "\t"):
                if part.frames and part.frames[-1]["code"] is None and not _CARET.match(mm):
                    part.frames[-1]["code"] = mm.strip()
            else:
                break
            ev.last = k2
            k2 += 1
        return ev, k2
    if _FRAME.match(m) or _FRAME_NOFUNC.match(m):
        ev = _Event("python", k)  # a traceback whose start the paste left out
        ev.part()
        return ev, _python_event(st, k, ev, "frames")
    e = _EXC_STRICT.match(m)
    if e and _plausible_type(e.group("type")):
        # an exception line with no traceback before it: the tail of a paste, a logged error,
        # or the first exception of a chain whose traceback was cut off
        ev = _Event("python", k)
        part = ev.part()
        _set_exception(ev, part, e, row)
        ev.last = k
        return ev, _python_event(st, k + 1, ev, "message")
    if _RAY_TASK_HEADER.search(m) and st.msgs[row][:1] not in (" ", "\t"):
        # `Unhandled error (...): ray::X.m() (pid=..)`, `Exception occurred while running X's function m:
        # exception is ray::X.m() (pid=..)`: the remote traceback follows
        ev = _Event("python", k)
        ev.wrapper = "ray_task"
        ev.ray = _ray_task(m)
        part = ev.part()
        part.message, part.line_no = m.strip(), row
        ev.exc_row = row
        ev.last = k
        return ev, _python_event(st, k + 1, ev, "expect")
    x = _EXIT.search(m)
    if x and st.headers[row] is None or (x and x.group("code") is not None):
        code = x.group("code")
        if code is not None and int(code) == 0:
            return None, k + 1
        ev = _Event("exit", k)
        ev.last = k
        ev.exc_row = row
        if code is not None:
            ev.exit_code = int(code)
            ev.signal = _SIGNAL_OF_EXIT_CODE.get(ev.exit_code)
        else:
            ev.signal = _SIGNAL_OF_WORD[x.group("killed") or x.group("segv") or x.group("jobsig") or x.group("localised")]
        sig = _SIGNAL_EXIT.search(m)
        if sig:
            ev.signal = sig.group("sig")
        part = ev.part()
        part.type = ev.signal or (f"exit {ev.exit_code}" if ev.exit_code is not None else None)
        part.message = m.strip()
        part.line_no = row
        return ev, k + 1
    return None, k + 1


# ---- building the table --------------------------------------------------------------------

def _frame_rows(parts: list[_Part], line_nos: list) -> list[dict]:
    out = []
    for i, p in enumerate(parts):
        frames = list(reversed(p.frames)) if p.reverse_frames else p.frames
        for f in frames:
            at, code_at = f.get("row"), f.get("code_row")
            out.append({"part": i, "file": f["file"], "line": f["line"], "function": f["function"],
                        "package": frame_package(f["file"]), "code": f.get("code"),
                        "at": int(line_nos[at]) if at is not None else None,
                        "code_at": int(line_nos[code_at]) if code_at is not None else None})
    return out


def _row(ev: _Event, st: _Stream, cols: dict[str, list]) -> dict:
    r0 = st.rows[ev.first]
    r1 = st.rows[max(ev.last, ev.first)]
    parts = [p for p in ev.parts if p.type or p.frames or p.message]
    typed = [p for p in parts if p.type]
    frames = _frame_rows(parts, cols["line_no"])
    # the root: the first exception of the chain (Python prints the original cause first);
    # a Ray wrapper gives way to the remote exception it carries
    root = typed[0] if typed else (parts[0] if parts else _Part())
    root_idx = parts.index(root) if root in parts else 0
    # asyncio cancels the awaited task to end a wait (wait_for's timeout, a shutdown): a
    # CancelledError that the chain carries on from ("During handling ...", "The above
    # exception was the direct cause ...") is the mechanism, not the failure; the exception it
    # led to is, and where the text stops before that one's line, what failed is not shown
    while _CANCELLED.search(root.type or "") and root_idx + 1 < len(parts) \
            and parts[root_idx + 1].relation in ("cause", "context"):
        root_idx += 1
        root = parts[root_idx]
        typed = [p for p in typed if parts.index(p) >= root_idx]
    # follow Ray wrappers (nested: the driver's task wraps a worker's task) to the remote part
    while _is_ray_wrapper(root):
        nxt = root_idx + 1
        if nxt < len(parts) and parts[nxt].relation == "remote":
            if parts[nxt].type:
                root, root_idx = parts[nxt], nxt
                continue
            root, root_idx = _Part(type=root.wrapped, line_no=root.line_no, frames=parts[nxt].frames), nxt
        elif root.wrapped:
            # the remote part is past the end of the text: the wrapped type is all there is
            root = _Part(type=root.wrapped, line_no=root.line_no, frames=root.frames)
        break
    exc_type = root.type
    cut_off = False
    innermost_row = None
    if exc_type is None:
        if ev.kind == "fatal_log":
            exc_type = "FATAL"  # a fatal log record: no exception type, its severity
        elif ev.kind in ("python", "cpp"):
            exc_type, cut_off = "unknown", True
            # the text stops inside the traceback: the innermost frame shown is where it failed,
            # and a `raise X("...")` source line there says what it raised
            inner = next((f for p in reversed(parts) for f in reversed(p.frames) if "row" in f), None)
            if inner is not None:
                innermost_row = inner["code_row"] if inner.get("code_row") is not None else inner["row"]
                r = _RAISE.match(inner.get("code") or "")
                if r:
                    exc_type = r.group("type")
                    root = _Part(type=exc_type, message=(r.group("msg") or "").strip() or None, line_no=inner["code_row"])
    last = typed[-1] if typed else None
    outer = last if last is not None and last.type not in (exc_type, None) and last is not root \
        and not _is_ray_wrapper(last) else None
    root_frames = [f for f in frames if f["part"] == root_idx] or frames
    package = root_frames[-1]["package"] if root_frames else None
    user = next((f for f in reversed(root_frames) if f["package"] == "user"), None)
    user_frame = None
    if user:
        base = user["file"].replace("\\", "/").rsplit("/", 1)[-1]
        user_frame = f"{base}:{user['line']}" + (f" in {user['function']}" if user["function"] else "")
    types: list[str] = []
    for i, p in enumerate(parts):
        if i < root_idx and _CANCELLED.search(p.type or ""):
            continue  # the cancellation the chain carried on from (above)
        for t in (p.type, p.wrapped):
            if t and t not in types:
                types.append(t)
    chain = [{"type": p.type, "message": p.message, "relation": p.relation,
              "line_no": int(cols["line_no"][p.line_no]) if p.line_no is not None else None} for p in typed]
    # the line that shows the failure: the root exception's own line (under a Ray wrapper,
    # the remote exception), else the first line that showed one
    exc_row = root.line_no if ev.kind == "python" and root.line_no is not None else \
        (ev.exc_row if ev.exc_row is not None else r0)
    if cut_off and innermost_row is not None and ev.wrapper != "ray_task" and ev.exc_row is None:
        exc_row = root.line_no if root.line_no is not None else innermost_row
    message = root.message or (ev.fatal_text if ev.kind == "native" else None)
    ray = ev.ray or {}
    return {
        "file_id": cols["file_id"][r0],
        "line_no": int(cols["line_no"][r0]),
        "last_line": int(cols["line_no"][r1]),
        "exc_line": int(cols["line_no"][exc_row]),
        "kind": ev.kind,
        "exc_type": exc_type,
        "exc_name": _short(exc_type),
        "message": message[:4000] if message else None,
        "outer_type": outer.type if outer else None,
        "outer_message": (outer.message or "")[:4000] or None if outer else None,
        "wrapper": ev.wrapper,
        "wrapped_type": next((p.wrapped for p in parts if p.wrapped), None),
        "types": types,
        "chain": chain,
        "frames": frames,
        "package": package,
        "user_frame": user_frame,
        "signal": ev.signal,
        "exit_code": ev.exit_code,
        "ray_actor": (ray.get("cls") or "").rsplit(".", 1)[-1] or None,
        "ray_method": ray.get("method"),
        "ray_pid": ray.get("pid"),
        "ray_ip": ray.get("ip"),
        "pid": cols["pid"][r0],
        "rank": cols["rank"][r0],
        "actor": cols["actor"][r0],
        "node": cols["node"][r0],
        "ts": cols["ts"][r0],
        "lines": int(cols["line_no"][r1]) - int(cols["line_no"][r0]) + 1,
        "cut_off": cut_off,
    }


_RAY_PREFIX = r"^(?:\x1b\[[0-9;]*m)*\((?:[^()\s]+ )?pid=\d+"


# A paste whose every line break was doubled (CR LF turned into two line feeds on the way, or a
# web page copied with a blank line after each line) has a blank line after (almost) every
# line: the blanks that only space the lines are not part of the log's records, so a
# traceback must not end at them. A file is read so when it has at least this many non-blank
# lines and this share of them (the file's last line aside) has a blank line right after.
SPACED_MIN_LINES = 4
SPACED_MIN_SHARE = 0.9


def spacer_lines(df: pl.DataFrame) -> pl.Series:
    """For each row of a lines frame (``file_id``, ``message``; each file's rows in line
    order): whether it is a blank line that only spaces a double-spaced paste (see
    SPACED_MIN_SHARE). In a run of k blank lines there, the first ceil(k/2) are spacers and the
    rest stand for the blank lines of the log as written (one blank line shows as three)."""
    blank = df.get_column("message").fill_null("").str.strip_chars() == ""
    none = pl.Series("spacer", [False] * df.height, dtype=pl.Boolean)
    if not blank.any() or blank.all():
        return none
    f = df.select(pl.col("file_id"), blank.alias("_b"))
    nxt_blank = pl.col("_b").shift(-1).over("file_id")
    is_last = pl.int_range(pl.len()).over("file_id") == pl.len().over("file_id") - 1
    per_file = f.with_columns(nxt_blank.alias("_nb"), is_last.alias("_last")).group_by("file_id").agg(
        (~pl.col("_b") & ~pl.col("_last")).sum().alias("_n"),
        (~pl.col("_b") & ~pl.col("_last") & pl.col("_nb").fill_null(False)).sum().alias("_spaced"))
    spaced = per_file.filter((pl.col("_n") >= SPACED_MIN_LINES) & (pl.col("_spaced") >= SPACED_MIN_SHARE * pl.col("_n")))
    if spaced.is_empty():
        return none
    run = (~pl.col("_b")).cum_sum().over("file_id")  # blank runs: the rows after the same non-blank line
    pos = pl.int_range(pl.len()).over("file_id", run)
    size = pl.len().over("file_id", run)
    out = f.with_columns(run.alias("_run")).with_columns(
        (pl.col("_b") & pl.col("file_id").is_in(spaced.get_column("file_id").implode())
         # the run's non-blank head is row 0 of its group (but not before a file's first line)
         & ((pos - pl.col("_run").gt(0).cast(pl.Int64)) < ((size - pl.col("_run").gt(0).cast(pl.Int64) + 1) // 2)))
        .alias("spacer"))
    return out.get_column("spacer")


# A hard-wrapped paste (its shape: parsers/conventions.py): a line exactly as wide as the
# file, unless it ends in padding or the next one starts a record of its own, goes on in the
# next physical line. The diagnosis reads the same shape (forensics/diagnosis/matching.py).


def wrapped_continuations(df: pl.DataFrame) -> pl.Series:
    """For each row of a lines frame (``file_id``, ``text``, ``header``; each file's rows in
    line order): whether it continues the line above it in a hard-wrapped file (see
    WRAP_MIN_WIDTH): the line above is exactly the file's width W and does not end in
    whitespace, and this one has no header of its own and does not start with the word the
    line above starts with. A trailing \\r (Windows line ends) is not part of the width."""
    none = pl.Series("cont", [False] * df.height, dtype=pl.Boolean)
    text = pl.col("text").fill_null("").str.strip_suffix("\r")
    f = df.select(pl.col("file_id"), text.alias("_t"), pl.col("header"))
    f = f.with_columns(pl.col("_t").str.len_chars().alias("_n"))
    per_file = f.group_by("file_id").agg(
        pl.col("_n").max().alias("_w"), pl.len().alias("_c"), ((pl.col("_n") == pl.col("_n").max()).sum()).alias("_full"))
    wrapped = per_file.filter((pl.col("_w") >= WRAP_MIN_WIDTH) & (pl.col("_c") <= WRAP_MAX_LINES)
                              & (pl.col("_full") >= pl.max_horizontal(pl.lit(3), WRAP_MIN_SHARE * pl.col("_c")))).select("file_id", "_w")
    if wrapped.is_empty():
        return none
    # and at least 3 different lines of that width (not one line repeated: a table's rule)
    distinct = f.join(wrapped, on="file_id").filter(pl.col("_n") == pl.col("_w")).group_by("file_id").agg(
        pl.col("_t").n_unique().alias("_d"))
    wrapped = wrapped.join(distinct.filter(pl.col("_d") >= 3), on="file_id", how="semi")
    if wrapped.is_empty():
        return none
    word = pl.col("_t").str.extract(r"^\W*\w+", 0)
    # the line tests only on the rows of the wrapped files (a batch of many files has few)
    rows = f.with_row_index("_i").join(wrapped, on="file_id", maintain_order="left")
    cont = rows.select("_i", (
        (pl.col("_n").shift(1).over("file_id") == pl.col("_w"))
        & ~pl.col("_t").shift(1).over("file_id").str.contains(r"\s$")
        & pl.col("header").is_null()
        & word.ne_missing(word.shift(1).over("file_id"))).fill_null(False).alias("cont")).filter(pl.col("cont"))
    return none.scatter(cont.get_column("_i"), True) if cont.height else none


def find_events(df: pl.DataFrame) -> tuple[pl.Series, pl.Series, pl.DataFrame]:
    """The fatal events of a lines frame (``file_id``, ``line_no``, ``message``, ``text``, ``level``,
    ``header``, ``pid``, ``rank``, ``actor``, ``node``, ``ts`` columns; rows of one file in line
    order). Returns the ``event_line`` of every row (null outside events), the level the
    event gives its lines (``ERROR``; ``FATAL`` for a native crash or a fatal record; the
    level of the record that logged it when there is one), and the ``fatal_events`` rows."""
    n = df.height
    none = pl.Series("event_line", [None] * n, dtype=pl.Int64)
    no_level = pl.Series("event_level", [None] * n, dtype=pl.String)
    if n == 0:
        return none, no_level, FATAL_EVENTS.empty()
    msg = df.get_column("message").fill_null("")
    fatal_level = df.get_column("level").fill_null("").is_in(["FATAL"])
    start = msg.str.contains(_STARTS) | fatal_level  # the Rust regex of polars takes this syntax too
    if not start.any():
        return none, no_level, FATAL_EVENTS.empty()
    # each process's stream of each file is followed apart (a driver log interleaves them):
    # the pid of a Ray line prefix `(Actor pid=N)` or a rank prefix separates streams; the pid a
    # record header prints (glog, Ray C++) does not, since one process's lines carry it or not
    prefixed = df.get_column("text").fill_null("").str.contains(_RAY_PREFIX)
    key = df.select(pl.struct(
        pl.col("file_id"),
        pl.when(prefixed).then(pl.col("pid")).fill_null(-1),
        pl.col("rank").fill_null(-1),
        pl.when(prefixed).then(pl.col("actor")).fill_null(""),
    ).alias("_k")).to_series()
    keyed = pl.DataFrame({"_k": key, "_i": pl.int_range(n, eager=True, dtype=pl.Int64), "_s": start})
    spacer = spacer_lines(df)
    if spacer.any():  # a double-spaced paste's spacing blanks are left out of its streams
        keyed = keyed.filter(~spacer)
    cont = wrapped_continuations(df)
    if cont.any():
        # a hard-wrapped paste: each cut line is read whole, at its first physical line
        msg = _join_continuations(msg, cont)
        start = (msg.str.contains(_STARTS) | fatal_level) & ~cont
        keyed = keyed.with_columns(_s=start.gather(keyed.get_column("_i"))).filter(~cont.gather(keyed.get_column("_i")))
    with_start = keyed.filter(pl.col("_s")).get_column("_k").unique()
    # only the streams that hold a start are read in Python (a quarter of the corpus' lines):
    # their rows are numbered 0.. in ``sub``, and ``where`` maps them back to the frame's
    keyed = keyed.filter(pl.col("_k").is_in(with_start.implode())).with_row_index("_j")
    where = keyed.get_column("_i")
    groups = keyed.group_by("_k", maintain_order=True).agg(pl.col("_j").cast(pl.Int64), pl.col("_s"))
    sub = df.select("file_id", "line_no", "pid", "rank", "actor", "node", "ts", "level", "header").with_columns(
        msg.alias("_msg"), fatal_level.alias("_fatal"))[where]
    msgs = sub.get_column("_msg").to_list()
    levels = sub.get_column("level").to_list()
    headers = sub.get_column("header").to_list()
    fatal = sub.get_column("_fatal").to_list()
    cols = {c: sub.get_column(c).to_list() for c in ("file_id", "line_no", "pid", "rank", "actor", "node", "ts")}
    at = where.to_list()
    event_line: list[int | None] = [None] * n
    event_level: list[str | None] = [None] * n
    rows: list[dict] = []
    for idx, starts in zip(groups.get_column("_j").to_list(), groups.get_column("_s").to_list()):
        st = _Stream(idx, msgs, levels, headers)
        k = 0
        pos = [i for i, s in enumerate(starts) if s]
        p = 0
        while p < len(pos):
            k0 = pos[p]
            if k0 < k:
                p += 1
                continue
            ev, k_end = _segment(st, k0, fatal)
            if ev is None or not ev.parts or ev.last < ev.first:
                p += 1
                k = max(k, k0 + 1)
                continue
            first_line = cols["line_no"][st.rows[ev.first]]
            row = _row(ev, st, cols)
            exc_row = next((r for r in st.rows[ev.first:ev.last + 1] if cols["line_no"][r] == row["exc_line"]), st.rows[ev.first])
            # a traceback right under a log record is that record's exc_info (logger.warning(...,
            # exc_info=True), logger.exception): it has the record's level
            before = st.rows[ev.first - 1] if ev.first > 0 else None
            logged = levels[before] if before is not None and headers[before] is not None else None
            level = levels[exc_row] or logged or ("FATAL" if ev.kind in ("native", "fatal_log") else "ERROR")
            for j in range(ev.first, ev.last + 1):
                event_line[at[st.rows[j]]] = first_line
                event_level[at[st.rows[j]]] = level
            rows.append(row)
            k = max(ev.last + 1, k0 + 1)
            p += 1
    if cont.any():  # the rest of a cut line belongs to the event of its first part
        for i, c in enumerate(cont.to_list()):
            if c and i > 0:
                event_line[i], event_level[i] = event_line[i - 1], event_level[i - 1]
    if spacer.any():  # a spacer between two lines of one event belongs to it
        _fill_spacers(spacer.to_list(), df.get_column("file_id").to_list(), event_line, event_level)
    events = pl.DataFrame(rows, schema=FATAL_EVENTS.polars_schema) if rows else FATAL_EVENTS.empty()
    return (pl.Series("event_line", event_line, dtype=pl.Int64), pl.Series("event_level", event_level, dtype=pl.String),
            events)


def _fill_spacers(spacer: list[bool], file_ids: list, event_line: list, event_level: list) -> None:
    """Give a spacer line (:func:`spacer_lines`) the event of the lines on both sides of it,
    when they belong to the same one."""
    n = len(spacer)
    i = 0
    while i < n:
        if not spacer[i]:
            i += 1
            continue
        j = i
        while j < n and spacer[j] and file_ids[j] == file_ids[i]:
            j += 1
        if i > 0 and j < n and file_ids[i - 1] == file_ids[i] == file_ids[j] \
                and event_line[i - 1] is not None and event_line[i - 1] == event_line[j]:
            for k in range(i, j):
                event_line[k], event_level[k] = event_line[j], event_level[j]
        i = j


def _join_continuations(msg: pl.Series, cont: pl.Series) -> pl.Series:
    """``msg`` with each line's continuations (:func:`wrapped_continuations`) appended to it."""
    out = msg.to_list()
    flags = cont.to_list()
    head = None
    for i, c in enumerate(flags):
        if c and head is not None:
            out[head] += out[i]
        elif not c:
            head = i
    return pl.Series(msg.name, out, dtype=pl.String)
