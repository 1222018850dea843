"""How a checkpoint is verified, one path for both formats: every file's sha256 against the digest
written for it, in sha256sum's format ("HEX  NAME" lines, so `sha256sum -c` checks them too).

A one-file checkpoint, step-000123.pt, has its digest in step-000123.pt.sha256, written before the
file is renamed into place (store.py). A sharded one, the folder step-000123.dcp/, lists every file
in MANIFEST.sha256, written last, before the folder is renamed into place (sharded.py). `verify`
answers True, or a `Damage` saying what is wrong: the store skips such a checkpoint on resume.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gputrain.checkpoint.format import sha256_file
from gputrain.checkpoint.sharded import MANIFEST, METADATA, SUFFIX, run_file_name

HASH_SUFFIX = ".sha256"
_HASH_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


class Damage(str):
    """Why a checkpoint does not verify. A str (print it) that is false in a test, so that
    `if verify(path):` reads right: verify returns True or a Damage."""

    def __bool__(self) -> bool:
        return False


def hash_path(path: str | os.PathLike) -> Path:
    """The .sha256 beside a one-file checkpoint."""
    path = Path(path)
    return path.with_name(path.name + HASH_SUFFIX)


def sums(text: str) -> list[tuple[str, str]]:
    """(name, hex digest) of each sha256sum line in `text`; other lines are ignored."""
    return [(m.group(2), m.group(1)) for line in text.splitlines() if (m := _HASH_LINE.match(line.strip()))]


def file_digests(sidecar: Path) -> list[str]:
    """The digests a checkpoint's .sha256 lists for it (two while a step is being written over, see
    store.py); [] when it is missing or unreadable."""
    try:
        text = sidecar.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    name = sidecar.name[: -len(HASH_SUFFIX)]
    return [digest for listed, digest in sums(text) if listed == name]


def read_manifest(folder: Path) -> dict[str, str] | Damage:
    """{name: digest} of a sharded checkpoint's MANIFEST.sha256, or why it cannot be used."""
    try:
        text = (folder / MANIFEST).read_text(encoding="utf-8")
    except FileNotFoundError:
        return Damage(f"it has no {MANIFEST} (the hashes of its files) to verify it by")
    except (OSError, UnicodeDecodeError) as exc:
        return Damage(f"cannot read {MANIFEST} ({exc})")
    digests = dict(sums(text))
    if METADATA not in digests or run_file_name(0) not in digests:
        return Damage(f"{MANIFEST} does not list {METADATA} and {run_file_name(0)}")
    return digests


def verify(path: str | os.PathLike, share: tuple[int, int] = (0, 1)) -> bool | Damage:
    """True when the checkpoint at `path` (a step-N.pt file or a step-N.dcp folder) matches its
    digests, else a Damage naming what does not (for a folder: the first file).

    share=(rank, world): the ranks of a job verify in parallel: of a folder's files, this rank checks
    every world-th from the rank-th (in name order); a one-file checkpoint is checked by rank 0, the
    others answer True (the caller agrees on the answers, sharded_save.py).
    """
    path = Path(path)
    rank, world = share
    if path.name.endswith(SUFFIX):
        if not path.is_dir():
            return Damage("the folder is missing")
        digests = read_manifest(path)
        if isinstance(digests, Damage):
            return digests
        for name in sorted(digests)[rank::world]:
            if not (path / name).is_file():
                return Damage(f"{name} is missing")
            why = _matches(path / name, [digests[name]], MANIFEST, name)
            if why is not True:
                return why
        return True
    if rank != 0:
        return True
    if not path.is_file():
        return Damage("the file is missing")
    sidecar = hash_path(path)
    if not sidecar.is_file():
        return Damage(f"it has no {sidecar.name} (its content hash) to verify it by")
    expected = file_digests(sidecar)
    if not expected:
        return Damage(f"{sidecar.name} holds no sha256 line for {path.name}")
    return _matches(path, expected, sidecar.name)


def _matches(file: Path, expected: list[str], listed_in: str, name: str = "") -> bool | Damage:
    """Whether `file`'s sha256 is one of `expected` (listed in the file named `listed_in`)."""
    try:
        actual = sha256_file(file)
    except OSError as exc:
        return Damage(f"cannot read {name or 'it'} ({exc.strerror or exc})")
    if actual in expected:
        return True
    return Damage(f"{name + ': ' if name else ''}its content hash does not match {listed_in} (the file was damaged "
                  f"or changed after it was written; {file.stat().st_size} bytes, sha256 {actual[:12]}..., "
                  f"expected {expected[0][:12]}...)")
