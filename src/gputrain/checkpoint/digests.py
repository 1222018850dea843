"""Checkpoints' content hashes: computed, written, read back and checked, one path for both formats.

Every file of a checkpoint has its sha256 written beside it in sha256sum's format ("HEX  NAME" lines,
so `sha256sum -c` checks them too). A one-file checkpoint, step-000123.pt, has its digest in
step-000123.pt.sha256, computed as the bytes are written (`Sha256Writer`) and written before the file
is renamed into place (store.py). A sharded one, the folder step-000123.dcp/, lists every file in
MANIFEST.sha256, each rank hashing the files it wrote, written last, before the folder is renamed into
place (sharded_save.py). `verify` answers True, or a `Damage` saying what is wrong: the store skips
such a checkpoint on resume.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import IO

from gputrain.checkpoint.names import DCP_METADATA, DCP_SUFFIX, MANIFEST, SHA256_SUFFIX, run_state_name, sha256_sidecar
from gputrain.io.atomic import atomic_file

_HASH_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


# ---------------------------------------------------------------- computing


class Sha256Writer:
    """A write-only file that passes bytes on to `f` and hashes them (torch.save needs write/flush), so
    that a checkpoint's digest costs no second read of it."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self._hash = hashlib.sha256()

    def write(self, data) -> int:
        self._hash.update(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def file_sha256(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    """The sha256 (hex) of a file's bytes, read in chunks (a checkpoint may not fit in memory twice)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def files_sha256(folder: Path, names: list[str]) -> dict[str, str]:
    """{name: sha256 hex} of files in `folder` (a sharded checkpoint's, read back after DCP wrote them)."""
    return {name: file_sha256(folder / name) for name in names}


# ---------------------------------------------------------------- written and read back


def _sha256sum_text(lines: list[tuple[str, str]]) -> str:
    """sha256sum's format of (name, hex digest) pairs."""
    return "".join(f"{digest}  {name}\n" for name, digest in lines)


def parse_sha256sum(text: str) -> list[tuple[str, str]]:
    """(name, hex digest) of each sha256sum line in `text`; other lines are ignored."""
    return [(m.group(2), m.group(1)) for line in text.splitlines() if (m := _HASH_LINE.match(line.strip()))]


def write_sidecar(checkpoint: Path, digests: list[str]) -> None:
    """The .sha256 beside a one-file checkpoint, listing `digests` for it (two while a step is being
    written over, see store.py), atomically."""
    with atomic_file(sha256_sidecar(checkpoint), "w") as f:
        f.write(_sha256sum_text([(checkpoint.name, d) for d in digests]))


def listed_digests(sidecar: Path) -> list[str]:
    """The digests a checkpoint's .sha256 lists for it (two while a step is being written over, see
    store.py); [] when it is missing or unreadable."""
    try:
        text = sidecar.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    name = sidecar.name[: -len(SHA256_SUFFIX)]
    return [digest for listed, digest in parse_sha256sum(text) if listed == name]


def write_manifest(folder: Path, digests: dict[str, str]) -> None:
    """MANIFEST.sha256 of every file of a sharded checkpoint ({name: digest}), atomically (the last file
    written)."""
    with atomic_file(folder / MANIFEST, "w") as f:
        f.write(_sha256sum_text(sorted(digests.items())))


def manifest_digests(folder: Path) -> dict[str, str] | Damage:
    """{name: digest} of a sharded checkpoint's MANIFEST.sha256, or why it cannot be used."""
    try:
        text = (folder / MANIFEST).read_text(encoding="utf-8")
    except FileNotFoundError:
        return Damage(f"it has no {MANIFEST} (the hashes of its files) to verify it by")
    except (OSError, UnicodeDecodeError) as exc:
        return Damage(f"cannot read {MANIFEST} ({exc})")
    digests = dict(parse_sha256sum(text))
    if DCP_METADATA not in digests or run_state_name(0) not in digests:
        return Damage(f"{MANIFEST} does not list {DCP_METADATA} and {run_state_name(0)}")
    return digests


# ---------------------------------------------------------------- checked


class Damage(str):
    """Why a checkpoint does not verify. A str (print it) that is false in a test, so that
    `if verify(path):` reads right: verify returns True or a Damage."""

    def __bool__(self) -> bool:
        return False


def verify(path: str | os.PathLike, share: tuple[int, int] = (0, 1)) -> bool | Damage:
    """True when the checkpoint at `path` (a step-N.pt file or a step-N.dcp folder) matches its
    digests, else a Damage naming what does not (for a folder: the first file).

    share=(rank, world): the ranks of a job verify in parallel: of a folder's files, this rank checks
    every world-th from the rank-th (in name order); a one-file checkpoint is checked by rank 0, the
    others answer True (the caller agrees on the answers, sharded_save.py).
    """
    path = Path(path)
    rank, world = share
    if path.name.endswith(DCP_SUFFIX):
        if not path.is_dir():
            return Damage("the folder is missing")
        digests = manifest_digests(path)
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
    sidecar = sha256_sidecar(path)
    if not sidecar.is_file():
        return Damage(f"it has no {sidecar.name} (its content hash) to verify it by")
    expected = listed_digests(sidecar)
    if not expected:
        return Damage(f"{sidecar.name} holds no sha256 line for {path.name}")
    return _matches(path, expected, sidecar.name)


def _matches(file: Path, expected: list[str], listed_in: str, name: str = "") -> bool | Damage:
    """Whether `file`'s sha256 is one of `expected` (listed in the file named `listed_in`)."""
    try:
        actual = file_sha256(file)
    except OSError as exc:
        return Damage(f"cannot read {name or 'it'} ({exc.strerror or exc})")
    if actual in expected:
        return True
    return Damage(f"{name + ': ' if name else ''}its content hash does not match {listed_in} (the file was damaged "
                  f"or changed after it was written; {file.stat().st_size} bytes, sha256 {actual[:12]}..., "
                  f"expected {expected[0][:12]}...)")
