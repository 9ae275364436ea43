"""The ``forensics`` command's entry point: the command line, with a Ctrl-C during its
imports (typer and rich; DuckDB, polars and pyarrow come later, inside the command that
calls the API, under the command line's own interrupt handling) ending as any other
interrupt does, `interrupted` and exit status 130, instead of Python's traceback."""
from __future__ import annotations

import sys


def main() -> None:
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        raise SystemExit(130) from None
    cli_main()
