"""hpc/fsio.py: the one atomic writer that every file writer goes through."""

from __future__ import annotations

import pytest

from hpc.fsio import atomic_path, write_text


def test_write_replaces_whole_and_leaves_no_temp(tmp_path):
    path = tmp_path / "sub" / "f.json"
    write_text(path, "old")
    write_text(path, "new", mode=0o600)
    assert path.read_text() == "new" and path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["f.json"]


def test_exclusive_creates_once_and_keeps_the_first(tmp_path):
    path = tmp_path / "token"
    write_text(path, "first", exclusive=True)
    with pytest.raises(FileExistsError):
        write_text(path, "second", exclusive=True)
    assert path.read_text() == "first" and [p.name for p in tmp_path.iterdir()] == ["token"]


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "f"
    write_text(path, "old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("writer died")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f"]


def test_unsafe_ancestor_names_the_directory_another_user_could_swap(tmp_path):
    import os

    from hpc.fsio import unsafe_ancestor

    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    assert unsafe_ancestor(deep) is None and unsafe_ancestor(deep / "not-yet" / "x") is None
    os.chmod(tmp_path / "a", 0o777)
    assert "a is writable by other users (mode 777) without the sticky bit" in unsafe_ancestor(deep / "c")
    os.chmod(tmp_path / "a", 0o1777)
    assert unsafe_ancestor(deep) is None
    os.chown(tmp_path / "a", 4242, 4242)
    assert "belongs to uid 4242" in unsafe_ancestor(deep)
