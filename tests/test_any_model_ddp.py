"""Dict batches under DDP (gloo, 2 processes on loopback): the parameters and the synced torchmetrics
value equal one process with the same global batch (issue 12)."""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchmetrics")

from helpers import DIST_SCRIPTS, run_python, torchrun  # noqa: E402

pytestmark = pytest.mark.processes  # every test here starts processes: make test-fast leaves them out

SCRIPT = str(DIST_SCRIPTS / "dict_batches.py")


def test_dict_batches_under_ddp_match_one_process_with_the_same_global_batch(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    proc = run_python([SCRIPT, str(one), "32", "4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = torchrun([SCRIPT, str(two), "16", "4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    r1, r2 = (json.loads((d / "result.json").read_text()) for d in (one, two))
    assert r1["world_size"] == 1 and r2["world_size"] == 2
    p1, p2 = (torch.load(d / "params.pt") for d in (one, two))
    assert p1.keys() == p2.keys()
    for k in p1:
        assert torch.allclose(p1[k], p2[k], atol=1e-6), (k, (p1[k] - p2[k]).abs().max())
    # accuracy over all 120 eval samples (each rank holds 60): synced by torchmetrics
    assert 0 < r1["last"]["eval_acc"] < 1
    assert r2["last"]["eval_acc"] == pytest.approx(r1["last"]["eval_acc"], abs=1e-6)
    assert r2["last"]["eval_loss"] == pytest.approx(r1["last"]["eval_loss"], abs=1e-5)
    assert r2["last"]["loss"] == pytest.approx(r1["last"]["loss"], abs=1e-5)
