"""The signature catalogue: declarative failure rules loaded from YAML.

The built-in catalogue lives in the top-level ``signatures/`` folder (one YAML file per
family of failures); users add or override rules with ``--signatures DIR`` without
touching code. Every YAML file may hold any of these top-level sections:

``rules``
    A list of rules. A rule recognises one kind of line (``patterns``: regular
    expressions in RE2 syntax, evaluated by DuckDB over ``lines.message``), says which
    taxonomy class it points to and what causal role the line plays (see :data:`ROLES`).
``classes``
    Per taxonomy class: a title, default remediation (verl config keys with suggested
    values) and the debugging switches that would have shown more.
``phase_markers``
    Which traceback frames / Ray task method names imply which phase of a step.
``metric_detectors``
    Thresholds of the metric-trend detectors (:mod:`forensics.detectors`).
``rank_zero_prints``
    Lines verl prints only on rank 0 (``if self.rank == 0: print(...)``): the process that
    prints one is rank 0, which helps to place failures of processes that print no rank.
``rank_actors``
    Ray actor classes whose processes are training ranks (their pids rise with the rank).
``relayed_ranks``
    Where a failure one process reports names the rank that failed (torch's distributed
    checkpoint relays every failed rank's traceback under ``(RANK N)``): regexes with the
    group ``ranks`` over a fatal event's first line and messages.
``engine_args``
    Per inference engine (vllm, sglang, ...): regexes of the lines where it prints the
    arguments it was started with, a Python dict literal in the group ``args``.
``config_overrides``
    Which engine argument, when the run set it, makes a verl key act no more (vLLM's
    ``kv_cache_memory_bytes`` sizes the KV cache and ``gpu_memory_utilization`` is then
    ignored): remediation that would change the key names the argument instead
    (:class:`ConfigOverride`).
``causality``
    How failures relate (:class:`Causality`): which rules are collective timeouts that
    later errors follow from, which classes are teardown noise after the end of a run,
    stalls that explain a timeout (a CUDA graph capture that began and never finished),
    which class a watchdog cascade with one silent rank becomes, which class an exception
    no rule describes gets, which causes give way to which, the verl driver's actor names,
    and the notes that say what evidence was missing.

The folder is shared with other analyses: ``phases.yaml`` (phase attribution,
:mod:`forensics.phases`) and ``findings.yaml`` (performance findings) have schemas of their
own and are not read here; any other YAML file without a catalogue section is skipped too
(and listed in :attr:`Catalogue.skipped`).

A rule id that appears again in a later file (a user folder is read after the
built-in one) replaces the earlier rule; class entries and detector settings are
merged key by key.
"""
from __future__ import annotations

import re
try:  # Python >= 3.11 keeps the regex parser private; sre_parse is deprecated there
    from re import _constants as sre_constants, _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]
import hashlib
import logging
import os
import pickle
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable


def load_yaml(text: str | bytes) -> Any:
    """``yaml.safe_load``, with libyaml's parser when PyYAML was built with it (the
    rule, phase and finding files are read on every diagnosis). PyYAML is imported here,
    not with the module: a diagnosis that finds its catalogue in the cache needs no YAML
    on its way (start-up time)."""
    import yaml

    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


ROLES = {
    "cause": "a concrete root cause (OOM, crash, hardware fault, network error, data error, ...)",
    "fallback": "a failure that is the root cause only when no concrete cause is visible (watchdog timeout, actor death, generic exception)",
    "symptom": "a downstream effect; never the root cause",
    "context": "supporting evidence that changes the reading of other lines; never a failure by itself",
    "end": "the run reached its normal end",
    "stop": "the run was stopped on purpose (SIGINT/SIGTERM by the user)",
    "finding": "a performance or health finding that is not a failure",
}
PHASES = ("rollout", "reward", "train", "sync", "init", "other")
# extract groups: `rank` / `ranks` name another process's rank (the lagging one of a desync
# report); `own_rank` is the rank the printing process gives itself, which may be its rank
# within a sub-group: the global rank of a `[rankN]:` line prefix wins over it
GROUP_NAMES = {"rank", "own_rank", "pid", "gpu", "node", "seq", "optype", "timeout_ms", "ran_ms", "method", "ranks", "detail",
               "exc", "what", "step"}

RULE_KEYS = {
    "id", "class", "role", "weight", "title", "patterns", "keywords", "negative", "where",
    "event_context", "requires", "class_by_phase", "class_if_present", "phase", "extract",
    "describe", "remediation", "versions", "notes", "symptom", "match_code_lines", "finding",
    "exception", "generic", "examples",
}
WHERE_KEYS = {"header", "format", "level", "path", "actor", "in_traceback", "logger"}
# what an `exception:` matcher of a rule may test on a fatal event (parsers/fatal_events.py)
EXCEPTION_KEYS = {"type", "not_type", "message", "not_message", "raised_in", "not_raised_in", "frames", "not_frames",
                  "kind", "signal", "method", "actor", "preceded_by", "wrapper", "not_wrapper"}
EXAMPLE_KEYS = {"match", "no_match"}
# what rules may ask of the run beside other rules: ``run:<software>`` when the run holds
# logs of that software (forensics.diagnosis.facts.run_traits)
TRAIT_PREFIX = "run:"
CAUSALITY_KEYS = {"driver_actors", "collective_timeouts", "shutdown_noise", "stalls", "waits", "missing_rank", "unexplained",
                  "gives_way", "evidence_notes", "same_moment_s", "clearly_more_specific", "teardown_records"}
NOTE_CONDITIONS = {"no_nccl_lines", "missing_format", "dedup_lines", "root_role", "config"}
CLASS_KEYS = {"title", "remediation", "debug", "notes"}
REMEDY_KEYS = {"key", "to", "scale", "min", "max", "why", "text", "when"}
SECTIONS = {"rules", "classes", "phase_markers", "metric_detectors", "rank_zero_prints", "rank_actors", "relayed_ranks",
            "causality", "engine_args", "config_overrides"}
OVERRIDE_KEYS = {"key", "engine", "arg", "config", "default", "raise", "lower", "why", "unit"}
NOT_SIGNATURE_FILES = {"phases.yaml", "findings.yaml"}  # other analyses' files in the same folder

# Lines of Python source shown inside a traceback (``raise ValueError("...")``) repeat the
# text of the error they raise; a rule matches them only when it asks to.
CODE_LINE = r'^\s+(?:raise |assert |return |print\(|logger\.|logging\.|warnings\.warn|File "|[A-Za-z_][\w.\[\]"\']*\s*[+\-*/]?=[^=])|^\s*│\s*(?:❱\s*)?\d+\s*│'

_RULE_ID = re.compile(r"^[a-z][a-z0-9_]*$")


class SignatureError(ValueError):
    """A rule file is malformed (the message names the file and the rule)."""


@dataclass(frozen=True)
class Remedy:
    """One remediation item: a config key with a suggested value, or plain text."""

    text: str | None = None
    key: str | None = None
    to: Any = None
    scale: float | None = None
    min: float | None = None
    max: float | None = None
    why: str | None = None

    @classmethod
    def parse(cls, item: Any, where: str) -> "Remedy":
        if isinstance(item, str):
            return cls(text=item)
        if not isinstance(item, dict):
            raise SignatureError(f"{where}: a remediation item is a string or a mapping, not {type(item).__name__}")
        extra = set(item) - REMEDY_KEYS
        if extra:
            raise SignatureError(f"{where}: unknown remediation field(s) {sorted(extra)}")
        if not item.get("key") and not item.get("text"):
            raise SignatureError(f"{where}: a remediation mapping needs `key` or `text`")
        scale = item.get("scale")
        if scale is not None and not isinstance(scale, (int, float)):
            raise SignatureError(f"{where}: remediation `scale` must be a number")
        return cls(text=item.get("text"), key=item.get("key"), to=item.get("to"), scale=scale,
                   min=item.get("min"), max=item.get("max"), why=item.get("why"))


@dataclass(frozen=True)
class Rule:
    id: str
    cls: str
    role: str
    patterns: tuple[str, ...]
    keywords: tuple[str, ...]  # prefilter: literal substrings, case-sensitive
    keywords_ci: tuple[str, ...]  # prefilter: literal substrings, case-insensitive
    negative: tuple[str, ...] = ()
    where: dict[str, Any] = field(default_factory=dict)
    event_context: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    class_by_phase: dict[str, str] = field(default_factory=dict)
    class_if_present: dict[str, str] = field(default_factory=dict)
    phase: str | None = None
    extract: tuple[str, ...] = ()
    describe: str | None = None
    remediation: tuple[Remedy, ...] = ()
    weight: float = 0.8
    title: str | None = None
    versions: str | None = None
    notes: str | None = None
    symptom: bool = True
    match_code_lines: bool = False
    finding: str | None = None
    exception: "ExceptionMatch | None" = None  # matches fatal events (parsers/fatal_events.py) instead of / as well as lines
    generic: bool = False  # a cause that gives way to any specific one (an exception no class describes)
    # (match, no_match): each a (file name or None, text) — a line, or a few lines (a traceback) for `exception`
    examples: tuple[tuple[tuple[str | None, str], ...], tuple[tuple[str | None, str], ...]] = ((), ())
    source: str = ""  # file the rule came from

    def to_dict(self) -> dict:
        return {
            "id": self.id, "class": self.cls, "role": self.role, "weight": self.weight,
            "title": self.title, "patterns": list(self.patterns), "keywords": list(self.keywords) + [f"(?i){k}" for k in self.keywords_ci],
            "negative": list(self.negative), "where": self.where, "event_context": list(self.event_context),
            "requires": list(self.requires), "class_by_phase": self.class_by_phase,
            "class_if_present": self.class_if_present, "phase": self.phase, "versions": self.versions,
            "notes": self.notes, "source": self.source,
            **({"exception": {k: v for k, v in vars(self.exception).items() if v}} if self.exception else {}),
            **({"generic": True} if self.generic else {}),
        }


@dataclass(frozen=True)
class ExceptionMatch:
    """What a rule asks of a fatal event (one row of ``fatal_events``). Every given field
    must hold. Regular expressions are searched (not anchored unless they say so).

    ``type`` / ``not_type``: any of the event's exception types (dotted as printed, or their
    last component; wrapped types included). ``message`` / ``not_message``: the messages of
    the chain. ``raised_in`` / ``not_raised_in``: the package of the innermost frame of the
    root exception. ``frames`` / ``not_frames``: any frame as ``file:function``, or the
    source line a frame shows. ``kind``:
    the event kind. ``signal``: the fatal signal. ``method`` / ``actor``: the failing Ray
    task's method / actor class (or the stream's actor). ``wrapper`` / ``not_wrapper``: how
    it was reported (``RayTaskError``, ``hydra``, ``ignored``, ``atexit``, ...).
    ``preceded_by``: a line of the same file within the 200 lines before the event.
    """

    type: str | None = None
    not_type: str | None = None
    message: str | None = None
    not_message: str | None = None
    raised_in: tuple[str, ...] = ()
    not_raised_in: tuple[str, ...] = ()
    frames: str | None = None
    not_frames: str | None = None
    kind: tuple[str, ...] = ()
    signal: tuple[str, ...] = ()
    method: str | None = None
    actor: str | None = None
    wrapper: tuple[str, ...] = ()
    not_wrapper: tuple[str, ...] = ()
    preceded_by: str | None = None

    def regexes(self) -> list[str]:
        return [p for p in (self.type, self.not_type, self.message, self.not_message, self.frames, self.not_frames,
                            self.method, self.actor, self.preceded_by) if p]


@dataclass(frozen=True)
class Stall:
    """A process that logged ``started`` and never ``finished`` (rule ids), while the root
    is one of ``explains`` (classes): the others waited for it; the root becomes ``becomes``."""

    started: str
    finished: str
    explains: tuple[str, ...]
    becomes: str
    note: str


@dataclass(frozen=True)
class Wait:
    """A run whose logs end while it waits (a line of rule ``rule``, a context rule) with no
    failure, no end and no step logged after the wait began: the wait is the root cause, of
    class ``becomes``. A line of a ``finished`` rule (rule ids) after the last wait line
    says the wait ended (the barrier completed) and the run went on."""

    rule: str
    becomes: str
    note: str
    finished: tuple[str, ...] = ()


@dataclass(frozen=True)
class MissingRank:
    """A cascade of ``timeouts`` (rule ids) with root class ``source`` in which exactly one
    rank of the world never timed out (or lags in the counters): the root becomes ``becomes``."""

    source: str
    timeouts: tuple[str, ...]
    becomes: str


@dataclass(frozen=True)
class GivesWay:
    """Events of class ``cls`` give way to (become symptoms of) an event of one of ``to``
    (classes, or every class with ``any``) seen before them or within ``window_s`` after."""

    cls: str
    to: tuple[str, ...]
    window_s: float = 0.0


@dataclass(frozen=True)
class EvidenceNote:
    """A note for root causes of ``classes`` (all classes when empty) when the run's facts
    meet ``when`` (see :data:`NOTE_CONDITIONS`); ``{dedup_lines}`` in the text is filled."""

    text: str
    classes: tuple[str, ...] = ()
    when: tuple[tuple[str, Any], ...] = ()


@dataclass
class Causality:
    driver_actors: tuple[str, ...] = ()
    collective_timeouts: tuple[str, ...] = ()
    shutdown_noise: tuple[str, ...] = ()
    stalls: tuple[Stall, ...] = ()
    waits: tuple[Wait, ...] = ()
    missing_rank: tuple[MissingRank, ...] = ()
    unexplained: str | None = None
    gives_way: tuple[GivesWay, ...] = ()
    evidence_notes: tuple[EvidenceNote, ...] = ()
    teardown_records: tuple[str, ...] = ()  # RE2: a launcher's records of tearing its children down
    same_moment_s: float = 2.0
    clearly_more_specific: float = 0.2


@dataclass(frozen=True)
class ClassInfo:
    id: str
    title: str
    remediation: tuple[Remedy, ...] = ()
    debug: tuple[str, ...] = ()
    notes: str | None = None


@dataclass(frozen=True)
class ConfigOverride:
    """The engine argument ``arg`` of ``engine``, when the run set it (in the engine's printed
    arguments, or through one of the verl keys ``config``), overrides the verl key ``key``:
    advice to raise or lower ``key`` becomes advice to scale ``arg`` by ``raise_scale`` /
    ``lower_scale``. ``default``: ``key``'s default, to tell the direction of a suggested
    value when the run's own is unknown; ``unit``: ``bytes`` shows the value in MiB/GiB too."""

    key: str
    engine: str
    arg: str
    config: tuple[str, ...] = ()
    default: float | None = None
    raise_scale: float = 2.0
    lower_scale: float = 0.5
    why: str | None = None
    unit: str | None = None


@dataclass
class Catalogue:
    rules: list[Rule]
    classes: dict[str, ClassInfo]
    phase_markers: list[tuple[str, str, bool]]  # (phase, regex, override), in priority order
    metric_detectors: dict[str, Any]
    sources: list[str]
    skipped: list[str] = field(default_factory=list)  # YAML files that are not part of the catalogue
    rank_zero_prints: list[str] = field(default_factory=list)
    rank_actors: list[str] = field(default_factory=list)
    relayed_ranks: list[str] = field(default_factory=list)  # regexes with group `ranks`
    causality: Causality = field(default_factory=Causality)
    engine_args: dict[str, list[str]] = field(default_factory=dict)  # engine -> regexes with group `args`
    config_overrides: list[ConfigOverride] = field(default_factory=list)
    # per phase marker: the literals one of which each of its matches contains
    # (case-sensitive, case-insensitive), or None where none can be read (marker_keywords)
    phase_marker_keywords: list[tuple[tuple[str, ...], tuple[str, ...]] | None] = field(default_factory=list)

    def marker_keywords(self) -> list[tuple[tuple[str, ...], tuple[str, ...]] | None]:
        """``phase_marker_keywords``, one entry per phase marker: derived now when the
        catalogue was made without them (in code, not loaded from files)."""
        if len(self.phase_marker_keywords) != len(self.phase_markers):
            self.phase_marker_keywords = [_keywords_or_none(rx) for _, rx, _ in self.phase_markers]
        return self.phase_marker_keywords

    def rule(self, rule_id: str) -> Rule:
        for r in self.rules:
            if r.id == rule_id:
                return r
        raise KeyError(rule_id)

    def covered_classes(self) -> set[str]:
        out = {r.cls for r in self.rules if r.role in ("cause", "fallback", "end", "stop")}
        for r in self.rules:
            out.update(r.class_by_phase.values())
            out.update(r.class_if_present.values())
        out.update(v["class"] for v in self.metric_detectors.values() if isinstance(v, dict) and v.get("class"))
        if self.causality.unexplained:
            out.add(self.causality.unexplained)
        for st in self.causality.stalls:
            out.add(st.becomes)
        for w in self.causality.waits:
            out.add(w.becomes)
        for mr in self.causality.missing_rank:
            out.add(mr.becomes)
        return out


# -- loading ------------------------------------------------------------------------

def builtin_dir() -> Path:
    """The folder of the built-in catalogue: the package data ``forensics.signatures``
    (the repository's ``signatures/`` folder)."""
    return Path(str(resources.files("forensics.signatures")))


def load(extra_dirs: Iterable[str | Path] = (), include_builtin: bool = True) -> Catalogue:
    """Load the built-in catalogue and then each folder of ``extra_dirs`` (their rules
    override built-in rules of the same id).

    The result is kept in the cache folder (:func:`cache_dir`), under a key made of the
    files' paths and bytes, this module's own source and the Python version: the next
    command that reads the same files takes it from there (checking every pattern and
    deriving the prefilter keywords costs about 0.1 s, which every ``forensics diagnose``
    paid). A changed, added or removed file, or another version of this module, is
    another key; a folder that cannot be written only means the next load checks again."""
    dirs: list[Path] = [builtin_dir()] if include_builtin else []
    for d in extra_dirs:
        p = Path(d)
        if not p.exists():
            raise SignatureError(f"signature folder {p} does not exist")
        dirs.append(p)
    files = [(d, _yaml_files(d)) for d in dirs]
    key = _cache_key(files)
    cached = _read_cache(key)
    if cached is not None:
        return cached
    cat = _load_files(files)
    _write_cache(key, cat)
    return cat


# -- the cache of loaded catalogues ------------------------------------------------------

CACHE_ENV = "FORENSICS_CACHE_DIR"
_CACHE_FORMAT = b"catalogue cache 3"  # bumped when the Catalogue class changes
_log = logging.getLogger(__name__)


def cache_dir() -> Path | None:
    """Where loaded catalogues are kept: ``$FORENSICS_CACHE_DIR`` (empty: no cache), else
    ``$XDG_CACHE_HOME/forensics``, else ``~/.cache/forensics``."""
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return Path(env) if env else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "forensics"


def _yaml_files(d: Path) -> list[Path]:
    return [d] if d.is_file() else sorted(
        f for f in list(d.glob("*.yaml")) + list(d.glob("*.yml")) if f.name not in NOT_SIGNATURE_FILES)


def _cache_key(files: list[tuple[Path, list[Path]]]) -> str:
    h = hashlib.sha256(_CACHE_FORMAT)
    h.update(sys.version.encode())
    h.update(Path(__file__).read_bytes())
    for d, fs in files:
        h.update(b"\0dir\0" + str(d).encode())
        for f in fs:
            data = f.read_bytes()
            h.update(b"\0file\0" + str(f).encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


def _read_cache(key: str) -> "Catalogue | None":
    folder = cache_dir()
    if folder is None:
        return None
    path = folder / f"catalogue-{key}.pickle"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        _log.debug("catalogue cache %s not readable (%s): loading the files", path, exc)
        return None
    try:
        cat = pickle.loads(data)
    except Exception as exc:  # a file cut short or of another layout: load the files again
        _log.debug("catalogue cache %s not usable (%s): loading the files", path, exc)
        return None
    return cat if isinstance(cat, Catalogue) else None


def _write_cache(key: str, cat: "Catalogue") -> None:
    folder = cache_dir()
    if folder is None:
        return
    path = folder / f"catalogue-{key}.pickle"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("catalogue-*.pickle"):  # other versions' entries
            try:
                if old != path and time.time() - old.stat().st_mtime > _CACHE_KEEP_S:
                    old.unlink()
            except FileNotFoundError:  # another command removed it first
                continue
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".catalogue-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                pickle.dump(cat, out, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)  # whole or not at all, also with concurrent commands
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        _log.debug("catalogue cache %s not written (%s): the next load checks the files again", path, exc)


_CACHE_KEEP_S = 7 * 86400  # entries of other keys older than this are removed when one is written


def _load_files(files: list[tuple[Path, list[Path]]]) -> Catalogue:
    import yaml

    raw_rules: dict[str, tuple[dict, str]] = {}
    classes: dict[str, dict] = {}
    markers: list[tuple[str, str]] = []
    detectors: dict[str, Any] = {}
    rank_zero: list[str] = []
    rank_actors: list[str] = []
    relayed: list[str] = []
    causality_raw: dict[str, tuple[Any, str]] = {}
    engine_args: dict[str, list[str]] = {}
    overrides: dict[tuple[str, str, str], ConfigOverride] = {}
    sources: list[str] = []
    skipped: list[str] = []
    for _, fs in files:
        for f in fs:
            sources.append(str(f))
            try:
                doc = load_yaml(f.read_text(encoding="utf-8"))
            except yaml.YAMLError as exc:
                raise SignatureError(f"{f}: not valid YAML: {exc}") from None
            if not isinstance(doc, dict) or not set(doc) & SECTIONS or _foreign_rules(doc):
                skipped.append(str(f))
                sources.remove(str(f))
                continue
            unknown = set(doc) - SECTIONS
            if unknown:
                raise SignatureError(f"{f}: unknown section(s) {sorted(unknown)}; known: {sorted(SECTIONS)}")
            for item in doc.get("rules") or []:
                if not isinstance(item, dict) or "id" not in item:
                    raise SignatureError(f"{f}: every rule is a mapping with an `id`")
                raw_rules[str(item["id"])] = (item, str(f))
            for cid, info in (doc.get("classes") or {}).items():
                if not isinstance(info, dict):
                    raise SignatureError(f"{f}: class {cid}: expected a mapping")
                classes.setdefault(cid, {}).update(info)
            for item in doc.get("phase_markers") or []:
                if not isinstance(item, dict) or item.get("phase") not in PHASES or not item.get("patterns") \
                        or set(item) - {"phase", "patterns", "override"}:
                    raise SignatureError(f"{f}: a phase marker is {{phase: one of {PHASES}, patterns: [...], override: bool}}")
                for pat in item["patterns"]:
                    _compile(pat, f"{f}: phase marker {item['phase']}")
                    markers.append((item["phase"], pat, bool(item.get("override", False))))
            for pat in doc.get("rank_zero_prints") or []:
                _compile(pat, f"{f}: rank_zero_prints")
                rank_zero.append(pat)
            for pat in doc.get("rank_actors") or []:
                _compile(pat, f"{f}: rank_actors")
                rank_actors.append(pat)
            for pat in doc.get("relayed_ranks") or []:
                _compile_with_group(pat, "ranks", f"{f}: relayed_ranks")
                relayed.append(pat)
            for engine, pats in (doc.get("engine_args") or {}).items():
                for pat in _as_list(pats, f"{f}: engine_args.{engine}", "patterns"):
                    _compile_with_group(pat, "args", f"{f}: engine_args.{engine}")
                    engine_args.setdefault(str(engine), []).append(pat)
            for item in doc.get("config_overrides") or []:
                o = _override(item, f"{f}: config_overrides")
                overrides[(o.key, o.engine, o.arg)] = o  # a later file replaces the same relation
            causal = doc.get("causality") or {}
            if not isinstance(causal, dict) or set(causal) - CAUSALITY_KEYS:
                raise SignatureError(f"{f}: `causality` is a mapping with keys from {sorted(CAUSALITY_KEYS)}")
            for key, value in causal.items():
                causality_raw[key] = (value, str(f))  # a later file (a user folder) replaces the key
            for name, conf in (doc.get("metric_detectors") or {}).items():
                if isinstance(conf, dict) and isinstance(detectors.get(name), dict):
                    detectors[name] = {**detectors[name], **conf}
                else:
                    detectors[name] = conf
    class_infos = {cid: _class_info(cid, info) for cid, info in classes.items()}
    rules = [_rule(item, src, set(class_infos)) for item, src in raw_rules.values()]
    ids = {r.id for r in rules}
    for r in rules:
        for other in (*r.requires, *r.class_if_present):
            if other not in ids and not other.startswith(TRAIT_PREFIX):
                raise SignatureError(f"{r.source}: rule {r.id}: refers to unknown rule {other!r}")
    for name, conf in detectors.items():
        if isinstance(conf, dict) and conf.get("class") is not None and conf["class"] not in class_infos:
            raise SignatureError(f"metric_detectors.{name}: class {conf['class']!r} is not a taxonomy class")
    causality = _causality(causality_raw, ids, set(class_infos))
    return Catalogue(rules=rules, classes=class_infos, phase_markers=markers, metric_detectors=detectors,
                     sources=sources, skipped=skipped, rank_zero_prints=rank_zero,
                     rank_actors=rank_actors, relayed_ranks=relayed, causality=causality, engine_args=engine_args,
                     config_overrides=list(overrides.values()),
                     phase_marker_keywords=[_keywords_or_none(rx) for _, rx, _ in markers])


def _override(item: Any, where: str) -> ConfigOverride:
    if not isinstance(item, dict) or not {"key", "engine", "arg"} <= set(item) or set(item) - OVERRIDE_KEYS:
        raise SignatureError(f"{where}: an override is a mapping with key, engine, arg (and {sorted(OVERRIDE_KEYS - {'key', 'engine', 'arg'})})")
    for name in ("raise", "lower", "default"):
        if item.get(name) is not None and not isinstance(item[name], (int, float)):
            raise SignatureError(f"{where}: {item['arg']}: `{name}` must be a number")
    return ConfigOverride(key=str(item["key"]), engine=str(item["engine"]), arg=str(item["arg"]),
                          config=_as_list(item.get("config"), where, "config"), default=item.get("default"),
                          raise_scale=float(item.get("raise", 2.0)), lower_scale=float(item.get("lower", 0.5)),
                          why=item.get("why"), unit=item.get("unit"))


def _causality(raw: dict[str, tuple[Any, str]], rule_ids: set[str], classes: set[str]) -> Causality:
    """The ``causality`` section, every rule and class it names checked."""
    def where(key: str) -> str:
        return f"{raw[key][1]}: causality.{key}"

    def names(key: str, value: Any, known: set[str] | None, what: str) -> tuple[str, ...]:
        items = _as_list(value, where(key), key)
        if known is not None:
            bad = [x for x in items if x not in known]
            if bad:
                raise SignatureError(f"{where(key)}: unknown {what} {bad}")
        return items

    def mapping(key: str, item: Any, required: set[str], optional: set[str] = frozenset()) -> dict:
        if not isinstance(item, dict) or set(item) - required - optional or required - set(item):
            raise SignatureError(f"{where(key)}: each entry is a mapping with {sorted(required)}"
                                 + (f" and optionally {sorted(optional)}" if optional else ""))
        return item

    out = Causality()
    for key, (value, _src) in raw.items():
        if key == "driver_actors":
            out.driver_actors = names(key, value, None, "")
        elif key == "teardown_records":
            out.teardown_records = names(key, value, None, "")
        elif key == "collective_timeouts":
            out.collective_timeouts = names(key, value, rule_ids, "rule(s)")
        elif key == "shutdown_noise":
            out.shutdown_noise = names(key, value, classes, "class(es)")
        elif key == "unexplained":
            out.unexplained = names(key, value, classes, "class")[0] if value else None
        elif key in ("same_moment_s", "clearly_more_specific"):
            if not isinstance(value, (int, float)) or value < 0:
                raise SignatureError(f"{where(key)}: a number >= 0")
            setattr(out, key, float(value))
        elif key == "stalls":
            stalls = []
            for item in value or []:
                m = mapping(key, item, {"started", "finished", "explains", "becomes", "note"})
                names(key, [m["started"], m["finished"]], rule_ids, "rule(s)")
                stalls.append(Stall(m["started"], m["finished"], names(key, m["explains"], classes, "class(es)"),
                                    names(key, m["becomes"], classes, "class")[0], str(m["note"])))
            out.stalls = tuple(stalls)
        elif key == "waits":
            waits = []
            for item in value or []:
                m = mapping(key, item, {"rule", "becomes", "note"}, {"finished"})
                waits.append(Wait(names(key, m["rule"], rule_ids, "rule")[0], names(key, m["becomes"], classes, "class")[0],
                                  str(m["note"]), names(key, m["finished"], rule_ids, "rule(s)") if m.get("finished") else ()))
            out.waits = tuple(waits)
        elif key == "missing_rank":
            out.missing_rank = tuple(
                MissingRank(names(key, m["from"], classes, "class")[0], names(key, m["timeouts"], rule_ids, "rule(s)"),
                            names(key, m["becomes"], classes, "class")[0])
                for m in (mapping(key, item, {"from", "timeouts", "becomes"}) for item in value or []))
        elif key == "gives_way":
            gw = []
            for item in value or []:
                m = mapping(key, item, {"class", "to"}, {"window_s"})
                to = ("any",) if m["to"] == "any" else names(key, m["to"], classes, "class(es)")
                gw.append(GivesWay(names(key, m["class"], classes, "class")[0], to, float(m.get("window_s") or 0)))
            out.gives_way = tuple(gw)
        elif key == "evidence_notes":
            notes = []
            for item in value or []:
                m = mapping(key, item, {"note"}, {"classes", "when"})
                when = m.get("when") or {}
                if not isinstance(when, dict) or set(when) - NOTE_CONDITIONS:
                    raise SignatureError(f"{where(key)}: `when` takes {sorted(NOTE_CONDITIONS)}")
                notes.append(EvidenceNote(str(m["note"]), names(key, m.get("classes") or [], classes, "class(es)"),
                                          tuple(sorted(when.items()))))
            out.evidence_notes = tuple(notes)
    return out


def _foreign_rules(doc: dict) -> bool:
    """A ``rules`` list whose items carry no ``id`` belongs to another schema."""
    rules = doc.get("rules")
    return isinstance(rules, list) and bool(rules) and not any(isinstance(r, dict) and "id" in r for r in rules) \
        and not (set(doc) - {"rules", "settings"}) & SECTIONS


def _class_info(cid: str, info: dict) -> ClassInfo:
    extra = set(info) - CLASS_KEYS
    if extra:
        raise SignatureError(f"class {cid}: unknown field(s) {sorted(extra)}")
    return ClassInfo(
        id=cid,
        title=str(info.get("title") or cid),
        remediation=tuple(Remedy.parse(x, f"class {cid}") for x in info.get("remediation") or ()),
        debug=tuple(str(x) for x in info.get("debug") or ()),
        notes=info.get("notes"),
    )


def _as_list(value: Any, where: str, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise SignatureError(f"{where}: `{name}` must be a string or a list of strings")


def _rule(item: dict, src: str, known_classes: set[str]) -> Rule:
    rid = str(item.get("id"))
    where = f"{src}: rule {rid}"
    extra = set(item) - RULE_KEYS
    if extra:
        raise SignatureError(f"{where}: unknown field(s) {sorted(extra)}")
    if not _RULE_ID.match(rid):
        raise SignatureError(f"{where}: ids are lower_snake_case")
    cls = item.get("class")
    if cls not in known_classes:
        raise SignatureError(f"{where}: class {cls!r} is not a taxonomy class (known: {sorted(known_classes)})")
    role = item.get("role")
    if role not in ROLES:
        raise SignatureError(f"{where}: role {role!r} is not one of {sorted(ROLES)}")
    patterns = _as_list(item.get("patterns"), where, "patterns")
    exc = _exception_match(item.get("exception"), where)
    if not patterns and exc is None:
        raise SignatureError(f"{where}: needs at least one pattern, or an `exception` matcher")
    for p in patterns:
        _compile(p, where)
    negative = _as_list(item.get("negative"), where, "negative")
    for p in negative:
        _compile(p, where)
    ctx = _as_list(item.get("event_context"), where, "event_context")
    for p in ctx:
        _compile(p, where)
    extract = _as_list(item.get("extract"), where, "extract")
    for p in extract:
        rx = _compile(p, where)
        bad = set(rx.groupindex) - GROUP_NAMES
        if bad:
            raise SignatureError(f"{where}: extract group(s) {sorted(bad)} unknown; use {sorted(GROUP_NAMES)}")
    kws = _as_list(item.get("keywords"), where, "keywords")
    if kws:
        cs = tuple(k for k in kws if not k.startswith("(?i)"))
        ci = tuple(k[4:] for k in kws if k.startswith("(?i)"))
    elif patterns:
        cs, ci = derive_keywords(patterns, where)
    else:
        cs, ci = (), ()
    w = item.get("where") or {}
    if not isinstance(w, dict) or set(w) - WHERE_KEYS:
        raise SignatureError(f"{where}: `where` takes {sorted(WHERE_KEYS)}")
    for k, v in list(w.items()):
        if k == "in_traceback":
            if not isinstance(v, bool):
                raise SignatureError(f"{where}: where.in_traceback is true or false")
        elif k in ("path", "logger"):
            w[k] = str(v)
        else:
            w[k] = list(_as_list(v, where, f"where.{k}"))
    for k in ("path", "logger"):
        if k in w:
            _compile(w[k], where)
    examples = item.get("examples") or {}
    if not isinstance(examples, dict) or set(examples) - EXAMPLE_KEYS:
        raise SignatureError(f"{where}: `examples` is a mapping with `match` and/or `no_match` lists")
    cbp = item.get("class_by_phase") or {}
    cip = item.get("class_if_present") or {}
    for mapping, name in ((cbp, "class_by_phase"), (cip, "class_if_present")):
        if not isinstance(mapping, dict):
            raise SignatureError(f"{where}: `{name}` is a mapping")
        for v in mapping.values():
            if v not in known_classes:
                raise SignatureError(f"{where}: `{name}` names unknown class {v!r}")
    for ph in cbp:
        if ph not in PHASES and ph != "default":
            raise SignatureError(f"{where}: class_by_phase key {ph!r} is not a phase {PHASES}")
    phase = item.get("phase")
    if phase is not None and phase not in PHASES:
        raise SignatureError(f"{where}: phase {phase!r} is not one of {PHASES}")
    weight = item.get("weight", 0.8)
    if not isinstance(weight, (int, float)) or not 0 < weight <= 1:
        raise SignatureError(f"{where}: weight must be in (0, 1]")
    return Rule(
        id=rid, cls=cls, role=role, patterns=patterns, keywords=cs, keywords_ci=ci, negative=negative,
        where=w, event_context=ctx, requires=_as_list(item.get("requires"), where, "requires"),
        class_by_phase=dict(cbp), class_if_present=dict(cip), phase=phase, extract=extract,
        describe=item.get("describe"),
        remediation=tuple(Remedy.parse(x, where) for x in item.get("remediation") or ()),
        weight=float(weight), title=item.get("title"), versions=item.get("versions"), notes=item.get("notes"),
        symptom=bool(item.get("symptom", True)), match_code_lines=bool(item.get("match_code_lines", False)),
        finding=item.get("finding"), exception=exc, generic=bool(item.get("generic", False)),
        examples=(_examples(examples.get("match"), where, "match"), _examples(examples.get("no_match"), where, "no_match")),
        source=src,
    )


def _examples(value: Any, where: str, key: str) -> tuple[tuple[str | None, str], ...]:
    """Example texts of a rule: strings, or ``{file: name, text: ...}`` when the file name
    matters (a rule restricted to a format the name helps detect, e.g. ``raylet.out``)."""
    out = []
    for item in [value] if isinstance(value, (str, dict)) else (value or []):
        if isinstance(item, str) and item:
            out.append((None, item))
        elif isinstance(item, dict) and set(item) == {"file", "text"} and all(isinstance(v, str) and v for v in item.values()):
            out.append((item["file"], item["text"]))
        else:
            raise SignatureError(f"{where}: examples.{key} holds strings or {{file, text}} mappings")
    return tuple(out)


def _exception_match(value: Any, where: str) -> ExceptionMatch | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not value or set(value) - EXCEPTION_KEYS:
        raise SignatureError(f"{where}: `exception` is a non-empty mapping with keys from {sorted(EXCEPTION_KEYS)}")
    lists = {"raised_in", "not_raised_in", "kind", "signal", "wrapper", "not_wrapper"}
    kw = {}
    for k, v in value.items():
        if k in lists:
            kw[k] = _as_list(v, where, f"exception.{k}")
        else:
            if not isinstance(v, str) or not v:
                raise SignatureError(f"{where}: exception.{k} is a regular expression")
            _compile(v, where)
            kw[k] = v
    return ExceptionMatch(**kw)


def _compile(pattern: str, where: str) -> re.Pattern:
    if not isinstance(pattern, str) or not pattern:
        raise SignatureError(f"{where}: empty or non-string pattern")
    if re.search(r"\(\?[=!<]|\\[1-9]|\(\?P=", pattern):
        raise SignatureError(f"{where}: pattern {pattern!r} uses look-around or back-references, which RE2 (DuckDB) does not support")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise SignatureError(f"{where}: bad regular expression {pattern!r}: {exc}") from None


def _compile_with_group(pattern: str, group: str, where: str) -> re.Pattern:
    """:func:`_compile` of a pattern whose named group ``group`` the diagnosis reads."""
    if f"(?P<{group}>" not in pattern:
        raise SignatureError(f"{where}: a pattern needs the group (?P<{group}>...)")
    return _compile(pattern, where)


# -- keyword derivation ---------------------------------------------------------------

_MIN_KEYWORD = 4


def derive_keywords(patterns: Iterable[str], where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """For each pattern, literal strings one of which every match must contain.

    Returns (case-sensitive keywords, case-insensitive keywords). An alternation
    contributes one literal per branch. A pattern from which no literal of at least four
    characters can be read needs explicit ``keywords``.
    """
    cs: list[str] = []
    ci: list[str] = []
    for p in patterns:
        flags_ci = bool(re.match(r"^\(\?[a-z]*i[a-z]*\)", p))
        try:
            parsed = sre_parse.parse(p)
        except (re.error, sre_constants.error) as exc:  # pragma: no cover - caught by _compile first
            raise SignatureError(f"{where}: {exc}") from None
        found = _required_literals(list(parsed))
        if not found or min(len(k) for k in found) < _MIN_KEYWORD:
            raise SignatureError(
                f"{where}: cannot derive a prefilter keyword of >= {_MIN_KEYWORD} literal characters from {p!r}; add `keywords`"
            )
        (ci if flags_ci else cs).extend(found)
    return tuple(dict.fromkeys(cs)), tuple(dict.fromkeys(ci))


def _keywords_or_none(pattern: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """:func:`derive_keywords` of one pattern, or None when it has no literal to require
    (the pattern is then tried on every text)."""
    try:
        return derive_keywords([pattern], "")
    except SignatureError:
        return None


def _required_literals(items: list) -> list[str]:
    """Alternatives of literals such that every match of ``items`` contains one of them;
    the option whose shortest literal is longest. Empty when nothing can be said."""
    options: list[list[str]] = []
    run = ""
    for op, av in items:
        if op == sre_constants.LITERAL:
            run += chr(av)
            continue
        if run:
            options.append([run])
            run = ""
        if op == sre_constants.SUBPATTERN:
            # a group with its own case-insensitive flag, (?i:...), requires no literal as written
            sub = [] if av[1] & sre_constants.SRE_FLAG_IGNORECASE else _required_literals(list(av[-1]))
            if sub:
                options.append(sub)
        elif op == sre_constants.BRANCH:
            subs = [_required_literals(list(b)) for b in av[1]]
            if all(subs):
                options.append([k for sub in subs for k in sub])
        elif op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT) and av[0] >= 1:
            sub = _required_literals(list(av[2]))
            if sub:
                options.append(sub)
    if run:
        options.append([run])
    if not options:
        return []
    return max(options, key=lambda ks: (min(len(k) for k in ks), -len(ks)))


def check_with_duckdb(cat: Catalogue, con=None) -> None:
    """Compile every regular expression with DuckDB's RE2 (the engine that runs them)."""
    import duckdb

    own = con is None
    con = con or duckdb.connect()
    # (where, pattern): every regular expression the diagnosis hands to DuckDB or reads as RE2
    patterns = [(f"{r.source}: rule {r.id}", p) for r in cat.rules
                for p in (*r.patterns, *r.negative, *r.event_context, *r.extract, *([r.where["logger"]] if r.where.get("logger") else []))]
    patterns += [(f"phase marker {phase}", p) for phase, p, _ in cat.phase_markers]
    patterns += [("causality.teardown_records", p) for p in cat.causality.teardown_records]
    patterns += [("relayed_ranks", p) for p in cat.relayed_ranks]
    try:
        for where, p in patterns:
            try:
                con.execute("SELECT regexp_matches('', ?)", [p]).fetchall()
            except duckdb.Error as exc:
                raise SignatureError(f"{where}: RE2 rejects {p!r}: {exc}") from None
    finally:
        if own:
            con.close()


def escape_re2(literal: str) -> str:
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", literal)


def prefilter_regex(rules: Iterable[Rule]) -> str:
    """One RE2 alternation of every rule's keywords: a line that matches none of them
    cannot match any rule."""
    cs: list[str] = []
    ci: list[str] = []
    for r in rules:
        cs.extend(r.keywords)
        ci.extend(r.keywords_ci)
    parts = [escape_re2(k) for k in dict.fromkeys(cs)]
    if ci:
        parts.append("(?i:" + "|".join(escape_re2(k) for k in dict.fromkeys(ci)) + ")")
    return "|".join(parts)
