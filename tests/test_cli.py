"""The command line is a thin layer over forensics.api (forensics/cli.py): each command calls
the API, a user error is one `error:` line with exit status 2, `--version` and `-h` work,
and the help shows no Python types."""
from __future__ import annotations

import ast
import importlib.metadata
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.core import TyperArgument, TyperOption
from typer.testing import CliRunner

import forensics
from forensics import api, cli
from forensics.cli import app

CLI_SOURCE = Path(cli.__file__)
ROOT = typer.main.get_command(app)
COMMANDS = sorted(ROOT.commands)
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# what typer writes for a parameter's Python type: <bool>, <str>, <int>, <list[str]>, <path>, ...
PYTHON_TYPE = re.compile(r"<(?:bool|str|int|float|path|datetime|uuid|file|list\[[^>]*\]|tuple\[[^>]*\]|\w+ range)>")
WIDE = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}  # no type name folded over two lines


def api_functions() -> dict[str, object]:
    return {n: f for n, f in vars(api).items()
            if inspect.isfunction(f) and f.__module__ == api.__name__ and not n.startswith("_")}


def test_the_cli_imports_only_the_api():
    imported = set()
    for node in ast.walk(ast.parse(CLI_SOURCE.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            imported |= {f"{node.module}.{a.name}" if node.module else a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("forensics"):
            imported |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("forensics") for a in node.names), ast.dump(node)
    # besides the API: the API's error class from its own cheap module (forensics.errors,
    # the same class as forensics.api.ForensicsError), which the help needs without the API
    assert imported == {"api", "__version__", "errors.ForensicsError"}, \
        f"forensics/cli.py imports {sorted(imported)}: call forensics.api instead"


def test_the_error_class_is_one_class():
    from forensics import errors

    assert api.ForensicsError is errors.ForensicsError
    assert isinstance(api.ForensicsError("x"), errors.ForensicsError)


HEAVY = ("duckdb", "polars", "pyarrow", "numpy", "forensics.api")


@pytest.mark.parametrize("argv", [[], ["--help"], ["--version"], ["diagnose", "--help"], ["ingest", "--help"]])
def test_the_help_and_version_import_no_database_or_dataframe_library(argv):
    """`forensics --help` and a command's help are quick because they load neither DuckDB,
    polars, pyarrow nor the API (bench/bench_startup.py times them): a module-level import
    of the API in forensics/cli.py (or of them in forensics/__init__.py) fails this."""
    code = ("import sys\nfrom forensics.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == "HEAVY []", res.stdout[-2000:]
    assert ("forensics 0.1" if argv == ["--version"] else "Usage") in res.stdout


def test_a_command_still_imports_the_api(tmp_path):
    """The other side: the lazy imports do load the API when a command runs (the check above
    would pass as well if the commands never got there)."""
    code = ("import sys\nfrom forensics.cli import app\n"
            "try:\n    app(['diagnose', '--db', sys.argv[1]])\nexcept SystemExit:\n    pass\n"
            "print('API', 'forensics.api' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "none.duckdb")], capture_output=True, text=True, timeout=60)
    assert res.stdout.splitlines()[-1] == "API True", res.stdout + res.stderr
    assert "error: no database at" in res.stdout + res.stderr


def test_diagnose_of_a_new_database_imports_no_dataframe_library(tmp_path):
    """`forensics diagnose` reads a database made by this version without polars, pyarrow,
    numpy, the format modules or pydantic (half a second of imports: bench/bench_startup.py's
    target). A module-level import of one of them on the diagnosis' path (forensics.api,
    forensics.diagnosis, forensics.database, forensics.findings, forensics.phases, ...), or
    typer's TypeAdapter per parameter, fails this. The database holds lines, metrics of
    steps and phases (the performance findings run) and a traceback (event hits)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "driver.log").write_text("".join(
        f"step:{s} - actor/grad_norm:0.5 - timing_s/gen:{1.0 + s} - timing_s/update_actor:2.0 - timing_s/step:{3.0 + s}\n"
        for s in range(1, 6))
        + "Traceback (most recent call last):\n  File \"/app/train.py\", line 3, in <module>\n    main()\n"
          "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    db = str(tmp_path / "d.duckdb")
    res = subprocess.run([sys.executable, "-m", "forensics", "ingest", str(run), "--db", db], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    light = ("polars", "pyarrow", "numpy", "pydantic", "typer._adapters", "forensics.parsers.base", "forensics.store")
    code = ("import sys\nfrom forensics.cli import app\n"
            "try:\n    app(['diagnose', '--db', sys.argv[1], '-C', '1', '-v'])\nexcept SystemExit as e:\n    print('RC', e.code)\n"
            f"print('LOADED', sorted(m for m in {light!r} if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code, db], capture_output=True, text=True, timeout=60)
    assert "verdict: failed" in res.stdout and "oom_training" in res.stdout, res.stdout + res.stderr
    assert res.stdout.splitlines()[-1] == "LOADED []", res.stdout[-2000:]


@pytest.mark.parametrize("value, message", [("abc", "Input should be a valid integer"),
                                            ("-1", "Input should be greater than or equal to 0")])
def test_a_bad_number_is_a_usage_error(tmp_path, value, message):
    """The parameters' values are checked without typer's TypeAdapters (cli._plain_runtime_param):
    a number that is not one, or below its minimum, is still a usage error naming the option."""
    res = CliRunner().invoke(app, ["diagnose", "--db", str(tmp_path / "x.duckdb"), "--context", value])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.replace("│", " ").split())
    assert "Invalid value for '--context'" in text and message in text, res.output


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_calls_one_documented_api_function(name):
    callback = ROOT.commands[name].callback
    tree = ast.parse(inspect.getsource(callback).lstrip())
    called = {n.func.attr for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
              and isinstance(n.func.value, ast.Name) and n.func.value.id == "api"}
    functions = api_functions()
    entry = called & set(functions) - {"render_diagnosis", "render_evaluation"}
    assert len(entry) == 1, f"forensics {name} calls {sorted(called)} of forensics.api: one entry point wanted"
    assert inspect.getdoc(functions[entry.pop()])


@pytest.mark.parametrize("fn", list(api_functions().values()), ids=lambda f: f.__name__)
def test_api_functions_are_documented_and_typed(fn):
    assert inspect.getdoc(fn), f"forensics.api.{fn.__name__} has no docstring"
    for pname, param in inspect.signature(fn).parameters.items():
        assert param.annotation is not inspect.Parameter.empty, f"forensics.api.{fn.__name__}({pname}) has no type hint"


def test_version():
    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0, res.output
    assert res.output == f"forensics {forensics.__version__}\n"
    assert forensics.__version__ == importlib.metadata.version("forensics")  # pyproject.toml says the same


@pytest.mark.parametrize("argv", [[]] + [[c] for c in COMMANDS], ids=lambda a: " ".join(a) or "forensics")
def test_dash_h_is_help(argv):
    runner = CliRunner(env=WIDE)
    long, short = runner.invoke(app, [*argv, "--help"]), runner.invoke(app, [*argv, "-h"])
    assert long.exit_code == short.exit_code == 0, short.output
    assert short.output == long.output and "Usage: " in short.output


def _help_texts() -> dict[str, str]:
    runner = CliRunner(env=WIDE)
    return {" ".join(argv) or "forensics": runner.invoke(app, [*argv, "--help"]).output for argv in [[]] + [[c] for c in COMMANDS]}


def test_help_shows_no_python_types():
    for name, text in _help_texts().items():
        assert not PYTHON_TYPE.search(text), f"forensics {name} --help shows a Python type: {PYTHON_TYPE.search(text).group()}\n{text}"


def test_plain_help_shows_no_python_types():
    """Without rich (TYPER_USE_RICH=0: typer's plain layout) the help says the same."""
    env = {**os.environ, "TYPER_USE_RICH": "0", **WIDE}
    for argv in [[]] + [[c] for c in COMMANDS]:
        p = subprocess.run([sys.executable, "-m", "forensics", *argv, "--help"], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 0, p.stderr
        assert "Usage: " in p.stdout and not PYTHON_TYPE.search(p.stdout), p.stdout


@pytest.mark.parametrize("name", COMMANDS)
def test_every_value_is_named(name):
    """An option that takes a value and every argument name it (FILE, N, DIR, ...), as
    docs/cli.md does: the help shows that name where typer would show the Python type."""
    for p in ROOT.commands[name].params:
        if isinstance(p, TyperArgument) or (isinstance(p, TyperOption) and not p.is_flag):
            assert p.metavar and p.metavar[0].isupper(), f"forensics {name}: {p.opts} has no metavar"


def _error_lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith("error:")]


@pytest.mark.parametrize("argv, message", [
    (["diagnose", "--db", "{tmp}/missing.duckdb"], "no database at"),
    (["report", "--db", "{tmp}/missing.duckdb", "-o", "{tmp}/r.html"], "no database at"),
    (["query", "SELECT 1", "--db", "{tmp}/missing.duckdb"], "no database at"),
    (["export", "--db", "{tmp}/missing.duckdb", "--parquet", "{tmp}/pq"], "no database at"),
    (["export", "--db", "{tmp}/missing.duckdb"], "nothing to export"),
    (["query", "SELECT 1", "--format", "xml"], "unknown --format 'xml'"),
    (["signatures", "-s", "{tmp}/no-such-folder"], "does not exist"),
    (["evaluate", "{tmp}/no-such-corpus"], "no corpus folder"),
    (["ingest", "{tmp}/notes.duckdb", "--db", "{tmp}/notes.duckdb"], "cannot open database"),
])
def test_a_user_error_is_one_error_line_and_status_2(tmp_path, argv, message):
    (tmp_path / "notes.duckdb").write_text("not a database\n")
    res = CliRunner().invoke(app, [a.format(tmp=tmp_path) for a in argv])
    assert res.exit_code == 2, res.output
    lines = _error_lines(res.output)
    assert len(lines) == 1 and message in lines[0], res.output
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


@pytest.fixture(scope="module")
def small_db(tmp_path_factory) -> Path:
    db = tmp_path_factory.mktemp("cli") / "run.duckdb"
    api.ingest(FIXTURES / "diag_gcs_lost", db, workers=1, exclude=["expected.json"]).close()
    return db


def test_an_sql_error_is_a_user_error_with_its_cause_under_debug(small_db):
    res = CliRunner().invoke(app, ["query", "SELEC 1", "--db", str(small_db)])
    assert res.exit_code == 2 and _error_lines(res.output)[0].startswith("error: ParserException: "), res.output
    assert "Traceback" not in res.output
    res = CliRunner().invoke(app, ["--debug", "query", "SELEC 1", "--db", str(small_db)])
    assert res.exit_code == 2 and "Traceback (most recent call last)" in res.output and len(_error_lines(res.output)) == 1
    with pytest.raises(api.ForensicsError, match="ParserException") as exc:
        api.query(small_db, "SELEC 1")
    assert type(exc.value.__cause__).__name__ == "ParserException"


def test_every_forensics_error_becomes_status_2(monkeypatch, small_db):
    """The mapping is one place (cli._Group.invoke), whichever command raised it."""
    def refuse(*args, **kwargs):
        raise api.ForensicsError("the disk said no")

    for name in ("ingest", "diagnose", "report", "export", "catalogue", "query", "query_batches", "evaluate"):
        monkeypatch.setattr(api, name, refuse)
    db = ["--db", str(small_db)]
    for argv in (["ingest", "logs", *db], ["diagnose", *db], ["report", *db], ["export", "--parquet", "x", *db],
                 ["signatures"], ["query", "SELECT 1", *db], ["evaluate", "corpus"]):
        res = CliRunner().invoke(app, argv)
        assert res.exit_code == 2 and _error_lines(res.output) == ["error: the disk said no"], (argv, res.output)


def test_an_internal_error_is_not_a_user_error(monkeypatch, small_db):
    def bug(*args, **kwargs):
        raise ZeroDivisionError("a bug of ours")

    monkeypatch.setattr(api, "diagnose", bug)
    res = CliRunner().invoke(app, ["diagnose", "--db", str(small_db)])
    assert res.exit_code == 1 and isinstance(res.exception, ZeroDivisionError)  # main() prints `internal error:`


def test_the_commands_print_what_the_api_returns(small_db, tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["diagnose", "--db", str(small_db)])
    assert res.exit_code == 0 and api.render_diagnosis(api.diagnose(small_db)) in res.stdout
    res = runner.invoke(app, ["signatures", "--json"])
    assert res.exit_code == 0
    assert len(__import__("json").loads(res.stdout)["rules"]) == len(api.catalogue().rules)
    from forensics import diagnose as dg

    def limit(run) -> float:  # DuckDB shows it rounded: "18.8 GiB"
        number, unit = run.sql("SELECT current_setting('memory_limit')").item().split()
        return float(number) * 1024 ** ("KiB", "MiB", "GiB", "TiB").index(unit)

    with api.open(small_db) as run:
        before = limit(run)
        line = run.headline()
        assert limit(run) == pytest.approx(before, rel=0.01)  # the diagnosis' limit is lifted after it
    assert line == dg.headline(small_db) and line.startswith("failed: ray_cluster")


def test_diagnose_context_shows_the_lines_around_the_evidence(tmp_path):
    from typer.testing import CliRunner

    from forensics.cli import app

    log = tmp_path / "run" / "w.err"
    log.parent.mkdir()
    log.write_text("step 1\nstep 2\nTraceback (most recent call last):\n  File \"/x/t.py\", line 3, in f\n    g()\n"
                   "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\nafter\n")
    db = str(tmp_path / "r.duckdb")
    assert CliRunner().invoke(app, ["ingest", str(log.parent), "--db", db]).exit_code == 0
    r = CliRunner().invoke(app, ["diagnose", "--db", db, "-v", "--context", "2"])
    assert r.exit_code == 0, r.output
    assert ">      6 | torch.OutOfMemoryError" in r.output and "       4 |   File" in r.output and "       7 | after" in r.output
    r = CliRunner().invoke(app, ["diagnose", "--db", db, "--json", "-C", "1"])
    ctx = __import__("json").loads(r.output)["root_causes"][0]["evidence"][0]["context"]
    assert [c["line"] for c in ctx] == [5, 6, 7]
