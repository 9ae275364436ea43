"""docs/cli.md keeps up with the command line: every command and option is documented, no
option is documented that does not exist, and every example parses.

Add a command or an option and this fails until docs/cli.md says what it does.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.core import TyperArgument, TyperOption
from typer.testing import CliRunner

try:  # typer >= 0.2x vendors click
    from typer._click.exceptions import UsageError
except ImportError:  # older typer runs on click itself
    from click.exceptions import UsageError

from forensics.api import Run
from forensics.cli import app

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
ROOT = typer.main.get_command(app)
COMMANDS = sorted(ROOT.commands)
_HEADING = re.compile(r"^## `forensics ([a-z-]+)`\s*$", re.M)
_OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _doc() -> str:
    return DOC.read_text()


def _sections() -> dict[str, str]:
    """{command: its section of docs/cli.md} (from its `## forensics CMD` heading to the next `## `)."""
    text = _doc()
    heads = list(_HEADING.finditer(text))
    out = {}
    for i, m in enumerate(heads):
        end = text.find("\n## ", m.end())
        out[m.group(1)] = text[m.end(): end if end >= 0 else len(text)]
        assert i == 0 or heads[i - 1].start() < m.start()
    return out


def _options(cmd) -> list[TyperOption]:
    return [p for p in cmd.params if isinstance(p, TyperOption)]


def _examples(section: str) -> list[list[str]]:
    """The `forensics ...` command lines of the section's ```bash blocks, as argv lists."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("forensics "):
                out.append(shlex.split(line)[1:])
    return out


def test_every_command_has_a_section():
    documented = set(_sections())
    missing = [c for c in COMMANDS if c not in documented]
    assert not missing, f"docs/cli.md has no '## `forensics CMD`' section for: {missing}"
    stale = documented - set(COMMANDS)
    assert not stale, f"docs/cli.md documents commands that do not exist: {sorted(stale)}"


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_and_argument_is_documented(name):
    section = _sections().get(name, "")
    cmd = ROOT.commands[name]
    for opt in _options(cmd):
        for flag in opt.opts + opt.secondary_opts:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", section), \
                f"docs/cli.md, section forensics {name}: option {flag} is not mentioned"
    for arg in (p for p in cmd.params if isinstance(p, TyperArgument)):
        assert arg.name.upper() in section, f"docs/cli.md, section forensics {name}: argument {arg.name.upper()} is not mentioned"
    assert (cmd.help or "").strip(), f"forensics {name} has no help text"


@pytest.mark.parametrize("name", COMMANDS)
def test_no_documented_option_is_stale(name):
    section = _sections().get(name, "")
    real = {f for o in _options(ROOT.commands[name]) for f in o.opts + o.secondary_opts} | {"--help"}
    named = set(_OPTION.findall(section))
    assert named <= real, f"docs/cli.md, section forensics {name} names options it does not have: {sorted(named - real)}"


@pytest.mark.parametrize("name", COMMANDS)
def test_examples_parse(name):
    examples = _examples(_sections().get(name, ""))
    assert any(argv and argv[0] == name for argv in examples), f"docs/cli.md, section forensics {name}: no example"
    for argv in examples:
        assert argv[0] in ROOT.commands, f"example names an unknown command: {argv}"
        cmd = ROOT.commands[argv[0]]
        # parse only (no callback runs): unknown options, missing values and bad choices raise
        try:
            with cmd.make_context(f"forensics {argv[0]}", list(argv[1:])) as ctx:
                assert ctx.params is not None
        except UsageError as exc:
            pytest.fail(f"docs/cli.md example does not parse: forensics {shlex.join(argv)}: {exc}")


def test_root_options_and_completion_are_documented():
    text = _doc()
    head = text[: _HEADING.search(text).start()]
    for opt in _options(ROOT):
        for flag in opt.opts:
            assert flag in head, f"docs/cli.md: option {flag} of `forensics` itself is not mentioned before the commands"
    assert {"--install-completion", "--show-completion"} <= {f for o in _options(ROOT) for f in o.opts}


def test_shell_completion_script(monkeypatch):
    # typer finds the shell among the parent processes; a test run started in the
    # background (re-parented to init) has none, so name it
    import typer.completion

    monkeypatch.setattr(typer.completion, "_get_shell_name", lambda: "bash")
    res = CliRunner().invoke(app, ["--show-completion"], prog_name="forensics")
    assert res.exit_code == 0, res.output
    assert "_forensics_completion" in res.output and "complete" in res.output


def test_python_equivalents_name_the_public_api():
    text = _doc()
    python = text[text.index("## Python equivalents"):]
    public = sorted(n for n in vars(Run) if not n.startswith("_") and callable(getattr(Run, n)))
    missing = [n for n in public if f"run.{n}(" not in python]
    assert not missing, f"docs/cli.md, Python equivalents: Run methods not mentioned: {missing}"
    import inspect

    from forensics import api

    functions = [n for n, f in vars(api).items() if inspect.isfunction(f) and f.__module__ == api.__name__ and not n.startswith("_")]
    missing = [n for n in functions if f"api.{n}(" not in python and f"forensics.{n}(" not in python]
    assert not missing, f"docs/cli.md, Python equivalents: forensics.api functions not mentioned: {missing}"


def test_schema_doc_is_current():
    from forensics import schema_doc

    assert schema_doc.DOC.read_text() == schema_doc.render(), "docs/schema.md is stale: run python -m forensics.schema_doc"


def test_every_view_is_documented_with_an_example():
    """Every public view, table macro and table of a SQL module is described in the module's
    leading comment block, which has an example; helpers (`_name`) are not in docs/schema.md."""
    from forensics import schema_doc, sql_modules

    for m in sql_modules.modules():
        if not m.public:
            continue
        assert "```sql" in m.doc, f"forensics/sql/{m.name}.sql: the leading comment block has no example query"
        for name in m.public:
            assert f"`{name}" in m.doc, f"forensics/sql/{m.name}.sql: {name} is not described in its comment block"
    page = schema_doc.DOC.read_text()
    private = sorted({name for m in sql_modules.modules() for name in m.relations if name.startswith("_")})
    assert private, "no helper relations: the test would test nothing"
    shown = [name for name in private if re.search(rf"(?<![\w]){re.escape(name)}\b", page)]
    assert not shown, f"docs/schema.md names helpers that are not for users: {shown}"
