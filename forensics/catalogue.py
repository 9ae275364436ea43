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
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

import yaml

_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when built with it


def load_yaml(text: str | bytes) -> Any:
    """``yaml.safe_load``, with libyaml's parser when PyYAML was built with it (the
    rule, phase and finding files are read on every diagnosis)."""
    return yaml.load(text, Loader=_YAML_LOADER)


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
GROUP_NAMES = {"rank", "pid", "gpu", "node", "seq", "optype", "timeout_ms", "ran_ms", "method", "ranks", "detail", "exc", "what", "step"}

RULE_KEYS = {
    "id", "class", "role", "weight", "title", "patterns", "keywords", "negative", "where",
    "event_context", "requires", "class_by_phase", "class_if_present", "phase", "extract",
    "describe", "remediation", "versions", "notes", "symptom", "match_code_lines", "finding",
}
WHERE_KEYS = {"header", "format", "level", "path", "actor", "in_traceback"}
CLASS_KEYS = {"title", "remediation", "debug", "notes"}
REMEDY_KEYS = {"key", "to", "scale", "min", "max", "why", "text", "when"}
SECTIONS = {"rules", "classes", "phase_markers", "metric_detectors", "rank_zero_prints", "rank_actors"}
NOT_SIGNATURE_FILES = {"phases.yaml", "findings.yaml"}  # other analyses' files in the same folder

# Lines of Python source shown inside a traceback (``raise ValueError("...")``) repeat the
# text of the error they raise; a rule matches them only when it asks to.
CODE_LINE = r'^\s+(?:raise |assert |return |print\(|logger\.|logging\.|warnings\.warn|File "|[A-Za-z_][\w.\[\]"\']*\s*[+\-*/]?=[^=])'

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
    source: str = ""  # file the rule came from

    def to_dict(self) -> dict:
        return {
            "id": self.id, "class": self.cls, "role": self.role, "weight": self.weight,
            "title": self.title, "patterns": list(self.patterns), "keywords": list(self.keywords) + [f"(?i){k}" for k in self.keywords_ci],
            "negative": list(self.negative), "where": self.where, "event_context": list(self.event_context),
            "requires": list(self.requires), "class_by_phase": self.class_by_phase,
            "class_if_present": self.class_if_present, "phase": self.phase, "versions": self.versions,
            "notes": self.notes, "source": self.source,
        }


@dataclass(frozen=True)
class ClassInfo:
    id: str
    title: str
    remediation: tuple[Remedy, ...] = ()
    debug: tuple[str, ...] = ()
    notes: str | None = None


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
        out.update(k for k, v in self.metric_detectors.items() if isinstance(v, dict))
        return out


# -- loading ------------------------------------------------------------------------

def builtin_dir() -> Path:
    """The folder of the built-in catalogue: the package data ``forensics.signatures``
    (the repository's ``signatures/`` folder)."""
    return Path(str(resources.files("forensics.signatures")))


def load(extra_dirs: Iterable[str | Path] = (), include_builtin: bool = True) -> Catalogue:
    """Load the built-in catalogue and then each folder of ``extra_dirs`` (their rules
    override built-in rules of the same id)."""
    dirs: list[Path] = [builtin_dir()] if include_builtin else []
    for d in extra_dirs:
        p = Path(d)
        if not p.exists():
            raise SignatureError(f"signature folder {p} does not exist")
        dirs.append(p)
    raw_rules: dict[str, tuple[dict, str]] = {}
    classes: dict[str, dict] = {}
    markers: list[tuple[str, str]] = []
    detectors: dict[str, Any] = {}
    rank_zero: list[str] = []
    rank_actors: list[str] = []
    sources: list[str] = []
    skipped: list[str] = []
    for d in dirs:
        files = [d] if d.is_file() else sorted(
            f for f in list(d.glob("*.yaml")) + list(d.glob("*.yml")) if f.name not in NOT_SIGNATURE_FILES)
        for f in files:
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
            if other not in ids:
                raise SignatureError(f"{r.source}: rule {r.id}: refers to unknown rule {other!r}")
    return Catalogue(rules=rules, classes=class_infos, phase_markers=markers, metric_detectors=detectors,
                     sources=sources, skipped=skipped, rank_zero_prints=rank_zero,
                     rank_actors=rank_actors)


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
    if not patterns:
        raise SignatureError(f"{where}: needs at least one pattern")
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
    else:
        cs, ci = derive_keywords(patterns, where)
    w = item.get("where") or {}
    if not isinstance(w, dict) or set(w) - WHERE_KEYS:
        raise SignatureError(f"{where}: `where` takes {sorted(WHERE_KEYS)}")
    for k, v in list(w.items()):
        if k == "in_traceback":
            if not isinstance(v, bool):
                raise SignatureError(f"{where}: where.in_traceback is true or false")
        elif k == "path":
            w[k] = str(v)
        else:
            w[k] = list(_as_list(v, where, f"where.{k}"))
    if "path" in w:
        _compile(w["path"], where)
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
        finding=item.get("finding"), source=src,
    )


def _compile(pattern: str, where: str) -> re.Pattern:
    if not isinstance(pattern, str) or not pattern:
        raise SignatureError(f"{where}: empty or non-string pattern")
    if re.search(r"\(\?[=!<]|\\[1-9]|\(\?P=", pattern):
        raise SignatureError(f"{where}: pattern {pattern!r} uses look-around or back-references, which RE2 (DuckDB) does not support")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise SignatureError(f"{where}: bad regular expression {pattern!r}: {exc}") from None


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
            sub = _required_literals(list(av[-1]))
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
    try:
        for r in cat.rules:
            for p in (*r.patterns, *r.negative, *r.event_context, *r.extract):
                try:
                    con.execute("SELECT regexp_matches('', ?)", [p]).fetchall()
                except duckdb.Error as exc:
                    raise SignatureError(f"{r.source}: rule {r.id}: RE2 rejects {p!r}: {exc}") from None
        for phase, p, _ in cat.phase_markers:
            try:
                con.execute("SELECT regexp_matches('', ?)", [p]).fetchall()
            except duckdb.Error as exc:
                raise SignatureError(f"phase marker {phase}: RE2 rejects {p!r}: {exc}") from None
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
