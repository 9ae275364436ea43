"""The cache of loaded signature catalogues (forensics.catalogue.load): a second load of the
same files comes from the cache, any change to a file is seen, and a cache that cannot be
read or written only costs the check of the files."""
from __future__ import annotations

import pytest

from forensics import catalogue as sig

RULES = """
rules:
  - id: my_disk_full
    class: {cls}
    role: cause
    patterns: ['No space left on device: {word}']
"""


def _class(cat) -> str:
    return next(iter(cat.classes))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv(sig.CACHE_ENV, str(folder))
    return folder


def test_second_load_comes_from_the_cache(cache, monkeypatch):
    first = sig.load()
    assert len(list(cache.glob("catalogue-*.pickle"))) == 1

    def no_files(_files):
        raise AssertionError("the files were checked again although the cache holds them")

    monkeypatch.setattr(sig, "_load_files", no_files)
    again = sig.load()
    assert again == first and again is not first


def test_a_changed_user_file_is_seen(cache, tmp_path):
    cls = _class(sig.load())
    user = tmp_path / "mine"
    user.mkdir()
    (user / "disk.yaml").write_text(RULES.format(cls=cls, word="first"))
    one = sig.load([user])
    assert "No space left on device: first" in next(r for r in one.rules if r.id == "my_disk_full").patterns
    (user / "disk.yaml").write_text(RULES.format(cls=cls, word="second"))
    two = sig.load([user])
    assert "No space left on device: second" in next(r for r in two.rules if r.id == "my_disk_full").patterns
    (user / "disk.yaml").unlink()
    three = sig.load([user])
    assert not any(r.id == "my_disk_full" for r in three.rules)


def test_a_bad_file_is_still_an_error_after_a_good_load(cache, tmp_path):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "disk.yaml").write_text(RULES.format(cls=_class(sig.load()), word="x"))
    sig.load([user])
    (user / "disk.yaml").write_text(RULES.format(cls="no_such_class", word="x"))
    with pytest.raises(sig.SignatureError, match="no_such_class"):
        sig.load([user])


def test_a_damaged_entry_is_loaded_again_and_replaced(cache):
    first = sig.load()
    (entry,) = cache.glob("catalogue-*.pickle")
    entry.write_bytes(b"not a pickle")
    assert sig.load() == first
    assert entry.read_bytes() != b"not a pickle"


def test_a_cache_folder_that_cannot_be_written_costs_nothing_but_time(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(sig.CACHE_ENV, str(blocker / "cache"))  # below a file: mkdir fails
    assert sig.load().rules


def test_an_empty_setting_turns_the_cache_off(tmp_path, monkeypatch):
    monkeypatch.setenv(sig.CACHE_ENV, "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert sig.cache_dir() is None
    assert sig.load().rules
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "home").exists()


def test_default_folder_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv(sig.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert sig.cache_dir() == tmp_path / "xdg" / "forensics"
