"""Files that are whole or absent: every file gputrain writes goes through here.

`atomic_file(path, mode)` opens a temporary file next to `path`; on a clean exit the temporary file
is flushed, fsynced and renamed over `path` in one step (the folder fsynced after it), so a reader,
a crash or a power cut sees the old file or the new one, never half of one. `write_text` is the
one-call form for text; `fsync_dir` makes a rename durable for writers that rename themselves. Logs
that only ever append (metrics.jsonl, metrics.csv) are the exception: they open their files in
append mode themselves (report/metrics_log.py).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import socket
import tempfile
import time
from pathlib import Path
from typing import IO, Iterator

TMP_SUFFIX = ".tmp"  # temporary files are named .NAME.<host>-<pid>.<random>.tmp beside NAME
UNOWNED_STALE_S = 3600.0  # a temp file naming no writer (an older layout) is stale after an hour


def _writer_tag() -> str:
    """This process as it appears in its temp files' names: host (letters, digits, _ and -) and pid."""
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', socket.gethostname())}-{os.getpid()}"


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file next to `path`; on a clean exit it replaces `path` in one rename.

    mode: "wb" (bytes) or "w" (UTF-8 text, newlines as written). The parent folder is created. The
    temp file is flushed and fsynced before the rename and the folder after it, so after a power cut
    the folder holds the old file or the new one. On an exception the temp file is removed and
    `path` is untouched; after a SIGKILL a `.NAME.*.tmp` file may remain, which the next successful
    write of the same `path` removes.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.{_writer_tag()}.", suffix=TMP_SUFFIX, dir=path.parent)
    try:
        f = os.fdopen(fd, mode) if "b" in mode else os.fdopen(fd, mode, encoding="utf-8", newline="")
        with f:
            _chmod_like_a_new_file(f.fileno())
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    fsync_dir(path.parent)
    remove_stale_temps(path)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically; returns the path."""
    with atomic_file(path, "w") as f:
        f.write(text)
    return Path(path)


def _chmod_like_a_new_file(fd: int) -> None:
    # mkstemp makes the file 0600; give it the mode open() would (0666 minus the umask).
    if not hasattr(os, "fchmod"):
        return
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make the renames in `folder` durable (a no-op where a folder cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # not every platform lets a folder be opened (Windows)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_stale_temps(path: Path) -> None:
    """Temp files of `path` left by a writer that was killed before its rename: those of a process of
    this host that no longer exists, and those naming no writer once older than UNOWNED_STALE_S.
    A live writer's file (another rank, another process) and another host's are left alone."""
    here, me = _writer_tag().rsplit("-", 1)
    head = f".{path.name}."
    for temp in path.parent.glob(f"{glob.escape(head)}*{TMP_SUFFIX}"):
        writer = re.fullmatch(r"([A-Za-z0-9_-]+)-(\d+)\.[^.]+", temp.name[len(head):-len(TMP_SUFFIX)])
        with contextlib.suppress(OSError):
            if writer is None:
                if time.time() - temp.stat().st_mtime > UNOWNED_STALE_S:
                    temp.unlink()
            elif writer[1] == here and writer[2] != me and not _alive(int(writer[2])):
                temp.unlink()


def _alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by another user
    return True
