"""Output files written whole or not at all, and output paths checked before the work that fills them.

``atomic_write`` writes a temporary file in the target's directory, fsyncs it and renames it onto the
target (``os.replace``: atomic on POSIX within one filesystem), then fsyncs the directory so the rename
survives a crash. A full disk, a killed process or an exception while writing leaves the old file as it
was and no temporary behind; readers (a drafter loading a snapshot, a script reading a report) see the old
content or the new, never part of one. ``check_writable`` tries the same temporary file (created and
removed at once), so a command can refuse a bad output path in well under a millisecond instead of after
an hour of work.

A symlink is followed (the file it names is replaced, the link stays), and an existing target that is not
a regular file (``/dev/null``, a FIFO) is written in place, since there is nothing to replace.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "wb", encoding: str | None = None) -> Iterator[IO]:
    """A file to write ``path``'s new content to (``mode`` "wb" or "w"); it replaces ``path`` when the block
    ends without an exception. On any failure ``path`` is unchanged and the temporary file removed."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write: mode 'wb' or 'w', not {mode!r}")
    if mode == "w" and encoding is None:
        encoding = "utf-8"
    target = Path(os.path.realpath(path))
    if _is_special(target):
        with open(target, mode, encoding=encoding) as f:
            yield f
        return
    fd, tmp = _create_temporary(target)
    try:
        with os.fdopen(fd, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(target.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    """``Path.write_text`` (UTF-8), whole or not at all."""
    with atomic_write(path, "w") as f:
        f.write(text)


def check_writable(path: str | Path, make_parents: bool = False) -> None:
    """Raise OSError (its ``strerror`` a short reason) unless ``atomic_write(path)`` can create its file:
    the directory exists (created first with ``make_parents``) and is writable, and ``path`` is no
    directory. Creates and removes one empty temporary file."""
    target = Path(os.path.realpath(path))
    if target.is_dir():
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if _is_special(target):
        if not os.access(target, os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return
    if make_parents:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # a file where the directory should be
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(target.parent)) from None
    fd, tmp = _create_temporary(target)
    os.close(fd)
    os.unlink(tmp)


def _is_special(target: Path) -> bool:
    return target.exists() and not target.is_file() and not target.is_dir()


def _create_temporary(target: Path) -> tuple[int, str]:
    # os.open with 0o666 rather than mkstemp: the umask applies, as for any file a command writes
    # (mkstemp's 0600 would hide a snapshot from drafters running as another user)
    tmp = str(target.with_name(f".{target.name[:200]}.{secrets.token_hex(4)}.tmp"))  # within NAME_MAX
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory; the rename itself is done
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
