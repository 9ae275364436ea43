"""Failure knowledge is data: no rule or class id appears in the Python code, outside the
code that loads the rule files (forensics/catalogue.py). Which rule demotes which, what is
teardown noise, which class an unexplained crash gets, per-class advice: all in
signatures/*.yaml, where a user's --signatures folder can extend it."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from forensics import catalogue as sig

REPO = Path(__file__).resolve().parent.parent
TAXONOMY = REPO.parent / "shared" / "taxonomy.yaml"
LOADER = REPO / "forensics" / "catalogue.py"
# the verdict words of the contract (`healthy` is also the class of a healthy label): named once
VERDICTS = (REPO / "forensics" / "diagnosis" / "model.py", 'FAILED, HEALTHY, INCOMPLETE = "failed", "healthy", "incomplete"')


def _ids() -> set[str]:
    cat = sig.load()
    ids = {r.id for r in cat.rules} | set(cat.classes)
    if TAXONOMY.exists():
        ids |= set(re.findall(r"^  ([a-z_]+):", TAXONOMY.read_text(), flags=re.M))
    return ids


def _string_constants(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_no_rule_or_class_id_in_python():
    ids = _ids()
    found = []
    for path in sorted([*(REPO / "forensics").rglob("*.py"), *(REPO / "parsers").rglob("*.py")]):
        if path == LOADER:
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for lineno, value in _string_constants(path):
            if value in ids:
                if path == VERDICTS[0] and lines[lineno - 1].strip() == VERDICTS[1]:
                    continue
                found.append(f"{path.relative_to(REPO)}:{lineno}: {value!r}")
    assert not found, "rule/class ids in code (move them to signatures/):\n" + "\n".join(found)


def test_the_scan_finds_an_id(tmp_path):
    """The scan itself sees a quoted id."""
    p = tmp_path / "x.py"
    p.write_text('ROOT = "nccl_timeout"\n')
    assert ("nccl_timeout" in {v for _, v in _string_constants(p)}) and "nccl_timeout" in _ids()
