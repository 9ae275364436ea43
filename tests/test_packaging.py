"""One import name: what gets installed, and how the package's modules import each other."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")
    out = tmp_path_factory.mktemp("wheel")
    # built from a copy of the project's own files: an in-tree build would leave a build/
    # folder in the checkout whose stale files a later `pip install .` would install too
    src = tmp_path_factory.mktemp("src") / "forensics"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info",
                                                            "__pycache__", ".pytest_cache", "bench", "tests", "examples"))
    # the installed setuptools, no download: the build must work from the project's own files
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
                       capture_output=True, text=True, cwd=out)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("forensics-*.whl")
    return whl


def test_wheel_has_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"forensics", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    assert "forensics/parsers/__init__.py" in names and "forensics/parsers/text.py" in names
    assert "forensics/signatures/classes.yaml" in names  # the rules, as package data
    assert any(n.startswith("forensics/sql/") and n.endswith(".sql") for n in names)
    # every module of the source tree is in the wheel (a sub-package left out of pyproject's
    # list would be missing from a plain `pip install .` while an editable one still works)
    want = {f"forensics/{p.relative_to(REPO / 'forensics').as_posix()}" for p in (REPO / "forensics").rglob("*.py")}
    want |= {f"forensics/parsers/{p.relative_to(REPO / 'parsers').as_posix()}" for p in (REPO / "parsers").rglob("*.py")}
    missing = sorted(w for w in want if "__pycache__" not in w and w not in names)
    assert not missing, f"not in the wheel: {missing}"


def test_installed_wheel_has_no_top_level_parsers(wheel, tmp_path):
    """In a fresh environment holding only the wheel (its dependencies reached through a path
    entry, not this checkout), ``forensics.parsers`` imports and ``parsers`` does not."""
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env)
    site = next(env.glob("lib/python*/site-packages"))
    zipfile.ZipFile(wheel).extractall(site)  # a pure wheel installs by unpacking
    deps = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (site / "_deps.pth").write_text("\n".join(deps) + "\n")  # a path line: no editable finder of ours runs
    py = env / "bin" / "python"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    code = ("import forensics, forensics.parsers, forensics.parsers.text, forensics.catalogue as c;"
            "print(forensics.__file__); print(forensics.parsers.__file__); print(len(c.load().rules));"
            "print(len(forensics.parsers.formats()), len(forensics.parsers.line_formats()))")
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=outside)
    assert r.returncode == 0, r.stderr[-2000:]
    first, second, rules, formats, line_formats = r.stdout.split()
    assert str(site) in first and str(site) in second and int(rules) > 10
    # every built-in format module is in the wheel (the line formats in their sub-package)
    import forensics.parsers
    assert (int(formats), int(line_formats)) == (len(forensics.parsers.formats()), len(forensics.parsers.line_formats()))
    for name in ("parsers", "signatures"):
        r = subprocess.run([str(py), "-c", f"import {name}"], capture_output=True, text=True, cwd=outside)
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, (name, r.stdout, r.stderr)


def test_checkout_imports_map_to_the_root_folders():
    """Run from the checkout, forensics.parsers is the repository's parsers/ folder."""
    import forensics.parsers
    import forensics.signatures

    assert Path(forensics.parsers.__file__).resolve().parent.name == "parsers"
    assert (Path(forensics.signatures.__file__).resolve().parent / "classes.yaml").is_file()


# -- import graph ----------------------------------------------------------------------

def _modules() -> dict[str, tuple[Path, bool]]:
    mods: dict[str, tuple[Path, bool]] = {}
    for base, pkg in ((REPO / "forensics", "forensics"), (REPO / "parsers", "forensics.parsers")):
        for p in base.rglob("*.py"):
            parts = [x for x in p.relative_to(base).with_suffix("").parts if x != "__init__"]
            mods[".".join([pkg, *parts])] = (p, p.name == "__init__.py")
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports, at module level or inside functions."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, (path, is_pkg) in mods.items():
        pkg = m if is_pkg else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for a in node.names:
                    full = f"{base}.{a.name}"
                    if full in mods:
                        edges[m].add(full)
                    elif base in mods:
                        edges[m].add(base)
        edges[m].discard(m)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_nothing_imports_top_level_parsers_or_signatures():
    bad = []
    for m, (path, _) in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{m}: {n}" for n in names if n.split(".")[0] in ("parsers", "signatures")]
    for p in list((REPO / "tests").glob("*.py")) + list((REPO / "tools").glob("*.py")) + list((REPO / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                bad += [f"{p.name}: {a.name}" for a in node.names if a.name.split(".")[0] in ("parsers", "signatures")]
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in ("parsers", "signatures"):
                bad.append(f"{p.name}: {node.module}")
    assert not bad


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_parsers_layering():
    """What may import what in forensics.parsers: the declarations (base) and the stored
    rows' conventions import nothing of the package, the shared header helpers (lines.common)
    only the conventions; the registry only the declarations (it finds the format modules by
    name); no format module but the text splitter asks the registry; nothing in parsers
    imports the rest of forensics."""
    graph = import_graph()
    p = "forensics.parsers"
    assert graph[f"{p}.base"] == set() and graph[f"{p}.conventions"] == set()
    assert graph[f"{p}.lines.common"] == {f"{p}.conventions"}
    assert graph[f"{p}.registry"] == {f"{p}.base"}
    from forensics.parsers import registry

    for name in registry.BUILTIN:
        uses = graph[f"{p}.{name}"]
        assert (f"{p}.registry" in uses) == (name == registry.SPLITTER), name
    for m, uses in graph.items():
        if m.startswith(p):
            assert all(u.startswith(p) for u in uses), (m, uses)
