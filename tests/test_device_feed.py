"""The device feed (data/device_feed.py): every host-fed source's batches reach the device through it,
read ahead on a side stream unless the source's own state is the position a checkpoint saves.

The side stream is CUDA's; here `side_stream_on_cpu` (conftest.py) stands in for it, so the order of
the work and the read-ahead rule run on the CPU as on a GPU. That the resumes stay exact with the
read-ahead on: test_data_resume.py. The CUDA side stream itself: tests/test_gpu_branches.py.
"""

import pytest
import torch
from helpers import batches, data, DataRows, DataStream, mlp
from torch import nn
from torch.utils.data import DataLoader, Sampler

from gputrain import TrainConfig, fit
from gputrain.data import make_loader
from gputrain.data.device_feed import to_device
from gputrain.checkpoint import CheckpointStore

CPU = torch.device("cpu")


def _logged(items, log):
    """`items` as an iterator that logs each read ("read", i)."""
    for i, item in enumerate(items):
        log.append(("read", i))
        yield item


def test_the_next_batch_is_read_and_its_copy_started_before_a_batch_is_handed_out(side_stream_on_cpu):
    log: list = []
    side_stream_on_cpu.events = log  # one log: the reads, the stand-in's copies and hand-overs, the uses
    for b in to_device(_logged([0, 1, 2], log), CPU, state_saved=False):
        log.append(("use", b))
    assert log == [("read", 0), ("copy", 0), ("hand over", 0), ("read", 1), ("copy", 1), ("use", 0),
                   ("hand over", 1), ("read", 2), ("copy", 2), ("use", 1),
                   ("hand over", 2), ("use", 2)]
    assert side_stream_on_cpu.streams == 1


def test_a_source_whose_state_is_saved_is_read_only_as_far_as_it_is_used(side_stream_on_cpu):
    log: list = []
    it = to_device(_logged([0, 1, 2], log), CPU, state_saved=True)
    assert next(it) == 0 and log == [("read", 0)]  # nothing past the batch the run holds
    assert list(it) == [1, 2] and side_stream_on_cpu.streams == 0 and side_stream_on_cpu.events == []


@pytest.mark.parametrize("state_saved", [False, True])
def test_without_a_side_stream_each_batch_moves_to_the_device_when_it_is_asked_for(state_saved):
    """The meta device stands for one that is not the CPU and has no side stream (MPS): each batch
    is moved, every tensor leaf, as it is used; other leaves pass through."""
    log: list = []
    x = [{"x": torch.ones(2, 3), "ids": ["a", "b"]}, {"x": torch.zeros(2, 3), "ids": ["c", "d"]}]
    it = to_device(_logged(x, log), torch.device("meta"), state_saved=state_saved)
    assert log == []
    first = next(it)
    assert log == [("read", 0)] and first["x"].device.type == "meta" and first["ids"] == ["a", "b"]
    assert first["x"].shape == (2, 3) and next(it)["x"].device.type == "meta"
    source = iter(x)
    assert to_device(source, CPU, state_saved=state_saved) is source  # on the CPU already


def test_a_batch_that_fails_to_load_while_read_ahead_is_named_and_the_step_before_it_is_checkpointed(
        tmp_path, side_stream_on_cpu):
    """Reading batch 6 fails while batch 5 is handed out: batch 5 still trains, and the error comes
    when batch 6 is asked for, so its note names batch 6 and the checkpoint is step 6's."""
    x, y = data(96)

    class Breaks:
        def __iter__(self):
            for i in range(12):
                if i == 6:
                    raise ValueError("cannot decode batch 6")
                yield x[8 * i:8 * i + 8], y[8 * i:8 * i + 8]

    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="cannot decode batch 6") as info:
        fit(mlp(), Breaks(), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", steps=20,
                                                                             run_dir=str(run_dir)))
    notes = "\n".join(info.value.__notes__)
    assert "loading batch 6 of epoch 0" in notes and "a checkpoint of step 6" in notes
    assert CheckpointStore(run_dir).latest_path().name == "step-000006.pt"
    assert side_stream_on_cpu.streams == 1


# ---------------------------------------------------------------- the rule, for every kind of data


class Backwards(Sampler):
    """A sampler of the user's own: gputrain uses the DataLoader as is."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))


def _hf(kind):
    datasets = pytest.importorskip("datasets")
    x, y = data(48)
    ds = datasets.Dataset.from_dict({"x": x.numpy(), "y": y.numpy()})
    return ds if kind == "map" else ds.to_iterable_dataset()


# (data, make_loader's keywords, whether the feed reads ahead): only a StatefulDataLoader's state is
# the saved position (torchdata is installed here, so gputrain builds one for every IterableDataset).
KINDS = {
    "a Dataset": (DataRows, {}, True),
    "host tensor columns": (lambda: data(48), {"on_device": False}, True),  # a DataLoader only off the CPU
    "a user DataLoader, rebuilt": (lambda: DataLoader(DataRows(), batch_size=8, shuffle=True), {}, True),
    "a user DataLoader as is": (lambda: DataLoader(DataRows(), batch_size=8, sampler=Backwards(48)), {}, True),
    "a user DataLoader, evaluated": (lambda: DataLoader(DataRows(), batch_size=8), {"train": False}, True),
    "a Hugging Face Dataset": (lambda: _hf("map"), {}, True),
    "a list of batches": (lambda: batches(48, 8), {}, True),
    "a generator of batches": (lambda: iter(batches(48, 8)), {}, True),
    "a plain DataLoader over an IterableDataset, as is": (
        lambda: DataLoader(DataStream(48), batch_size=8), {"rebuild_loader": False}, True),
    "an IterableDataset (a StatefulDataLoader)": (lambda: DataStream(48), {}, False),
    "a DataLoader over an IterableDataset (rebuilt stateful)": (lambda: DataLoader(DataStream(48), batch_size=8), {},
                                                                False),
    "a Hugging Face IterableDataset (a StatefulDataLoader)": (lambda: _hf("iterable"), {}, False),
}


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_data_reads_ahead_unless_its_loaders_state_is_the_saved_position(side_stream_on_cpu, kind):
    make, kwargs, ahead = KINDS[kind]
    kwargs = {"train": True, "num_workers": 0, **kwargs}
    if kind == "host tensor columns":  # tensor columns on the CPU are sliced; a GPU run's that do not fit
        from gputrain.data.loader import ColumnsByIndex, LoaderBatches

        x, y = make()
        source = LoaderBatches(ColumnsByIndex((x, y), len(x)), 8, device=CPU, shuffle=True, num_workers=0,
                               batched_dataset=True)
    else:
        source, _ = make_loader(make(), 8, device=CPU, **kwargs)
    got = list(source.iter_epoch(0, 0))
    assert len(got) == 6
    assert side_stream_on_cpu.streams == (1 if ahead else 0), kind
    copied = [b for what, b in side_stream_on_cpu.events if what == "hand over"]
    assert all(a is b for a, b in zip(copied, got, strict=True)) if ahead else copied == []
