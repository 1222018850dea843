"""Exact resume mid-epoch for every kind of data: the data position is part of the checkpoint.

Each case trains a model with dropout (so the global RNG matters too), stops in the middle of an
epoch (stop_at_step), resumes in a fresh fit from the run directory, and must end with exactly the
parameters of an uninterrupted run. Leaving the data position out of the checkpoint makes every
case here fail (the resumed run would start the epoch, or the stream, from its beginning).
Several processes: test_distributed_data.py.
"""

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from helpers import SignalAt, data, mlp, params
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from gputrain import TrainConfig, fit
from gputrain.data import make_loader
from gputrain.errors import DataError, StopRequested

CPU = torch.device("cpu")
CFG = dict(device="cpu", batch_size=8, log_every=3, seed=4)


def model():
    return mlp(dropout=0.3)


def stop_and_resume(tmp_path, make_data, steps, stop, caplog=None, cfg=None, by="stop_at_step", **kw):
    """(uninterrupted, resumed) parameters, and the resumed fit's History. `by`: how the run stops
    after step `stop`: "stop_at_step", or "sigterm" (sent to this process in the forward of that
    step, as a scheduler would: the step finishes, is checkpointed, fit raises StopRequested)."""
    cfg = {**CFG, **(cfg or {}), "steps": steps}
    full = model()
    fit(full, make_data(), config=TrainConfig(**cfg), **kw)
    run_dir = str(tmp_path / "run")
    if by == "sigterm":
        with pytest.raises(StopRequested) as stopped:
            fit(SignalAt(model(), at=stop), make_data(), config=TrainConfig(**cfg, run_dir=run_dir), **kw)
        assert stopped.value.exit_code == 143 and stopped.value.step == stop
    else:
        fit(model(), make_data(), config=TrainConfig(**cfg, run_dir=run_dir, stop_at_step=stop), **kw)
    resumed = mlp(dropout=0.3, seed=11)  # other weights: the checkpoint must replace them
    if caplog is not None:
        caplog.clear()
    target = SignalAt(resumed, at=-1) if by == "sigterm" else resumed  # the stopped run's module names
    h = fit(target, make_data(), config=TrainConfig(**cfg, run_dir=run_dir, resume=True), **kw)
    return params(full), params(resumed), h


class Samples(Dataset):
    """helpers.data as a map-style Dataset that counts its __getitem__ calls."""

    reads = 0

    def __init__(self, n=96):
        self.x, self.y = data(n)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        Samples.reads += 1
        return self.x[i], self.y[i]


def test_tensors(tmp_path):
    full, resumed, _ = stop_and_resume(tmp_path, lambda: data(96), steps=20, stop=5, loss_fn=nn.CrossEntropyLoss())
    assert torch.equal(full, resumed)


@pytest.mark.processes
@pytest.mark.parametrize("by", ["stop_at_step", "sigterm"])
def test_a_map_style_dataset_with_two_workers(tmp_path, by):
    full, resumed, _ = stop_and_resume(tmp_path, Samples, steps=16, stop=5, cfg={"num_workers": 2}, by=by,
                                       loss_fn=nn.CrossEntropyLoss())
    assert torch.equal(full, resumed)


@pytest.mark.parametrize("by", ["stop_at_step", "sigterm"])
def test_a_user_dataloader_with_shuffle_is_rebuilt_not_reread(tmp_path, caplog, by):
    """shuffle=True and no generator of its own: as is, its order and its workers' seed would come
    from the global RNG (the 0.015 / 0.032 differences of issue 22); rebuilt, it is the run's."""
    caplog.set_level(logging.WARNING, "gputrain")
    full, resumed, h = stop_and_resume(tmp_path, lambda: DataLoader(Samples(), batch_size=8, shuffle=True),
                                       steps=20, stop=5, loss_fn=nn.CrossEntropyLoss(), caplog=caplog, by=by)
    assert torch.equal(full, resumed)
    assert "read again" not in caplog.text


@pytest.mark.parametrize("stop", [12, 17], ids=["at an epoch's end", "mid-epoch"])
@pytest.mark.parametrize("make, cfg", [(lambda: DataLoader(Samples(), batch_size=8), {}),
                                       (lambda: DataLoader(Samples(), batch_size=8), {"rebuild_loader": False}),
                                       (lambda: DataLoader(Numbers(), batch_size=8), {})],
                         ids=["rebuilt", "as is", "over an IterableDataset"])
def test_the_global_rng_draw_of_your_dataloaders_iter_keeps_the_resume_exact(tmp_path, make, cfg, stop):
    """fit draws the number your DataLoader's iter() takes from the global RNG at each epoch's start
    (data/loader.py, draw_base_seed): a run resumed at an epoch's end draws it as the uninterrupted one
    did, a run resumed mid-epoch (after the draw, which its checkpoint's RNG state holds) does not."""
    full, resumed, _ = stop_and_resume(tmp_path, make, steps=30, stop=stop, cfg=cfg, loss_fn=nn.CrossEntropyLoss())
    assert torch.equal(full, resumed)


def test_the_rebuilt_loader_reads_only_the_samples_it_trains_on(tmp_path):
    run_dir = str(tmp_path / "run")
    loader = lambda: DataLoader(Samples(), batch_size=8, shuffle=True)  # noqa: E731
    fit(model(), loader(), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**CFG, steps=10, run_dir=run_dir,
                                                                            stop_at_step=7))
    Samples.reads = 0
    fit(model(), loader(), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**CFG, steps=10, run_dir=run_dir,
                                                                            resume=True))
    assert Samples.reads == 3 * 8  # steps 8-10 only: the 7 batches before were not read again


class Numbers(IterableDataset):
    """helpers.data as a stream with a state of its own (where it is), as a StatefulDataLoader saves it."""

    def __init__(self, n=96):
        self.x, self.y = data(n)
        self.start = 0
        self.produced = 0

    def __iter__(self):
        i = self.start
        self.start = 0
        while i < len(self.x):
            self.position = i + 1
            self.produced += 1
            yield self.x[i], self.y[i]
            i += 1

    def state_dict(self):
        return {"position": getattr(self, "position", 0)}

    def load_state_dict(self, state):
        self.start = state["position"]


@pytest.mark.parametrize("by", ["stop_at_step", "sigterm"])
def test_a_stateful_dataloader_over_an_iterable_dataset_restores_its_state(tmp_path, caplog, by):
    from torchdata.stateful_dataloader import StatefulDataLoader

    caplog.set_level(logging.WARNING, "gputrain")
    made = []

    def make():
        made.append(Numbers())
        return StatefulDataLoader(made[-1], batch_size=8)

    # 12 batches per pass: stop after step 17, in the second pass; the resumed run makes 13 steps.
    full, resumed, _ = stop_and_resume(tmp_path, make, steps=30, stop=17, loss_fn=nn.CrossEntropyLoss(),
                                       caplog=caplog, by=by)
    assert torch.equal(full, resumed)
    assert made[-1].produced == 13 * 8 and "read again" not in caplog.text  # from its state, nothing re-read


def test_a_plain_dataloader_over_an_iterable_dataset_becomes_stateful(tmp_path):
    made = []

    def make():
        made.append(Numbers())
        return DataLoader(made[-1], batch_size=8)

    full, resumed, h = stop_and_resume(tmp_path, make, steps=30, stop=17, loss_fn=nn.CrossEntropyLoss())
    assert torch.equal(full, resumed) and made[-1].produced == 13 * 8
    assert "StatefulDataLoader" in h.summary["data_reason"]


class CountedBatches:
    """A list of batches as a re-iterable that is no list (no index): a resume can only count its way in.
    `reads`: the batches its iterators gave."""

    def __init__(self, batches):
        self.batches, self.reads = batches, 0

    def __iter__(self):
        for b in self.batches:
            self.reads += 1
            yield b

    def __len__(self):
        return len(self.batches)


def test_a_list_of_batches_resumes_at_its_index_and_an_iterable_without_state_by_counting(tmp_path, caplog):
    x, y = data(96)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 96, 8)]
    caplog.set_level(logging.WARNING, "gputrain")
    full, resumed, _ = stop_and_resume(tmp_path, lambda: list(batches), steps=30, stop=17,
                                       loss_fn=nn.CrossEntropyLoss(), caplog=caplog)
    assert torch.equal(full, resumed)
    assert "resuming" not in caplog.text  # a list is indexed: nothing read again, nothing to install
    made = []

    def counted():
        made.append(CountedBatches(batches))
        return made[-1]

    full, resumed, _ = stop_and_resume(tmp_path / "counted", counted, steps=30, stop=17,
                                       loss_fn=nn.CrossEntropyLoss(), caplog=caplog)
    assert torch.equal(full, resumed) and made[-1].reads == 5 + 13  # 5 read again, then steps 18-30
    assert "resuming the CountedBatches at batch 5 of epoch 1: it has no saved state here, so the 5 batches before " \
           "it are read again (a list of batches resumes at its index)" in caplog.text
    assert "torchdata" not in caplog.text


def test_without_torchdata_a_dataloader_over_an_iterable_dataset_says_to_install_it(monkeypatch, caplog):
    from gputrain.data import iterable

    monkeypatch.setattr(iterable, "stateful_loader_class", lambda: None)  # torchdata not installed
    caplog.set_level(logging.WARNING, "gputrain")
    source, _ = make_loader(DataLoader(Numbers(), batch_size=8), 8, device=CPU, train=True)
    assert len(list(source.iter_epoch(0, 3))) == 9  # 12 batches, the first 3 read again and dropped
    assert "the 3 batches before it are read again (install torchdata: pip install gputrain[data])" in caplog.text


@pytest.mark.parametrize("by", ["stop_at_step", "sigterm"])
def test_a_hugging_face_streaming_dataset(tmp_path, caplog, by):
    datasets = pytest.importorskip("datasets")
    x, y = data(96)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"x": x[i].tolist(), "y": int(y[i])}) + "\n" for i in range(96)))

    def make():
        return datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)

    def loss(m, batch):
        return F.cross_entropy(m(batch["x"]), batch["y"])

    caplog.set_level(logging.WARNING, "gputrain")
    full, resumed, h = stop_and_resume(tmp_path, make, steps=30, stop=17, compute_loss=loss, caplog=caplog, by=by)
    assert torch.equal(full, resumed)
    assert "read again" not in caplog.text  # the dataset's own state_dict(), through the StatefulDataLoader


def _stateful_numbers():
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(Numbers(), batch_size=8)


def _list_of_batches():
    x, y = data(96)
    return [(x[i:i + 8], y[i:i + 8]) for i in range(0, 96, 8)]


@pytest.mark.parametrize("make, ahead", [(Samples, True), (lambda: DataLoader(Samples(), batch_size=8, shuffle=True),
                                                            True),
                                         (_list_of_batches, True), (_stateful_numbers, False)],
                         ids=["a Dataset", "a user DataLoader", "a list of batches", "a StatefulDataLoader"])
def test_reading_ahead_as_on_a_gpu_keeps_the_resume_exact(tmp_path, side_stream_on_cpu, make, ahead):
    """With the device feed reading ahead as on CUDA (the side stream stood in for on the CPU): a
    position that is a count is not moved by the batch read ahead, and a StatefulDataLoader, whose
    state is the position, is not read ahead (read ahead, its state would be a batch past the step)."""
    full, resumed, _ = stop_and_resume(tmp_path, make, steps=30, stop=17, loss_fn=nn.CrossEntropyLoss())
    assert torch.equal(full, resumed)
    assert (side_stream_on_cpu.streams > 0) == ahead


# ---------------------------------------------------------------- several processes, without starting them


def test_a_user_dataloader_is_sharded_by_rank_when_rebuilt():
    ds = Samples(40)
    ids = []
    for rank in (0, 1):
        source, placement = make_loader(DataLoader(ds, batch_size=4, shuffle=True, drop_last=True), 99, device=CPU,
                                        train=True, seed=1, rank=rank, world_size=2)
        assert "sharded across 2 processes" in placement.reason and len(source) == 5
        ids.append([int(v) for xb, yb in source.iter_epoch(3) for v in (xb[:, 0] * 1e6).round()])
    assert len(ids[0]) == len(ids[1]) == 20 and not set(ids[0]) & set(ids[1])


def test_a_dataloader_that_cannot_be_sharded_is_refused_with_the_reason():
    from torch.utils.data import WeightedRandomSampler

    ds = Samples(40)
    weighted = DataLoader(ds, batch_size=4, sampler=WeightedRandomSampler([1.0] * 40, 40))
    with pytest.raises(DataError, match="WeightedRandomSampler.*DistributedSampler.*rebuild_loader=False"):
        make_loader(weighted, 4, device=CPU, train=True, rank=0, world_size=2)
    with pytest.raises(DataError, match="IterableDataset.*Sharded"):
        make_loader(DataLoader(Numbers(), batch_size=4), 4, device=CPU, train=True, rank=0, world_size=2)
    with pytest.raises(DataError, match="Sharded"):
        make_loader(Numbers(), 4, device=CPU, train=True, rank=0, world_size=2)
    # kept as is on request, with the warning of old
    source, placement = make_loader(weighted, 4, device=CPU, train=True, rank=0, world_size=2, rebuild_loader=False)
    assert "used as is" in placement.reason
