"""An automatic autocast that the model's first step refuses becomes fp32 for the run
(train/step/autocast_decider.py); a requested one is never changed, and the note after its failure names it.

Simulated on the CPU, and why: the refusal is CUDA autocast's (torch raises "torch.nn.functional.
binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast" only under CUDA autocast; CPU autocast
runs them), and fit's automatic precision is bf16 autocast only on a CUDA GPU, while the suite's CUDA
stand-in (conftest.py's fake_cuda) reports a GPU but makes no CUDA tensor, so no step can run on it.
So here `resolve_precision("auto", cpu)` answers bf16 autocast, as it does on an H100 (monkeypatched),
and the loss is F.binary_cross_entropy as CUDA autocast treats it: refused with torch's own message
while autocast is on (`torch.is_autocast_enabled("cpu")`). The second case needs no message at all:
an index_put of the bf16 result into an fp32 tensor fails under autocast only, which the gate finds
by running the batch once more without autocast on a copy of the model. Everything else is fit's own
path: its step (fit's and a step of your own), its layout gate, its evaluator, its summary.
"""

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gputrain
from gputrain.runtime import precision as precision_mod
from gputrain.runtime.precision import Precision, RunPrecision, fp32_instead
from gputrain.train.loop import build as trainer_mod

SEED = 0
# torch's message for the ops its CUDA autocast refuses (aten/src/ATen/autocast_mode.cpp), first lines.
TORCH_REFUSAL = ("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
                 "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
                 "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
                 "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
                 "safe to autocast.")


def cuda_autocast_bce(pred, target):
    """F.binary_cross_entropy as CUDA autocast treats it: refused while autocast is on."""
    if torch.is_autocast_enabled("cpu"):
        raise RuntimeError(TORCH_REFUSAL)  # REFUSED_LINE
    return F.binary_cross_entropy(pred, target)


REFUSED_LINE = next(i for i, line in enumerate(inspect.getsource(inspect.getmodule(cuda_autocast_bce)).splitlines(), 1)
                    if line.strip().endswith("# REFUSED_LINE"))


class Discriminator(nn.Module):
    """BatchNorm and dropout before the refused loss (as DCGAN's discriminator): the failed attempt has
    updated the running statistics and drawn random numbers, which the retry must not see."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))

    def forward(self, x):
        return torch.sigmoid(self.body(x)).squeeze(1)


class IndexPut(nn.Module):
    """Writes its layer's output into an fp32 buffer: fine in fp32, 'dtypes match' error under autocast."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        out = torch.zeros(x.shape[0], 3)
        out.index_put_((torch.arange(x.shape[0]),), self.lin(x))  # INDEX_PUT_LINE
        return out


def _batches(n=4, targets="binary"):
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(8, 6, generator=g) for _ in range(n)]
    if targets == "binary":
        return [(xi, torch.randint(0, 2, (8,), generator=g).float()) for xi in x]
    return [(xi, torch.randint(0, 3, (8,), generator=g)) for xi in x]


@pytest.fixture
def auto_bf16(monkeypatch):
    """fit's automatic precision answers bf16 autocast on the CPU, as on a CUDA GPU with bf16."""
    real = precision_mod.resolve_precision

    def resolve(spec, device):
        if (spec or "auto").strip().lower() == "auto":
            return Precision("bf16", torch.bfloat16, False, False, "auto: bf16 autocast (as on a GPU with bf16)")
        return real(spec, device)

    monkeypatch.setattr(trainer_mod, "resolve_precision", resolve)


def _hand_fp32(model, batches, loss_fn):
    """The user's own fp32 loop on the same batches, from the seed fit uses."""
    torch.manual_seed(SEED)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()


def _fit(model, batches, loss_fn, eval_data=None, **cfg):
    return gputrain.fit(model, batches, loss_fn=loss_fn, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                        eval_data=eval_data, config=gputrain.TrainConfig(steps=len(batches), seed=SEED, **cfg))


def _precision(history) -> dict:
    return {d["name"]: d for d in history.summary["decisions"]}["precision"]


def test_auto_autocast_refused_by_the_first_step_trains_in_fp32_as_the_hand_loop(auto_bf16, caplog):
    torch.manual_seed(SEED)
    model = Discriminator()
    hand = copy.deepcopy(model)
    batches = _batches()
    with caplog.at_level("WARNING", logger="gputrain"):
        history = _fit(model, batches, cuda_autocast_bce, eval_data=batches[:2])
    assert history.records[-1]["step"] == len(batches)
    decision = _precision(history)
    assert decision["value"] == "fp32" and history.summary["precision"] == "fp32"
    reason = decision["reason"]
    assert "bf16 autocast" in reason and "binary_cross_entropy" in reason and "unsafe to autocast" in reason
    assert f"{__file__}:{REFUSED_LINE}" in reason, reason  # the user's code that autocast broke
    assert [r for r in caplog.records if "trains in fp32" in r.getMessage()], "one log line says so"
    _hand_fp32(hand, batches, cuda_autocast_bce)
    for (name, ours), theirs in zip(model.state_dict().items(), hand.state_dict().values()):
        assert torch.equal(ours, theirs), f"{name} differs from the fp32 loop"


def test_an_error_only_autocast_raises_is_found_on_a_copy_without_autocast(auto_bf16):
    torch.manual_seed(SEED)
    model = IndexPut()
    hand = copy.deepcopy(model)
    batches = _batches(targets="classes")
    history = _fit(model, batches, nn.CrossEntropyLoss())
    reason = _precision(history)["reason"]
    assert _precision(history)["value"] == "fp32"
    assert "dtypes match" in reason and "runs without autocast" in reason and "INDEX_PUT_LINE" in reason, reason
    _hand_fp32(hand, batches, nn.CrossEntropyLoss())
    for ours, theirs in zip(model.parameters(), hand.parameters()):
        assert torch.equal(ours, theirs)


def test_an_error_that_fp32_raises_too_keeps_autocast_and_names_it_first(auto_bf16):
    model = nn.Sequential(nn.Linear(5, 3))  # the batches have 6 features: fails in any precision
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        _fit(model, _batches(targets="classes"), nn.CrossEntropyLoss())
    note = [n for n in info.value.__notes__ if "first training step failed" in n][0]
    assert "choices gputrain made for you" in note and "bf16 autocast (off: precision='fp32'" in note
    assert note.index("bf16 autocast") < note.index("the batch:")


def test_a_requested_autocast_is_not_changed_and_the_note_names_it_first():
    model = Discriminator()
    with pytest.raises(RuntimeError, match="unsafe to autocast") as info:  # real bf16 autocast on the CPU
        _fit(model, _batches(), cuda_autocast_bce, precision="bf16")
    note = [n for n in info.value.__notes__ if "first training step failed" in n][0]
    assert "a choice you made" in note and "bf16 autocast, as you requested (off: precision='fp32'" in note
    assert note.index("bf16 autocast") < note.index("the batch:")


def test_a_checkpoint_saved_after_the_fall_back_resumes_into_an_automatic_fp16_run():
    """fp16's GradScaler refuses the empty state a run without loss scaling saved; the resumed run,
    whose first step decides again, starts from the initial scale."""
    cpu = torch.device("cpu")
    after = RunPrecision(Precision("fp16", torch.float16, True, False, "auto: fp16"), cpu)
    after.change(fp32_instead(after.precision, "refused"))
    saved = after.state_dict()
    assert saved == {} and after.name == "fp32" and not after.scaler.is_enabled()
    resumed = RunPrecision(Precision("fp16", torch.float16, True, False, "auto: fp16"), cpu)
    resumed.load_state_dict(saved)
    assert resumed.scaler.is_enabled() and resumed.scaler.get_scale() == 2.0 ** 16


class TwoNets(nn.Module):
    def __init__(self):
        super().__init__()
        self.d, self.g = Discriminator(), nn.Linear(6, 6)


def _two_optimizers(model):
    return {"D": torch.optim.Adam(model.d.parameters(), lr=1e-2), "G": torch.optim.Adam(model.g.parameters(), lr=1e-2)}


def _gan_step(step, batch):
    """DCGAN's order: the discriminator's refused loss first, then the generator's."""
    x, y = batch
    d, g = step.model.d, step.model.g
    err_d = cuda_autocast_bce(d(x), y)
    step.backward(err_d)
    step.step("D")
    step.zero_grad("G")
    err_g = cuda_autocast_bce(d(g(x)), torch.ones_like(y))
    step.backward(err_g)
    step.step("G")
    return {"err_d": err_d, "err_g": err_g}


def _stepped_first(step, batch):
    """The discriminator's optimizer steps before the refused loss: the weights have moved."""
    x, y = batch
    err_d = F.mse_loss(step.model.d(x), y)
    step.backward(err_d)
    step.step("D")
    err_g = cuda_autocast_bce(step.model.d(step.model.g(x)), y)
    step.backward(err_g)
    step.step("G")
    return {"err_d": err_d, "err_g": err_g}


def test_a_step_of_your_own_falls_back_unless_it_stepped_before_the_error(auto_bf16):
    torch.manual_seed(SEED)
    model = TwoNets()
    hand = copy.deepcopy(model)
    batches = _batches()
    history = gputrain.fit(model, batches, step_fn=_gan_step, optimizer=_two_optimizers(model),
                           config=gputrain.TrainConfig(steps=len(batches), seed=SEED))
    assert _precision(history)["value"] == "fp32"
    torch.manual_seed(SEED)
    opts = _two_optimizers(hand)
    hand.train()
    for x, y in batches:  # the same step by hand, in fp32
        for o in opts.values():
            o.zero_grad()
        cuda_autocast_bce(hand.d(x), y).backward()
        opts["D"].step()
        opts["G"].zero_grad()
        cuda_autocast_bce(hand.d(hand.g(x)), torch.ones_like(y)).backward()
        opts["G"].step()
    for (name, ours), theirs in zip(model.state_dict().items(), hand.state_dict().values()):
        assert torch.equal(ours, theirs), f"{name} differs from the fp32 loop"

    model = TwoNets()
    with pytest.raises(RuntimeError, match="unsafe to autocast"):
        gputrain.fit(model, batches, step_fn=_stepped_first, optimizer=_two_optimizers(model),
                     config=gputrain.TrainConfig(steps=len(batches), seed=SEED))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 1)

    def forward(self, x):
        return torch.sigmoid(self.fc(F.relu(self.conv(x)).reshape(x.shape[0], -1))).squeeze(1)


def test_autocasts_refusal_in_a_forced_channels_last_step_is_not_blamed_on_the_layout(auto_bf16, caplog):
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 2, (8,), generator=g).float())
               for _ in range(3)]
    model = ConvNet()
    with caplog.at_level("WARNING", logger="gputrain"):
        history = _fit(model, batches, cuda_autocast_bce, channels_last=True)
    layout = {d["name"]: d for d in history.summary["decisions"]}["channels_last"]
    assert _precision(history)["value"] == "fp32" and layout["value"] == "on", layout
    assert not [r for r in caplog.records if "runs again in your layout" in r.getMessage()]
