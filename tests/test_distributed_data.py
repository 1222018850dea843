"""Your data under 2 gloo processes (torchrun, loopback): sharded by rank, and stopped mid-epoch then
resumed to exactly the parameters of an uninterrupted run (dist_scripts/resume_data.py)."""

import json

import pytest
from helpers import DIST_SCRIPTS, torchrun

pytestmark = pytest.mark.processes  # every test here starts processes: make test-fast leaves them out


@pytest.mark.parametrize("kind", [pytest.param("loader", marks=pytest.mark.slow), "iterable"])
def test_user_data_under_two_processes_resumes_exactly(tmp_path, kind):
    """loader is slow: 69 s on this machine (the serial suite, 2026-11-28, load 5-14): two torchrun
    starts (stopped, resumed), each rank's DataLoader with worker processes, and a reference."""
    proc = torchrun([str(DIST_SCRIPTS / "resume_data.py"), str(tmp_path), kind], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["equal"], result
    if kind == "loader":
        assert "sharded across 2 processes" in result["data_reason"]
        assert result["samples"] == 14 * 4 * 2  # 4 per rank per step: each rank its own batch
    else:
        assert "StatefulDataLoader" in result["data_reason"]
