"""Your data under 2 gloo processes (torchrun, loopback): sharded by rank, and stopped mid-epoch then
resumed to exactly the parameters of an uninterrupted run (dist_scripts/resume_data.py)."""

import json

import pytest
from helpers import DIST_SCRIPTS, torchrun


@pytest.mark.parametrize("kind", ["loader", "iterable"])
def test_user_data_under_two_processes_resumes_exactly(tmp_path, kind):
    proc = torchrun([str(DIST_SCRIPTS / "resume_data.py"), str(tmp_path), kind], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["equal"], result
    if kind == "loader":
        assert "sharded across 2 processes" in result["data_reason"]
        assert result["samples"] == 14 * 4 * 2  # 4 per rank per step: each rank its own batch
    else:
        assert "StatefulDataLoader" in result["data_reason"]
