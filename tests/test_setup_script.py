"""scripts/setup.sh refuses what it cannot do before it downloads anything: a torch release that is not
exact, unknown options, and a torch install (GBs with its CUDA libraries) on a disk without room for it
(CI once died mid-install with an OSError deep in pip and a half-made venv)."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setup(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True,
                          env={**os.environ, "GPUTRAIN_VENV": str(tmp_path / "venv"), **env}, timeout=120)


def test_a_torch_install_without_room_stops_before_pip_and_says_how_much_is_needed(tmp_path):
    # 9.9.9 is no release (if the check were gone, pip would fail fast, not download GBs); 10 PB of room is no disk's.
    proc = _setup(tmp_path, GPUTRAIN_TORCH="9.9.9", GPUTRAIN_TORCH_INSTALL_GB=str(10 ** 7))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "installing torch==9.9.9 in" in proc.stderr and "GB free on its disk, which has" in proc.stderr
    assert "torch was not installed" in proc.stderr
    # Refused before pip ran: the venv has no torch of its own (only what the base Python shares).
    assert not list((tmp_path / "venv").glob("lib/python*/site-packages/torch"))
    assert "setup: installing torch" not in proc.stdout


def test_a_torch_release_that_is_not_exact_is_refused_before_a_venv_is_made(tmp_path):
    proc = _setup(tmp_path, GPUTRAIN_TORCH="2.11")
    assert proc.returncode == 2
    assert "GPUTRAIN_TORCH must be an exact release such as 2.11.0, not '2.11'" in proc.stderr
    assert not (tmp_path / "venv").exists()


def test_pip_s_temporary_folder_on_another_disk_needs_room_for_the_wheels_there(tmp_path):
    # /dev/shm is a tmpfs of its own on Linux: pip's wheels would lie there, not beside the venv.
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a TMPDIR on another filesystem than the venv's (/dev/shm, a tmpfs)")
    proc = _setup(tmp_path, GPUTRAIN_TORCH="9.9.9", GPUTRAIN_TORCH_INSTALL_GB=str(10 ** 7), TMPDIR=str(shm))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "torch==9.9.9's wheels need about 3500000 GB free in /dev/shm (pip's temporary folder)" in proc.stderr
    assert "point TMPDIR at a disk with room" in proc.stderr
