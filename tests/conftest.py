"""Shared fixtures. Corpus-based tests skip cleanly when ../shared is absent."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("FORENSICS_CORPUS", REPO.parent / "shared" / "corpus"))
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def pytest_configure(config):
    """The tests (and the commands they start) keep loaded catalogues in a folder of their
    own, not the user's ~/.cache: each run starts without one, as a fresh install does."""
    import tempfile

    if "FORENSICS_CACHE_DIR" not in os.environ:
        config._forensics_cache = tempfile.TemporaryDirectory(prefix="forensics-test-cache-")
        os.environ["FORENSICS_CACHE_DIR"] = config._forensics_cache.name


def pytest_unconfigure(config):
    cache = getattr(config, "_forensics_cache", None)
    if cache is not None:
        os.environ.pop("FORENSICS_CACHE_DIR", None)
        cache.cleanup()


@pytest.fixture(scope="session")
def corpus() -> Path:
    if not CORPUS.is_dir():
        pytest.skip(f"labelled corpus not found at {CORPUS}")
    return CORPUS


def corpus_cases() -> list[Path]:
    """Every labelled bundle (real/ and cases/), for parametrised tests."""
    if not CORPUS.is_dir():
        return []
    return sorted(p.parent for p in CORPUS.glob("*/*/label.json"))


@pytest.fixture(scope="session")
def ingested_corpus(tmp_path_factory, corpus):
    """Each corpus bundle ingested once into its own database: {case dir: db path}."""
    from forensics import pipeline

    out = {}
    base = tmp_path_factory.mktemp("corpus-dbs")
    for case in corpus_cases():
        db = base / f"{case.parent.name}-{case.name}.duckdb"
        pipeline.ingest([str(case)], str(db), workers=1, exclude=["label.json"])
        out[case] = db
    return out


def pytest_addoption(parser):
    parser.addoption(
        "--update-expected", action="store_true", default=False,
        help="tests/test_sql_modules.py: rewrite tests/sql_expected/*.csv from what the views return now "
             "(then read the diff before committing it)")
