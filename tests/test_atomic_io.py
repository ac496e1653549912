"""Atomic output files: the target holds the old content or the new, never part of one, and no temporary
file outlives a failed write; output paths that cannot be written are refused before any work."""

from __future__ import annotations

import errno
import os

import pytest

from specmesh.atomic_io import atomic_write, check_writable, write_text_atomic

OLD = b"old snapshot\n" * 100


def test_a_completed_write_replaces_the_target(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(OLD)
    with atomic_write(target) as f:
        f.write(b"new")
        assert target.read_bytes() == OLD  # nothing reaches the target before the block ends
    assert target.read_bytes() == b"new"
    write_text_atomic(target, "ünïcode\n")
    assert target.read_text(encoding="utf-8") == "ünïcode\n"
    assert os.listdir(tmp_path) == ["out.bin"]


def test_a_write_failing_midway_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(OLD)
    with pytest.raises(OSError) as failed, atomic_write(target) as f:
        f.write(b"new" * 10_000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # the disk filled up part way through
    assert failed.value.errno == errno.ENOSPC
    assert target.read_bytes() == OLD
    assert os.listdir(tmp_path) == ["out.bin"]


def test_a_failed_first_write_creates_nothing(tmp_path):
    with pytest.raises(OSError), atomic_write(tmp_path / "new.bin") as f:
        f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert os.listdir(tmp_path) == []


def test_a_directory_in_the_way_fails_and_leaves_no_temporary(tmp_path):
    (tmp_path / "out.json").mkdir()
    with pytest.raises(IsADirectoryError):
        write_text_atomic(tmp_path / "out.json", "{}")
    assert os.listdir(tmp_path) == ["out.json"] and os.listdir(tmp_path / "out.json") == []


def test_a_symlink_keeps_pointing_at_the_replaced_file(tmp_path):
    (tmp_path / "real.json").write_text("old")
    (tmp_path / "link.json").symlink_to("real.json")
    write_text_atomic(tmp_path / "link.json", "new")
    assert (tmp_path / "link.json").is_symlink() and (tmp_path / "real.json").read_text() == "new"


def test_a_device_is_written_in_place():
    write_text_atomic(os.devnull, "discarded")  # no rename onto /dev/null, which would replace the device
    check_writable(os.devnull)
    assert not os.path.isfile(os.devnull)


@pytest.mark.parametrize("where, error", [
    ("missing/out.json", FileNotFoundError),
    ("a_file/out.json", NotADirectoryError),  # fails for root too, unlike a chmod'ed directory
    ("a_dir", IsADirectoryError),
])  # fmt: skip
def test_unwritable_paths_are_refused_and_nothing_is_left(tmp_path, where, error):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir()
    with pytest.raises(error):
        check_writable(tmp_path / where)
    assert sorted(os.listdir(tmp_path)) == ["a_dir", "a_file"] and os.listdir(tmp_path / "a_dir") == []


def test_check_writable_creates_missing_directories_when_asked(tmp_path):
    check_writable(tmp_path / "results" / "run1" / "out.json", make_parents=True)
    assert os.listdir(tmp_path / "results" / "run1") == []
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(NotADirectoryError):
        check_writable(tmp_path / "a_file" / "out.json", make_parents=True)
