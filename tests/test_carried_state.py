"""State a step carries between steps (train/step/carried_state.py): pytorch/examples' word language model
carries its LSTM's hidden state from batch to batch; stopped at any step (stop_at_step, or SIGTERM)
and resumed, it ends bit-equal to the straight run, with a step of your own (`step.state`) and with
the built-in loss rule (`fit(..., state=carry)`), in the one-file and the sharded format."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from gputrain import TrainConfig, fit
from gputrain.checkpoint.store import CheckpointStore
from gputrain.errors import CheckpointError, ConfigError, StopRequested

import word_lm
from helpers import params, sgd

STEPS = 30
CFG = dict(device="cpu", steps=STEPS, log_every=5, loggers=("csv",), seed=11, max_grad_norm=0.25)


SGD = sgd(5.0)  # every run of the word model here steps with the same plain SGD


def _run(how: str, config: TrainConfig, carry: dict | None = None, register: bool = True):
    """(model, history, carry) of one fit of the word model: `how` "own" (step_fn) or "rule" (compute_loss)."""
    model = word_lm.make_model()
    batches = word_lm.corpus_batches(STEPS)
    if how == "own":
        history = fit(model, batches, step_fn=word_lm.lm_step, optimizer=SGD, config=config)
        return model, history, None
    carry = {"hidden": None} if carry is None else carry
    history = fit(model, batches, compute_loss=word_lm.lm_loss(carry), optimizer=SGD, config=config,
                  state=carry if register else None)
    return model, history, carry


def _losses(history):
    return [r["loss"] for r in history.records]


STRAIGHT: dict[str, tuple] = {}


def _straight(how: str):
    if how not in STRAIGHT:
        model, history, _ = _run(how, TrainConfig(**CFG))
        STRAIGHT[how] = (params(model), _losses(history))
    return STRAIGHT[how]


@pytest.mark.parametrize("how", ["own", "rule"])
@pytest.mark.parametrize("stop,fmt", [(1, "file"), (11, "dcp"), (28, "file")])
def test_the_word_model_stopped_at_any_step_resumes_bit_equal_with_its_hidden_state(how, stop, fmt, tmp_path):
    weights, losses = _straight(how)
    cfg = TrainConfig(**CFG, run_dir=str(tmp_path / "run"), checkpoint_format=fmt)
    stopped, _, carry = _run(how, cfg.replace(stop_at_step=stop))
    assert not torch.equal(params(stopped), weights)
    assert CheckpointStore(tmp_path / "run").latest_path().name == f"step-{stop:06d}" + (".dcp" if fmt == "dcp" else ".pt")
    resumed, history, carry = _run(how, cfg.replace(resume=True))
    assert torch.equal(params(resumed), weights), f"{how}: stopped at {stop}, resumed weights differ"
    assert _losses(history) == pytest.approx(losses, rel=1e-6)  # the log points' sums group other steps
    if how == "rule":
        assert carry["hidden"][0].shape == (word_lm.NLAYERS, word_lm.BSZ, word_lm.NHID)


def test_without_the_hidden_state_in_the_checkpoint_the_resume_differs(tmp_path):
    """What the carried state buys: the same stop and resume with the hidden state not registered
    starts the second half from a fresh state, and ends elsewhere."""
    weights, _ = _straight("rule")
    cfg = TrainConfig(**CFG, run_dir=str(tmp_path / "run"))
    _run("rule", cfg.replace(stop_at_step=14), register=False)
    resumed, _, _ = _run("rule", cfg.replace(resume=True), register=False)
    assert not torch.equal(params(resumed), weights)


def test_a_sigterm_mid_run_checkpoints_the_hidden_state_and_the_resume_is_bit_equal(tmp_path):
    weights, losses = _straight("own")
    handler = signal.getsignal(signal.SIGTERM)

    def stopping_step(step, batch):
        loss = word_lm.lm_step(step, batch)
        if step.index == 16:  # this step finishes, then the run stops
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    cfg = TrainConfig(**CFG, run_dir=str(tmp_path / "run"))
    with pytest.raises(StopRequested) as info:
        fit(word_lm.make_model(), word_lm.corpus_batches(STEPS), step_fn=stopping_step, optimizer=SGD, config=cfg)
    assert info.value.step == 17 and signal.getsignal(signal.SIGTERM) is handler
    resumed, history, _ = _run("own", cfg.replace(resume=True))
    assert torch.equal(params(resumed), weights)
    assert _losses(history) == pytest.approx(losses, rel=1e-6)


class Queue:
    """A Stateful object a step keeps (a queue of recent batch means): registered late, by the step."""

    def __init__(self):
        self.items: list[float] = []
        self.loaded = 0

    def state_dict(self):
        return {"items": list(self.items)}

    def load_state_dict(self, state):
        self.items = list(state["items"])
        self.loaded += 1


def test_an_object_registered_by_the_step_after_the_resume_gets_its_saved_state(tmp_path):
    """step.state["queue"] = Queue() on the first step of the resumed run: its saved state is loaded
    into it then; a counter (a plain int) comes back as it was."""
    seen = []

    def step_fn(step, batch):
        if "queue" not in step.state:
            step.state["queue"] = Queue()
            seen.append((step.index, list(step.state["queue"].items), step.state.get("count")))
        step.state["queue"].items = (step.state["queue"].items + [step.index])[-3:]
        step.state["count"] = step.state.get("count", 0) + 1
        return word_lm.lm_step(step, batch)

    cfg = TrainConfig(**CFG, run_dir=str(tmp_path / "run"))
    fit(word_lm.make_model(), word_lm.corpus_batches(STEPS), step_fn=step_fn, optimizer=SGD,
        config=cfg.replace(stop_at_step=9))
    fit(word_lm.make_model(), word_lm.corpus_batches(STEPS), step_fn=step_fn, optimizer=SGD,
        config=cfg.replace(resume=True))
    assert seen == [(0, [], None), (9, [6, 7, 8], 9)]


def test_an_entry_a_step_deletes_is_gone_from_the_user_dict_and_the_checkpoint():
    """`del step.state[name]` removes it from the dict the user gave (kept in place), and the next
    checkpoint holds no entry of that name."""
    from gputrain.train.step.carried_state import CarriedState

    given = {"hidden": torch.ones(2), "scratch": 3}
    state = CarriedState(given, torch.device("cpu"))
    del state["scratch"]
    assert "scratch" not in given and list(state) == ["hidden"] and len(state) == 1
    assert set(state.state_dict()["values"]) == {"hidden"}
    with pytest.raises(KeyError):
        del state["scratch"]


def test_bad_state_is_one_clear_line(tmp_path):
    with pytest.raises(ConfigError, match="state= is a list: give a dict"):
        _run("rule", TrainConfig(**CFG), carry=[1, 2])  # type: ignore[arg-type]
    from gputrain.train.step.carried_state import CarriedState

    carried = CarriedState({"hidden": torch.zeros(2)}, torch.device("cpu"))
    assert list(carried) == ["hidden"] and [v.shape for v in carried.values()] == [(2,)]  # a mapping
    with pytest.raises(CheckpointError, match="saved by another number of processes"):
        carried.load_shared(carried.state_dict())
    carried.load_shared({"values": {}, "objects": {}})  # nothing carried: any process count resumes


def test_cuda_graphs_do_not_capture_steps_that_carry_state_and_say_why(capture_graphs):
    """A captured step runs its Python once: the hidden state would not be carried. Asked for graphs,
    the run with fit(state=...) and the one writing step.state capture nothing, train as the eager
    reference does, and their decisions say why."""
    from graph_capture import CaptureGraphs, EagerGraphs

    def run(how):
        model = word_lm.make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), fused=True, capturable=True)
        cfg = TrainConfig(**CFG, cuda_graphs=True)
        if how == "own":
            history = fit(model, word_lm.corpus_batches(STEPS), step_fn=word_lm.lm_step, optimizer=opt, config=cfg)
        else:
            carry = {"hidden": None}
            history = fit(model, word_lm.corpus_batches(STEPS), compute_loss=word_lm.lm_loss(carry), optimizer=opt,
                          config=cfg, state=carry)
        return params(model), history.summary

    for how, why in (("rule", "fit(state=...) was given"), ("own", "your step_fn writes step.state")):
        capture_graphs(CaptureGraphs)
        weights, summary = run(how)
        assert not [g for b in CaptureGraphs.instances for g in b.graphs], how
        assert summary["cuda_graphs"].startswith(f"off: {why}")
        row = next(d for d in summary["decisions"] if d["name"] == "cuda_graphs")
        assert row["value"] == "off" and row["reason"].startswith(why)
        capture_graphs(EagerGraphs)
        assert torch.equal(weights, run(how)[0])


def test_a_checkpoint_written_before_carried_state_resumes_with_the_state_as_it_is():
    """An older checkpoint has no "carried" part: the run's carried state keeps its value."""
    from gputrain.checkpoint.parts import RunCheckpoint
    from gputrain.runtime.distributed import DistInfo
    from gputrain.train.step.carried_state import CarriedState

    carried = CarriedState({"hidden": torch.ones(2)}, torch.device("cpu"))
    RunCheckpoint({"carried": carried}, DistInfo(enabled=False), dict).load_state_dict({"step": 3})
    assert torch.equal(carried["hidden"], torch.ones(2))
    saved = carried.state_dict()
    carried["hidden"] = torch.zeros(2)
    RunCheckpoint({"carried": carried}, DistInfo(enabled=False), dict).load_state_dict({"carried": saved})
    assert torch.equal(carried["hidden"], torch.ones(2))
