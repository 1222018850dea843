"""Bring your own data: iterables of any kind, bad data said clearly, and what the run says it used.

(Exact resume of each kind of data: test_data_resume.py; Hugging Face datasets: test_hf_data.py.)
"""

import copy
import logging
import os
import re

import pytest
import torch
from helpers import batches, data, DataStream, mlp, params, sgd
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import gputrain
from gputrain import TrainConfig, fit
from gputrain.data import Sharded, make_loader, take_part
from gputrain.errors import ConfigError, DataError, StopRequested
from gputrain.checkpoint.names import step_of
from gputrain.checkpoint.store import CheckpointStore

CPU = torch.device("cpu")


# ---------------------------------------------------------------- 1. iterables of any kind


def test_a_dataloader_over_an_iterable_dataset_trains_for_its_steps_with_its_batch_size():
    model = mlp()
    before = params(model).clone()
    h = fit(model, DataLoader(DataStream(), batch_size=32), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", steps=10, log_every=5))
    assert h.summary["steps"] == 10 and h.summary["batch_size"] == 32 and h.summary["data"] == "iterable"
    assert h.summary["samples"] == 10 * 32  # 3 batches of 32 per pass: it started new passes
    assert h.records[-1]["epoch"] == 3.0  # passes done (no length: no fraction)
    assert not torch.equal(params(model), before)


def test_an_iterable_dataset_given_directly_is_batched_by_the_config():
    h = fit(mlp(), DataStream(), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", steps=7, batch_size=16))
    assert h.summary["steps"] == 7 and h.summary["batch_size"] == 16 and h.summary["samples"] == 7 * 16


def test_without_a_length_steps_are_required():
    with pytest.raises(ConfigError, match=r"no length.*TrainConfig\(steps=N\)"):
        fit(mlp(), DataStream(), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", epochs=2))


def test_a_list_of_batches_has_a_length_so_epochs_work_and_passes_repeat():
    h = fit(mlp(), batches(), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", epochs=3))
    assert h.summary["steps"] == 18 and h.summary["samples"] == 3 * 96 and h.summary["batch_size"] is None


def test_a_reiterable_object_starts_a_new_pass():
    class Batches:
        passes = 0

        def __iter__(self):
            Batches.passes += 1
            return iter(batches())

    h = fit(mlp(), Batches(), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", steps=20))
    assert h.summary["steps"] == 20 and Batches.passes == 4 and not h.summary["stopped_early"]


def test_a_generator_ends_the_run_when_it_runs_out_with_a_message(tmp_path, caplog):
    def gen():
        yield from batches()  # 6 batches

    caplog.set_level(logging.WARNING, "gputrain")
    h = fit(mlp(), gen(), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", steps=20, log_every=4,
                                                                           run_dir=str(tmp_path / "run")))
    assert h.summary["steps"] == 6 and h.summary["stopped_early"]
    assert any("ran out after 6 batches" in w and "read only once" in w for w in h.summary["warnings"])
    assert "ran out after 6 batches" in caplog.text
    assert CheckpointStore(tmp_path / "run").latest_path().name == "step-000006.pt"  # saved as any run end


def test_a_generator_of_batches_trains_like_the_same_batches_in_a_list():
    a, b = mlp(), mlp()
    fit(a, iter(batches()), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", steps=6))
    fit(b, batches(), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", steps=6))
    assert torch.equal(params(a), params(b))


class RnnNet(nn.Module):
    """pytorch/examples' mnist_rnn Net (github.com/pytorch/examples, mnist_rnn/main.py): an LSTM over the
    image's rows, BatchNorm1d, two Dropout2d, two Linear and log_softmax; sizes made small (8x8 images)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(input_size=8, hidden_size=16, batch_first=True)
        self.batchnorm = nn.BatchNorm1d(16)
        self.dropout1 = nn.Dropout2d(0.25)
        self.dropout2 = nn.Dropout2d(0.5)
        self.fc1 = nn.Linear(16, 12)
        self.fc2 = nn.Linear(12, 10)

    def forward(self, input):
        input = input.reshape(-1, 8, 8)
        output, hidden = self.rnn(input)
        output = output[:, -1, :]
        output = self.batchnorm(output)
        output = self.dropout1(output)
        output = self.fc1(output)
        output = torch.relu(output)
        output = self.dropout2(output)
        output = self.fc2(output)
        return torch.log_softmax(output, dim=1)


@pytest.mark.filterwarnings("ignore:dropout2d:UserWarning")  # mnist_rnn's Dropout2d on (N, C): torch's note
@pytest.mark.parametrize("how", ["shuffle=False, rebuilt", "shuffle=True, as is", "an IterableDataset"])
def test_fit_over_your_dataloader_trains_as_your_loop_over_it_bit_for_bit(how):
    """Your loop: torch.manual_seed, then `for x, y in loader` every epoch. A DataLoader without a
    generator takes one number from the global RNG at every iter() (its workers' base seed), which moves
    the dropout masks after it; fit draws that number too (data/loader.py, draw_base_seed), so 3 epochs
    of mnist_rnn's Net end bit-equal (without the draw: 0.05 apart here, dropout's masks shifted)."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(40, 1, 8, 8, generator=g), torch.randint(0, 10, (40,), generator=g)

    def loader():
        if how == "an IterableDataset":
            return DataLoader(Rows(x, y), batch_size=8)
        return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=how.startswith("shuffle=True"))

    torch.manual_seed(0)
    model = RnnNet()
    hand = copy.deepcopy(model)
    fit(model, loader(), loss_fn=nn.functional.nll_loss, optimizer=torch.optim.Adadelta(model.parameters(), lr=1.0),
        config=TrainConfig(device="cpu", epochs=3, log_every=5, seed=1, rebuild_loader=how != "shuffle=True, as is"))
    torch.manual_seed(1)  # fit's seed=1, as your script's torch.manual_seed(args.seed)
    optimizer = torch.optim.Adadelta(hand.parameters(), lr=1.0)
    train_loader = loader()
    for epoch in range(3):
        hand.train()
        for data_, target in train_loader:
            optimizer.zero_grad()
            loss = nn.functional.nll_loss(hand(data_), target)
            loss.backward()
            optimizer.step()
    for (name, ours), theirs in zip(model.state_dict().items(), hand.state_dict().values()):
        assert torch.equal(ours, theirs), f"{name}: {(ours.double() - theirs.double()).abs().max().item():.3g} apart"


class Rows(IterableDataset):
    """(x[i], y[i]) in order, with a length (three passes make three epochs)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        return zip(self.x, self.y)

    def __len__(self):
        return len(self.x)


def test_a_one_shot_eval_iterable_is_refused():
    with pytest.raises(DataError, match="read only once"):
        fit(mlp(), batches(), eval_data=iter(batches()), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", steps=2))


def test_progress_bar_and_summary_without_a_known_length(capsys):
    h = fit(mlp(), DataStream(), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", steps=6, batch_size=16, log_every=2, progress=True))
    assert "6/6" in capsys.readouterr().err  # the bar counts steps, which are known
    assert h.summary["samples_per_s"] > 0 and h.summary["steps"] == 6


@pytest.mark.processes
def test_workers_and_ranks_each_read_their_own_part():
    class Numbers(IterableDataset):
        def __iter__(self):
            return iter(range(40))

    def seen(world, rank, workers):
        loader = DataLoader(Sharded(Numbers()), batch_size=4, num_workers=workers)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
        try:
            return [int(v) for b in loader for v in b]
        finally:
            del os.environ["RANK"], os.environ["WORLD_SIZE"]

    one = seen(1, 0, 2)
    assert sorted(one) == list(range(40))  # 2 workers: every sample once, not twice
    ranks = [seen(2, r, 2) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 20 and sorted(ranks[0] + ranks[1]) == list(range(40))
    # take_part drops a short last round for everybody, so every reader gets as many items
    parts = [list(take_part(range(10), i, 3)) for i in range(3)]
    assert parts == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


def test_an_iterable_dataset_with_workers_that_does_not_shard_gets_no_workers_by_default():
    loader, placement = make_loader(DataStream(), 16, device=CPU, train=True)
    assert "0 workers" in placement.reason


# ---------------------------------------------------------------- 5. bad data, said clearly


def test_empty_data_say_so():
    x, y = data(10)
    with pytest.raises(DataError, match="0 samples"):
        fit(mlp(), (x[:0], y[:0]), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", steps=2))
    with pytest.raises(DataError, match="empty"):
        fit(mlp(), TensorDataset(x[:0], y[:0]), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu"))
    with pytest.raises(DataError, match="no batch in epoch 0"):
        fit(mlp(), iter([]), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", steps=2))


def test_a_batch_whose_dtype_or_structure_changes_is_named():
    changed = batches()
    changed[3] = (changed[3][0], changed[3][1].float())
    with pytest.raises(DataError, match=r"batch 3 of epoch 0 .*batch\[1\] was int64 with 1 dim and is now float32"):
        fit(mlp(), changed, loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", steps=6))
    x, y = data(32)
    dicts = [{"x": x[:16], "labels": y[:16]}, {"x": x[16:]}]
    with pytest.raises(DataError, match="batch 1 of epoch 0 .*structure changed"):
        fit(mlp(), dicts, compute_loss=lambda m, b: m(b["x"]).sum(), config=TrainConfig(device="cpu", steps=2))
    dicts = [{"x": x[:16], "labels": y[:16]}, {"x": x[16:], "labels": y[16:].int()}]
    with pytest.raises(DataError, match=r"batch 1 of epoch 0 .*batch\['labels'\] was int64 with 1 dim and is now int32"):
        fit(mlp(), dicts, compute_loss=lambda m, b: m(b["x"]).sum(), config=TrainConfig(device="cpu", steps=2))


def _first_step_error(model, batches_or_data, exc_type, **kw):
    with pytest.raises(exc_type) as info:
        fit(model, batches_or_data, loss_fn=kw.pop("loss_fn", nn.CrossEntropyLoss()),
            config=TrainConfig(device="cpu", steps=2, batch_size=8, **kw))
    return str(info.value), "\n".join(getattr(info.value, "__notes__", []))


def test_labels_out_of_range_keep_torchs_message_and_say_the_range_and_the_last_layer():
    x, y = data(32, classes=3)
    message, note = _first_step_error(mlp(classes=3), (x, y + 3), IndexError)
    assert "out of bounds" in message  # PyTorch's own
    assert re.search(r"targets int64 in \[[3-5], [3-5]\]", note)  # the batch's labels, all >= 3 outputs
    assert "last layer 2: Linear(in_features=16, out_features=3" in note and "first training step" in note


def test_float_targets_to_a_classification_loss_show_their_dtype():
    x, y = data(32, classes=3)
    message, note = _first_step_error(mlp(), (x, y.float().unsqueeze(1)), RuntimeError)
    assert "targets float32" in note and "int64 class indices" in note


def test_a_feature_size_the_model_does_not_take_shows_the_shapes_and_the_first_layer():
    x, y = data(32, d=7)
    message, note = _first_step_error(mlp(d=6), (x, y), RuntimeError)
    assert "mat1 and mat2" in message
    assert "batch[0]: (8, 7) float32" in note and "in_features=6" in note


class Breaks(Dataset):
    """helpers.data as a Dataset whose sample `bad` raises (or kills its worker: how="exit")."""

    def __init__(self, bad, how="raise"):
        self.x, self.y = data(96)
        self.bad, self.how = bad, how

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if i == self.bad:
            if self.how == "exit":
                os._exit(3)  # a worker that dies (an OOM kill, a segfault in a decoder)
            raise ValueError(f"cannot decode sample {i}")
        return self.x[i], self.y[i]


@pytest.mark.processes
@pytest.mark.parametrize("workers", [0, 2])
def test_a_sample_that_raises_names_the_batch_and_the_run_checkpoints_the_last_step(tmp_path, workers):
    # Without shuffling sample 50 is in batch 6 (batches of 8): steps 1-6 finish, loading step 7 fails.
    loader = DataLoader(Breaks(bad=50), batch_size=8, num_workers=workers)
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="cannot decode sample 50") as info:
        fit(mlp(), loader, loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", steps=20,
                                                                           run_dir=str(run_dir)))
    notes = "\n".join(info.value.__notes__)
    assert "loading batch 6 of epoch 0" in notes and "a checkpoint of step 6" in notes
    assert CheckpointStore(run_dir).latest_path().name == "step-000006.pt"


class RaisesAt(nn.Module):
    """`net`, raising `error` at its `at`-th call: where torch's SIGCHLD handler, or a worker's reset
    connection, reaches the main process inside the step."""

    def __init__(self, net, at, error):
        super().__init__()
        self.net, self.at, self.error, self.calls = net, at, error, 0

    def forward(self, inputs):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return self.net(inputs)


@pytest.mark.processes
def test_a_worker_that_dies_names_the_batch_and_the_run_checkpoints_the_last_step(tmp_path):
    """torch reports the death as the SIGCHLD handler's RuntimeError, or, when the main process was
    reading the batch the worker had queued, as a reset connection (seen on a loaded machine; the
    handler's own report then comes wherever the main process is, or not at all): either way the
    error names the batch, and the last step is checkpointed."""
    loader = DataLoader(Breaks(bad=50, how="exit"), batch_size=8, num_workers=2)
    run_dir = tmp_path / "run"
    with pytest.raises((RuntimeError, ConnectionResetError)) as info:
        fit(mlp(), loader, loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", steps=20,
                                                                           run_dir=str(run_dir)))
    notes = "\n".join(info.value.__notes__)
    if isinstance(info.value, RuntimeError):
        assert "exited unexpectedly" in str(info.value)
    assert "loading batch" in notes and "of epoch 0" in notes and "a checkpoint of step" in notes
    assert CheckpointStore(run_dir).latest_path() is not None


def test_a_worker_death_reported_during_the_checkpoint_after_an_error_is_said_and_the_save_done(tmp_path):
    """torch's SIGCHLD handler raises where the main process is: after the error a dead worker
    caused, it can land inside gputrain's checkpoint after the error (here, as the handler would, in
    the save). That report becomes a line of the first error and the checkpoint is written."""
    x, y = data(96)
    model = mlp()

    class HandlerFires(gputrain.Callback):
        fired = False

        def on_checkpoint_save(self, run):
            if not self.fired:
                self.fired = True
                raise RuntimeError("DataLoader worker (pid 4242) exited unexpectedly with exit code 3. Details "
                                   "are lost due to multiprocessing.")

    run_dir = tmp_path / "run"
    with pytest.raises(ConnectionResetError) as info:
        fit(RaisesAt(model, 4, ConnectionResetError(104, "Connection reset by peer")),
            DataLoader(TensorDataset(x, y), batch_size=8), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", steps=20, run_dir=str(run_dir)), callbacks=[HandlerFires()])
    notes = info.value.__notes__
    assert notes[0] == "gputrain: DataLoader worker (pid 4242) exited unexpectedly with exit code 3. Details are " \
                       "lost due to multiprocessing."
    assert "a checkpoint of step 3 is at" in notes[-1] and len(notes) == 2
    assert step_of(CheckpointStore(run_dir).latest_path()) == 3


def test_a_worker_death_reported_inside_the_step_still_names_the_batches(tmp_path):
    """torch reports a dead worker from its SIGCHLD handler wherever the main process is: here, as
    that handler would, inside the forward of step 4. The error still names the data and resumes."""
    x, y = data(96)
    model = mlp()

    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="exited unexpectedly") as info:
        fit(RaisesAt(model, 4, RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly")),
            DataLoader(TensorDataset(x, y), batch_size=8), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", steps=20, run_dir=str(run_dir)))
    notes = "\n".join(info.value.__notes__)
    assert "loading batch 3 of epoch 0 or one after it" in notes and "a checkpoint of step 3" in notes


# ---------------------------------------------------------------- 6. say what is used


def test_a_user_dataloaders_own_batch_size_is_in_the_log_and_the_summary(caplog):
    x, y = data(96)
    caplog.set_level(logging.INFO, "gputrain")
    h = fit(mlp(), DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", epochs=1))
    assert h.summary["batch_size"] == 32 and h.summary["effective_batch"] == 32 and h.summary["samples"] == 96
    assert "3 steps of 32 x 1 samples" in caplog.text and not h.summary["warnings"]


def test_a_batch_size_given_beside_a_dataloader_that_differs_is_warned_about(caplog):
    x, y = data(96)
    caplog.set_level(logging.WARNING, "gputrain")
    h = fit(mlp(), DataLoader(TensorDataset(x, y), batch_size=32), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", epochs=1, batch_size=16))
    assert "batch_size=16 is not used" in caplog.text and "batches of 32" in caplog.text
    assert any("batch_size=16 is not used" in w for w in h.summary["warnings"])


def test_a_resume_whose_target_is_reached_says_so(tmp_path, caplog):
    run_dir = str(tmp_path / "run")
    fit(mlp(), data(96), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", steps=8, run_dir=run_dir))
    caplog.set_level(logging.WARNING, "gputrain")
    h = fit(mlp(), data(96), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", steps=6, run_dir=run_dir, resume=True))
    assert h.summary["steps"] == 8 and h.summary["total_steps"] == 6
    assert "already reaches this run's 6 steps" in caplog.text
    assert any("nothing to train" in w for w in h.summary["warnings"])


def test_a_stop_from_python_says_how_to_resume_from_python(tmp_path):
    import signal

    class StopAt3(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.n = mlp(), 0

        def forward(self, x):
            self.n += 1
            if self.n == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            return self.inner(x)

    run_dir = str(tmp_path / "run")
    with pytest.raises(StopRequested) as info:
        fit(StopAt3(), data(96), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", steps=9,
                                                                                  run_dir=run_dir))
    text = str(info.value)
    assert f"--resume {run_dir}" in text and f"TrainConfig(..., run_dir={run_dir!r}, resume=True)" in text


def test_count_tokens_counts_what_a_causal_lm_loss_averages_over():
    labels = torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])
    batch = {"input_ids": labels.clamp_min(0), "labels": labels}
    assert gputrain.count_tokens(batch).item() == 5
    assert gputrain.count_tokens(batch, shift=True).item() == 3  # the first label of a row is not predicted
    assert gputrain.count_tokens((labels, labels), shift=True).item() == 3
    with pytest.raises(DataError, match="no 'targets'"):
        gputrain.count_tokens(batch, key="targets")


def test_the_readmes_token_weighting_equals_one_batch_of_the_full_size():
    """A causal LM (Hugging Face, shifting inside) on rows with different numbers of tokens: two
    micro-batches weighted by count_tokens(shift=True) make the same step as the whole batch; the
    count without the shift (the README's old lambda) does not."""
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (4, 10), generator=g)
    labels = ids.clone()
    for row, keep in enumerate([10, 2, 7, 3]):  # very different token counts per row
        labels[row, keep:] = -100
    batch = {"input_ids": ids, "labels": labels}
    cfg = transformers.GPT2Config(vocab_size=40, n_positions=10, n_embd=16, n_layer=1, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    def train(batch_size, accumulate, count):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        fit(model, batch, num_items=count, optimizer=sgd(1.0),
            config=TrainConfig(device="cpu", steps=1, batch_size=batch_size, accumulate=accumulate))
        return params(model)

    whole = train(4, 1, None)
    assert torch.allclose(train(2, 2, lambda b: gputrain.count_tokens(b, shift=True)), whole, atol=1e-6)
    assert not torch.allclose(train(2, 2, lambda b: (b["labels"] != -100).sum()), whole, atol=1e-6)
