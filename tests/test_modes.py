"""Modes as the user set them (train/modes.py): eval-mode submodules stay in eval mode while fit trains,
evaluation returns to the mixed state, and fit / evaluate / predict leave every module as it was."""

import logging

import torch
import torch.nn.functional as F
from torch import nn
from helpers import modes

import gputrain
from gputrain.train.modes import UserModes, eval_mode


class Distill(nn.Module):
    """A student and a dropout + BatchNorm teacher that the user sets to eval mode."""

    def __init__(self):
        super().__init__()
        self.student = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 3))
        self.teacher = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 3))

    def forward(self, x):
        return self.student(x)


def _data(n=64):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_eval_mode_teacher_stays_in_eval_mode_during_and_after_fit(caplog):
    torch.manual_seed(0)
    model = Distill()
    model.teacher.eval()
    given = modes(model)
    stats = model.teacher[1].running_mean.clone()
    seen = []

    def compute_loss(m, batch):
        x, y = batch
        if torch.is_grad_enabled():  # a training step (evaluation runs without gradients, all in eval mode)
            seen.append((m.training, m.student.training, m.teacher.training, m.teacher[2].training))
        with torch.no_grad():
            t = m.teacher(x)
        s = m.student(x)
        return F.cross_entropy(s, y) + F.mse_loss(s, t)

    x, y = _data()
    with caplog.at_level(logging.INFO, logger="gputrain"):
        history = gputrain.fit(model, (x, y), compute_loss=compute_loss, eval_data=(x, y),
                               config=gputrain.TrainConfig(steps=6, batch_size=16, eval_every=3, log_every=3))
    assert seen and all(s == (True, True, False, False) for s in seen), seen  # after evaluation too
    assert torch.equal(model.teacher[1].running_mean, stats)  # eval-mode BatchNorm never updated
    assert modes(model) == given
    assert "kept in eval mode as you set it: teacher (5 modules)" in caplog.text
    rows = {d["name"]: d for d in history.summary["decisions"]}
    assert rows["modes"]["value"] == "kept in eval mode as you set it: teacher (5 modules)"


def test_whole_model_in_eval_mode_trains_in_train_mode_and_is_given_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 3)).eval()
    seen = []
    model.register_forward_pre_hook(lambda m, a: seen.append(m[1].training))
    x, y = _data()
    history = gputrain.fit(model, (x, y), loss_fn=nn.CrossEntropyLoss(),
                           config=gputrain.TrainConfig(steps=2, batch_size=16))
    assert seen == [True, True]
    assert not any(m.training for m in model.modules())
    assert {d["name"]: d for d in history.summary["decisions"]}["modes"]["value"] == "train mode"


def test_evaluate_and_predict_leave_a_mixed_state_as_found():
    model = Distill()
    model.teacher.eval()
    model.teacher[2].train()  # a mode set flag by flag survives too
    given = modes(model)
    x, y = _data(32)
    seen = []
    model.student.register_forward_pre_hook(lambda m, a: seen.append(any(s.training for s in model.modules())))
    gputrain.evaluate(model, (x, y), loss_fn=nn.CrossEntropyLoss())
    gputrain.predict(model, x)
    assert len(seen) == 2 and not any(seen)  # all in eval mode inside
    assert modes(model) == given


def test_user_modes_train_and_restore_flag_by_flag():
    model = Distill()
    model.teacher.eval()
    modes = UserModes(model)
    assert modes.describe() == "teacher (5 modules)"
    modes.train()
    assert model.student.training and not model.teacher.training and not model.teacher[1].training
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert model.student.training and not model.teacher.training  # the mixed state again
    model.eval()
    modes.restore()
    assert model.training and model.student[1].training and not model.teacher[3].training


class OwnTrainRoutine(nn.Module):
    """pytorch/examples' mnist_forward_forward names its training routine `train(x_pos, x_neg)` (Net and
    each Layer); here with the layers registered (nn.ModuleList) and a dropout that shows the mode."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([ForwardForwardLayer(6, 16), ForwardForwardLayer(16, 3)])
        self.dropout = nn.Dropout(0.5)

    def forward(self, x):
        return self.layers[1](self.dropout(self.layers[0](x)))

    def train(self, x_pos, x_neg):  # the authors' routine: not nn.Module.train(mode)
        raise AssertionError("fit called the model's own training routine")


class ForwardForwardLayer(nn.Linear):
    def train(self, x_pos, x_neg):
        raise AssertionError("fit called a layer's own training routine")


def test_a_train_method_of_another_meaning_is_left_alone_and_modes_set_flag_by_flag(caplog):
    model = OwnTrainRoutine()
    for m in model.modules():
        m.training = False  # as given: wholly in eval mode (nn.Module.eval() would call the routine)
    seen = []
    model.dropout.register_forward_pre_hook(lambda m, a: seen.append(m.training))
    x, y = _data()
    caplog.set_level(logging.INFO, "gputrain")
    history = gputrain.fit(model, (x, y), loss_fn=nn.CrossEntropyLoss(), eval_data=(x, y),
                           callbacks=[gputrain.EMA(0.9)],  # its averaged copy is put in eval mode too
                           config=gputrain.TrainConfig(steps=2, batch_size=16, log_every=1))
    assert seen[:1] == [True] and False in seen  # trained in train mode, evaluated in eval mode
    gputrain.predict(model, x)
    assert not any(m.training for m in model.modules())  # given back as found
    said = "OwnTrainRoutine.train(x_pos, x_neg), ForwardForwardLayer.train(x_pos, x_neg) is not nn.Module.train(mode)"
    assert said in caplog.text
    assert said in {d["name"]: d for d in history.summary["decisions"]}["modes"]["reason"]


def test_a_train_override_that_takes_a_mode_is_still_called():
    class FrozenNorm(nn.Module):  # the usual override: BatchNorm statistics frozen whenever train() is called
        def __init__(self):
            super().__init__()
            self.fc, self.bn = nn.Linear(6, 8), nn.BatchNorm1d(8)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.bn(self.fc(x)))

        def train(self, mode=True):
            super().train(mode)
            self.bn.eval()
            return self

    model = FrozenNorm().eval()
    before = model.bn.running_mean.clone()
    x, y = _data()
    gputrain.fit(model, (x, y), loss_fn=nn.CrossEntropyLoss(), config=gputrain.TrainConfig(steps=2, batch_size=16))
    assert torch.equal(model.bn.running_mean, before)  # the override ran: the statistics stayed frozen
    assert UserModes(model).other_trains == []
