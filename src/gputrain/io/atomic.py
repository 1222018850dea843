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
import tempfile
from pathlib import Path
from typing import IO, Iterator

TMP_SUFFIX = ".tmp"  # temporary files are named .NAME.<random>.tmp beside NAME


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
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
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
    _remove_stale_temps(path)


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


def _remove_stale_temps(path: Path) -> None:
    """Temp files of `path` left by a writer that was killed before its rename."""
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*{TMP_SUFFIX}"):
        with contextlib.suppress(OSError):
            stale.unlink()
