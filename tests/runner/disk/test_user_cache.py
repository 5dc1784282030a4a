"""The user's cache tables (runner/disk/user_cache.py): damage reads as empty, a table stays bounded, and a
folder that cannot be written costs nothing but time. Each test has its own cache (tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

from ckrun.runner.disk import user_cache


def is_int(value) -> bool:
    return isinstance(value, int)


def test_the_folder_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert user_cache.cache_folder() == tmp_path / "ckrun"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert user_cache.cache_folder() == Path.home() / ".cache" / "ckrun"


def test_a_damaged_table_reads_as_empty_and_wrong_values_are_dropped():
    path = user_cache.cache_folder() / "t.json"
    path.parent.mkdir(parents=True)
    for damage in ('{"a": ', "[1, 2]", "null", "\xff"):
        path.write_text(damage, encoding="latin-1")
        assert user_cache.read_table("t.json", is_int) == {}, damage
    path.write_text('{"a": 1, "b": "2"}')
    assert user_cache.read_table("t.json", is_int) == {"a": 1}


def test_a_table_keeps_its_newest_entries(monkeypatch):
    monkeypatch.setattr(user_cache, "MAX_ENTRIES", 2)
    user_cache.write_table("t.json", {"old": 1, "newer": 2, "newest": 3})
    assert user_cache.read_table("t.json", is_int) == {"newer": 2, "newest": 3}


def test_a_folder_that_cannot_be_written_costs_nothing(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # ckrun/ cannot be made inside a file
    user_cache.write_table("t.json", {"a": 1})
    assert user_cache.read_table("t.json", is_int) == {}
    assert os.listdir(tmp_path) == ["a-file"]


def test_a_key_follows_its_parts_and_the_versions():
    assert user_cache.key_of(["a"]) == user_cache.key_of(["a"])
    assert user_cache.key_of(["a"]) != user_cache.key_of(["b"])
    assert user_cache.key_of(["a"], ["torch"]) != user_cache.key_of(["a"])
    assert user_cache.key_of(["a"], ["no-such-package-here"]) != user_cache.key_of(["a"])
