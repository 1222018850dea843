"""The conformance zoo (tests/zoo/): public models and their authors' own steps, each trained through
`gputrain.fit` with default settings beside the author's hand loop on the same batches (same seeds).

Asserted for every case: no crash; after fit every module is in the mode the user gave it; the
parameters and buffers equal the hand loop's: bit for bit where no numeric choice of fit applies (the
CPU: fp32, the user's layout, the author's optimizer), within the bf16 tolerance (docs/explanations/
decisions.md) where one does (CUDA: bf16 autocast, channels_last, TF32, CUDA graphs). fit runs first; the hand loop then runs
in the precision fit reports it used (history.summary): its forward under the same `torch.autocast`
(the AMP recipe) for bf16, without autocast where fit's first step found its automatic bf16 refused and
trained in fp32 (DCGAN's and VAE's BCELoss on CUDA: train/step/autocast_decider.py), TF32 set as that
precision sets it.

The device comes from GPUTRAIN_ZOO_DEVICE ("cpu" by default; "cuda" on a GPU machine:
`GPUTRAIN_ZOO_DEVICE=cuda python -m pytest -q tests/test_zoo.py`).
"""

import contextlib
import copy
import os

import numpy as np
import pytest
import torch
from helpers import modes
from zoo import Case, Refusal, cases, refusals

import gputrain
from gputrain.batch import move
from gputrain.runtime.precision import matmul_settings, resolve_precision

DEVICE = os.environ.get("GPUTRAIN_ZOO_DEVICE", "cpu")
SEED = 0
# bf16 autocast (docs/explanations/decisions.md, "Tolerances"): per floating tensor, the update fit made
# (final - initial) differs from the hand loop's by at most BF16_UPDATE_RTOL of the hand loop's update
# (L2 norms) plus BF16_ATOL per element; BatchNorm statistics and other buffers within BF16_ATOL
# relative. bf16 keeps 8 bits of mantissa (relative rounding 2^-8 = 0.4%), and each kernel choice
# (NHWC, TF32, fused ops) rounds in its own order.
BF16_UPDATE_RTOL = 0.1
BF16_ATOL = 1e-3

CASES = cases()
REFUSALS = refusals()


def _device() -> torch.device:
    device = torch.device(DEVICE)
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("GPUTRAIN_ZOO_DEVICE=cuda, but this PyTorch sees no CUDA device")
    return device


def _amp(device: torch.device, name: str):
    """The hand loop's autocast for the precision fit reports it used (history.summary["precision"]):
    fit's default on `device` (none on the CPU; bf16 on a CUDA GPU with bf16), or fp32 where the first
    step refused fit's automatic autocast (train/step/autocast_decider.py: DCGAN's and VAE's BCELoss)."""
    precision = resolve_precision(name, device)
    if precision.autocast_dtype is None:
        return contextlib.nullcontext
    if precision.use_scaler:
        pytest.skip("fp16 on this GPU: the author's loop would need its own GradScaler")
    return lambda: torch.autocast(device.type, dtype=precision.autocast_dtype)


def _differences(fit_state: dict, hand_state: dict, initial: dict, exact: bool) -> list[str]:
    out = []
    for name, ours in fit_state.items():
        theirs, start = hand_state[name], initial[name]
        if exact or not ours.is_floating_point():
            if not torch.equal(ours, theirs):
                diff = (ours.double() - theirs.double()).abs().max().item()
                out.append(f"{name}: max |difference| {diff:.3g}")
            continue
        ours, theirs, start = ours.double(), theirs.double(), start.double()
        gap = (ours - theirs).norm().item()
        bound = BF16_UPDATE_RTOL * (theirs - start).norm().item() + BF16_ATOL * ours.numel() ** 0.5 \
            * max(1.0, theirs.abs().max().item())
        if gap > bound:
            out.append(f"{name}: |fit - hand| {gap:.3g} > {bound:.3g}")
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_zoo_case_trains_through_fit_as_its_authors_loop(case: Case):
    device = _device()
    torch.manual_seed(SEED)
    model = case.make().to(device)
    hand_model = copy.deepcopy(model)  # the same initial weights and modes
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    given = modes(model)
    data = [move(b, device) for b in case.batches()]

    np.random.seed(SEED)
    config = gputrain.TrainConfig(**{"steps": len(data), "device": DEVICE, "seed": SEED, **case.config})
    history = gputrain.fit(model, data, config=config, **case.fit(model))
    used = history.summary["precision"]
    decided = {d["name"]: d for d in history.summary["decisions"]}["precision"]
    assert decided["value"] == used, "the summary and the decisions disagree on the precision"
    if used != resolve_precision("auto", device).name:  # fit's default undone: the reason says why
        assert used == "fp32" and "the first step failed under" in decided["reason"], decided["reason"]

    torch.manual_seed(SEED)  # fit seeds its run the same way (TrainConfig.seed)
    np.random.seed(SEED)
    # The author's loop in the precision fit used, TF32 as that precision sets it (on CUDA; given back after).
    with matmul_settings(resolve_precision(used, device), device):
        case.hand(hand_model, data, _amp(device, used))
    assert history.records and history.records[-1]["step"] == config.steps
    assert modes(model) == given, "fit left modules in other modes than the user gave"
    exact = device.type == "cpu"
    problems = _differences(model.state_dict(), hand_model.state_dict(), initial, exact)
    assert not problems, (f"{len(problems)} of {len(initial)} tensors differ from the author's loop in {used} "
                          f"({'bit-equal expected' if exact else 'bf16 tolerance'}): " + "; ".join(problems[:6]))


@pytest.mark.parametrize("case", REFUSALS, ids=[c.name for c in REFUSALS])
def test_zoo_refusal_is_one_line_at_the_start_and_writes_nothing(case: Refusal, tmp_path):
    """Models fit cannot train faithfully as their authors wrote them: refused before the run directory
    is made, in one line that says what and how to change it."""
    torch.manual_seed(SEED)
    model = case.make()
    run_dir = tmp_path / "run"
    with pytest.raises(gputrain.ConfigError, match=case.says) as refused:
        gputrain.fit(model, case.batches(), config=gputrain.TrainConfig(steps=2, device="cpu", seed=SEED,
                                                                        run_dir=str(run_dir)), **case.fit(model))
    assert "\n" not in str(refused.value)
    assert not run_dir.exists(), "a refused run wrote its run directory"
