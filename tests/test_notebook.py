"""examples/postmortem.ipynb runs top to bottom, on the corpus run and on sample_logs/."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOK = EXAMPLES / "postmortem.ipynb"


def _execute(monkeypatch, corpus: Path):
    """Run the notebook in a fresh kernel (it inherits FORENSICS_CORPUS) from examples/."""
    monkeypatch.setenv("FORENSICS_CORPUS", str(corpus))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    return nb


def _text(nb) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            out.append(o.get("text", "") if o["output_type"] == "stream" else str(o.get("data", {}).get("text/plain", "")))
    return "\n".join(out)


def test_committed_notebook_has_no_outputs():
    doc = json.loads(NOTEBOOK.read_text())
    nbformat.validate(nbformat.reads(NOTEBOOK.read_text(), as_version=4))
    for cell in doc["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, "clear the outputs before committing"


def test_notebook_on_straggler(monkeypatch, corpus):
    if not (corpus / "real" / "straggler").is_dir():
        pytest.skip("real/straggler not in the corpus")
    text = _text(_execute(monkeypatch, corpus))
    assert "real/straggler" in text
    assert "finding straggler" in text
    assert "allreduce" in text  # the collectives query
    events = re.search(r"trace: (\d+) events in processes (.*)", text)
    assert events and int(events.group(1)) > 10_000  # the export ran: kernels of both ranks
    assert "rank 0" in events.group(2) and "rank 1" in events.group(2)


def test_notebook_without_corpus_uses_sample_logs(monkeypatch, tmp_path):
    nb = _execute(monkeypatch, tmp_path / "no-corpus-here")
    text = _text(nb)
    assert "sample_logs" in text
    assert "verdict:" in text
    # the plot cell produced a figure
    assert any("application/vnd.plotly.v1+json" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
