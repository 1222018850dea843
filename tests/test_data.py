"""The loaders: every sample once per epoch, seeded shuffles, shards, augmentation, placement rule."""

import pytest
import torch

from gputrain.data import (BatchStream, BatchTransform, LoaderBatches, TensorBatches, choose_device_resident,
                           make_loader, random_crop_flip)
from gputrain.data.loader import ColumnsByIndex

CPU = torch.device("cpu")


def _ids(loader, epoch, start=0):
    return torch.cat([y for _, y in loader.iter_epoch(epoch, start)]).tolist()


def test_every_sample_once_per_epoch_and_partial_last_batch():
    x = torch.arange(103).float()[:, None]
    y = torch.arange(103)
    loader = TensorBatches((x, y), 10, device=CPU, shuffle=True, seed=1)
    assert len(loader) == 11 and [len(yb) for _, yb in loader.iter_epoch(0)][-1] == 3
    for epoch in range(3):
        seen = _ids(loader, epoch)
        assert sorted(seen) == list(range(103))
    # inputs travel with their targets
    for xb, yb in loader.iter_epoch(0):
        assert torch.equal(xb[:, 0].long(), yb)


def test_shuffles_differ_across_epochs_and_repeat_for_a_seed():
    x, y = torch.randn(64, 3), torch.arange(64)
    a = TensorBatches((x, y), 8, device=CPU, shuffle=True, seed=7)
    b = TensorBatches((x, y), 8, device=CPU, shuffle=True, seed=7)
    c = TensorBatches((x, y), 8, device=CPU, shuffle=True, seed=8)
    assert _ids(a, 0) == _ids(b, 0)
    assert _ids(a, 0) != _ids(a, 1)
    assert _ids(a, 0) != _ids(c, 0)


def test_resume_mid_epoch_yields_the_rest_of_the_same_epoch():
    x, y = torch.randn(50, 2), torch.arange(50)
    loader = TensorBatches((x, y), 8, device=CPU, shuffle=True, seed=3)
    full = _ids(loader, 2)
    assert _ids(loader, 2, start=3) == full[24:]


def test_ranks_get_disjoint_equal_shards_covering_the_epoch():
    x, y = torch.randn(41, 2), torch.arange(41)
    shards = [TensorBatches((x, y), 5, device=CPU, shuffle=True, seed=0, rank=r, world_size=2) for r in range(2)]
    ids = [_ids(s, 0) for s in shards]
    assert len(ids[0]) == len(ids[1]) == 20
    assert not set(ids[0]) & set(ids[1])
    assert len(shards[0]) == len(shards[1])


@pytest.mark.processes
@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_path_matches_the_same_permutation_and_resumes(workers):
    x, y = torch.randn(37, 2), torch.arange(37)
    slices = TensorBatches((x, y), 6, device=CPU, shuffle=True, seed=5)
    loader = LoaderBatches(ColumnsByIndex((x, y), 37), 6, device=CPU, shuffle=True, seed=5, num_workers=workers,
                           batched_dataset=True)
    assert _ids(loader, 1) == _ids(slices, 1)
    assert _ids(loader, 1, start=2) == _ids(slices, 1)[12:]


def test_batch_stream_crosses_epochs_and_restarts_at_a_position():
    x, y = torch.randn(10, 2), torch.arange(10)
    loader = TensorBatches((x, y), 4, device=CPU, shuffle=True, seed=0)
    s = BatchStream(loader)
    positions = [s.next()[:2] for _ in range(7)]
    assert positions == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]
    again = BatchStream(loader, epoch=1, batch_in_epoch=2)
    e, b, (_, yb) = again.next()
    assert (e, b) == (1, 2) and yb.tolist() == _ids(loader, 1)[8:]


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_stream_over_resident_tensors_goes_on_across_epochs_as_epoch_by_epoch_reading(drop_last):
    """Resident tensors are read by one endless iterator (`iter_from`): the same batches, at the same
    positions, as reading epoch after epoch, also from a position in the middle of an epoch."""
    x, y = torch.randn(22, 2), torch.arange(22)
    loader = TensorBatches((x, y), 5, device=CPU, shuffle=True, seed=4, drop_last=drop_last)
    n = len(loader)
    expected = [(e, b, yb.tolist()) for e in range(4) for b, (_, yb) in enumerate(loader.iter_epoch(e))]
    s = BatchStream(loader)
    assert [(e, b, yb.tolist()) for e, b, (_, yb) in (s.next() for _ in range(3 * n + 1))] == expected[:3 * n + 1]
    resumed = BatchStream(loader, epoch=1, batch_in_epoch=n - 1)
    got = [(e, b, yb.tolist()) for e, b, (_, yb) in (resumed.next() for _ in range(n + 1))]
    assert got == expected[2 * n - 1:3 * n]


def test_full_batch_training_in_order_hands_out_the_columns_every_epoch():
    x, y = torch.randn(12, 2), torch.arange(12)
    s = BatchStream(TensorBatches((x, y), 64, device=CPU, shuffle=True, seed=0))
    got = [s.next() for _ in range(3)]
    assert [(e, b) for e, b, _ in got] == [(0, 0), (1, 0), (2, 0)]
    assert all(batch[0] is x and batch[1] is y for _, _, batch in got)  # nothing gathered or copied


def test_augmentation_keeps_shapes_labels_and_content():
    torch.manual_seed(0)
    x = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    y = torch.arange(16)
    t = BatchTransform(mean=(125.0, 123.0, 114.0), std=(63.0, 62.0, 66.0), augment="crop-flip")
    loader = TensorBatches((x, y), 16, device=CPU, shuffle=False, transform=t)
    loader.shuffle = True  # augment (train) but check order via labels
    xb, yb = next(loader.iter_epoch(0))
    assert xb.shape == (16, 3, 32, 32) and xb.dtype == torch.float32
    assert sorted(yb.tolist()) == list(range(16))
    # A crop with zero offset and no flip is the identity: check the op on a known case.
    img = torch.arange(2 * 1 * 4 * 4, dtype=torch.float32).view(2, 1, 4, 4)
    g = torch.Generator().manual_seed(0)
    out = random_crop_flip(img, pad=1, generator=g)
    assert out.shape == img.shape
    for i in range(2):  # every output row is a (possibly flipped, shifted) window of the padded input
        padded = torch.nn.functional.pad(img[i:i + 1], (1, 1, 1, 1), mode="reflect")[0, 0]
        windows = [padded[dy:dy + 4, dx:dx + 4] for dy in range(3) for dx in range(3)]
        windows += [w.flip(1) for w in windows]
        assert any(torch.equal(out[i, 0], w) for w in windows)


def test_normalization_on_device_matches_reference():
    x = torch.randint(0, 256, (4, 3, 5, 5), dtype=torch.uint8)
    t = BatchTransform(mean=(10.0, 20.0, 30.0), std=(2.0, 4.0, 5.0))
    out = t(x, train=False)
    ref = (x.float() - torch.tensor([10.0, 20.0, 30.0]).view(1, 3, 1, 1)) / torch.tensor([2.0, 4.0, 5.0]).view(1, 3, 1, 1)
    assert torch.allclose(out, ref, atol=1e-5)


def test_placement_follows_the_memory_rule(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 4000))
    ok, why = choose_device_resident(400, cuda, "auto", 0.5)
    assert ok and "fits" in why
    ok, why = choose_device_resident(600, cuda, "auto", 0.5)
    assert not ok and "exceeds" in why
    assert choose_device_resident(600, cuda, True, 0.5)[0] is True
    assert choose_device_resident(1, cuda, False, 0.5)[0] is False


def test_cpu_tensors_become_slices_not_a_dataloader():
    loader, placement = make_loader((torch.randn(20, 3), torch.arange(20)), 4, device=CPU, train=True)
    assert isinstance(loader, TensorBatches) and placement.kind == "host-slices"


def test_bad_data_gets_a_clear_error():
    from gputrain.errors import DataError

    with pytest.raises(DataError, match=r"data\[0\] has 5 samples but data\[1\] has 4"):
        TensorBatches((torch.randn(5, 2), torch.arange(4)), 2, device=CPU)
    with pytest.raises(DataError, match="cannot train on str"):
        make_loader("not data", 4, device=CPU, train=True)


def test_augmentation_changes_training_batches_only_and_is_seeded():
    """Crop-flip really runs on training batches (and not on eval ones), seeded by (seed, epoch, batch)."""
    torch.manual_seed(0)
    x = torch.randint(0, 256, (32, 3, 16, 16), dtype=torch.uint8)
    y = torch.arange(32)
    norm = BatchTransform(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    aug = BatchTransform(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), augment="crop-flip")
    plain = TensorBatches((x, y), 32, device=CPU, shuffle=False, transform=norm)
    train = TensorBatches((x, y), 32, device=CPU, shuffle=True, seed=3, transform=aug)
    again = TensorBatches((x, y), 32, device=CPU, shuffle=True, seed=3, transform=aug)
    xa, ya = next(train.iter_epoch(0))
    reference = x.float()[ya]  # the same samples, un-augmented
    changed = [(not torch.equal(xa[i], reference[i])) for i in range(32)]
    assert sum(changed) >= 16  # 1 in 162 (offset, flip) combinations is the identity
    assert torch.equal(xa, next(again.iter_epoch(0))[0])  # reproducible
    x1, y1 = next(train.iter_epoch(1))
    assert not torch.equal(xa[ya.argsort()], x1[y1.argsort()])  # another epoch, other crops
    eval_batches = TensorBatches((x, y), 32, device=CPU, shuffle=False, transform=aug.for_eval())
    assert torch.equal(next(eval_batches.iter_epoch(0))[0], next(plain.iter_epoch(0))[0])


def test_dict_columns_are_sliced_together_and_the_named_leaf_is_transformed():
    n = 20
    cols = {"pixels": torch.randint(0, 256, (n, 1, 4, 4), dtype=torch.uint8), "ids": torch.arange(n),
            "mask": torch.ones(n, 3, dtype=torch.bool)}
    t = BatchTransform(mean=(128.0,), std=(64.0,), key="pixels")
    loader, placement = make_loader(cols, 6, device=CPU, train=True, seed=2, transform=t)
    assert placement.kind == "host-slices"
    seen = []
    for b in loader.iter_epoch(0):
        assert set(b) == {"pixels", "ids", "mask"} and b["pixels"].dtype == torch.float32
        assert torch.allclose(b["pixels"], (cols["pixels"][b["ids"]].float() - 128) / 64)
        seen += b["ids"].tolist()
    assert sorted(seen) == list(range(n))


def test_columns_of_unequal_length_are_named():
    from gputrain.errors import DataError

    with pytest.raises(DataError, match=r"data\['a'\] has 4 samples but data\['b'\] has 3"):
        make_loader({"a": torch.zeros(4), "b": torch.zeros(3)}, 2, device=CPU, train=True)


def test_a_dataset_of_dicts_goes_through_the_dataloader_and_resumes():
    from torch.utils.data import Dataset

    class Dicts(Dataset):
        def __len__(self):
            return 23

        def __getitem__(self, i):
            return {"x": torch.full((2,), float(i)), "label": i, "name": f"s{i}"}

    loader, placement = make_loader(Dicts(), 5, device=CPU, train=True, seed=4, num_workers=0)
    assert placement.kind == "dataloader"
    batches = list(loader.iter_epoch(1))
    assert [len(b["label"]) for b in batches] == [5, 5, 5, 5, 3]
    assert all(torch.equal(b["x"][:, 0].long(), b["label"]) for b in batches)
    assert sorted(i for b in batches for i in b["label"].tolist()) == list(range(23))
    assert [b["label"].tolist() for b in loader.iter_epoch(1, 3)] == [b["label"].tolist() for b in batches[3:]]


@pytest.mark.processes
@pytest.mark.parametrize("workers", [0, 2])
def test_a_datasets_getitems_reads_each_batch_as_the_dataloader_would(workers):
    """A dataset with __getitems__ gets the batch's index list in one call, with or without workers
    (without them the batches are fetched in this process, not by the DataLoader); a falsy
    __getitems__ means one __getitem__ per sample, as torch's fetcher decides."""
    from torch.utils.data import Dataset

    class Batched(Dataset):
        def __init__(self, getitems=True):
            self.calls = torch.zeros(2, dtype=torch.int64).share_memory_()  # [__getitem__, __getitems__]
            if not getitems:
                self.__getitems__ = None

        def __len__(self):
            return 23

        def __getitem__(self, i):
            self.calls[0] += 1
            return {"x": torch.full((2,), float(i)), "label": i}

        def __getitems__(self, idx):
            self.calls[1] += 1
            return [{"x": torch.full((2,), float(i)), "label": i} for i in idx]

    ds = Batched()
    loader, _ = make_loader(ds, 5, device=CPU, train=True, seed=4, num_workers=workers)
    batches = list(loader.iter_epoch(1))
    assert ds.calls.tolist() == [0, 5]
    assert sorted(i for b in batches for i in b["label"].tolist()) == list(range(23))
    per_sample = Batched(getitems=False)
    loader, _ = make_loader(per_sample, 5, device=CPU, train=True, seed=4, num_workers=workers)
    assert [b["label"].tolist() for b in loader.iter_epoch(1)] == [b["label"].tolist() for b in batches]
    assert per_sample.calls.tolist() == [23, 0]


def test_as_tensors_takes_pairs_only():
    from torch.utils.data import TensorDataset

    from gputrain.data import as_tensors

    x, y, z = torch.zeros(4, 3), torch.arange(4), torch.ones(4)
    for data in ((x, y), [x, y], TensorDataset(x, y)):
        got = as_tensors(data)
        assert got is not None and got[0] is x and got[1] is y
    for data in ((x, y, z), {"x": x, "y": y}, TensorDataset(x), [1, 2], None):
        assert as_tensors(data) is None


def test_data_splits_count_train_samples_and_stored_bytes():
    from gputrain.data.splits import DataSplits

    train = {"image": torch.zeros(10, 3, 4, 4, dtype=torch.uint8), "label": torch.zeros(10, dtype=torch.int64)}
    test = (torch.zeros(5, 8), torch.zeros(5, dtype=torch.int64))
    with_test = DataSplits(train=train, test=test)
    assert with_test.num_train == 10
    assert with_test.nbytes() == 10 * 48 * 1 + 10 * 8 + 5 * 8 * 4 + 5 * 8
    assert DataSplits(train=train, test=None).nbytes() == 10 * 48 + 10 * 8


def test_a_users_dataloader_is_used_as_is_and_resumes_by_reading_ahead(caplog):
    """UserLoaderBatches: the loader's own batches (its batch size, order), its length, and a resume
    at batch k of an epoch that skips the first k batches and says so."""
    from torch.utils.data import DataLoader, TensorDataset

    from gputrain.data import UserLoaderBatches

    x, y = torch.arange(10.0).unsqueeze(1), torch.arange(10)
    batches = UserLoaderBatches(DataLoader(TensorDataset(x, y), batch_size=4), CPU, why="its sampler is its own")
    assert len(batches) == 3 and batches.num_samples == 10 and batches.batch_size == 4
    assert [b[1].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with caplog.at_level("WARNING", logger="gputrain"):
        rest = [b[1].tolist() for b in batches.iter_epoch(1, start_batch=2)]
    assert rest == [[8, 9]]
    assert "by reading the 2 batches before it again (its sampler is its own)" in caplog.text


def test_transform_of_a_mapping_batch_keeps_its_type_and_leaves_the_original_alone():
    """A dict subclass (OrderedDict, a tokenizer's BatchEncoding) stays its type with the named leaf
    transformed; a read-only Mapping becomes a dict; the batch given is never changed in place."""
    import collections
    import types

    t = BatchTransform(mean=(128.0,), std=(64.0,), key="pixels")
    pixels = torch.full((2, 1, 2, 2), 192, dtype=torch.uint8)
    ordered = collections.OrderedDict(pixels=pixels, ids=torch.arange(2))
    out = t(ordered, train=False)
    assert type(out) is collections.OrderedDict and list(out) == ["pixels", "ids"]
    assert torch.equal(out["pixels"], torch.ones(2, 1, 2, 2)) and out["ids"] is ordered["ids"]
    assert ordered["pixels"] is pixels  # the original still holds the uint8 tensor

    class ReadOnly(collections.abc.Mapping):
        def __init__(self, **kw):
            self._d = types.MappingProxyType(dict(kw))

        def __getitem__(self, k):
            return self._d[k]

        def __iter__(self):
            return iter(self._d)

        def __len__(self):
            return len(self._d)

    frozen = ReadOnly(pixels=pixels, ids=torch.arange(2))
    out = t(frozen, train=False)
    assert type(out) is dict and torch.equal(out["pixels"], torch.ones(2, 1, 2, 2))
    assert frozen["pixels"] is pixels


def test_iterating_a_loader_directly_is_its_first_epoch():
    """`for batch in loader` is epoch 0 from its first batch, for the slices, the DataLoader path and
    deferred rows alike (a deferred batch prints as the rows it stands for)."""
    x, y = torch.randn(10, 2), torch.arange(10)
    slices = TensorBatches((x, y), 4, device=CPU, shuffle=True, seed=3)
    loader = LoaderBatches(ColumnsByIndex((x, y), 10), 4, device=CPU, shuffle=True, seed=3, num_workers=0,
                           batched_dataset=True)
    for source in (slices, loader):
        assert torch.cat([b[1] for b in source]).tolist() == _ids(source, 0)
    first = _ids(slices, 0)
    slices.defer = True
    rows = list(slices)
    assert [repr(r) for r in rows] == ["ResidentRows(start=0, size=4)", "ResidentRows(start=4, size=4)",
                                       "ResidentRows(start=8, size=2)"]
    assert torch.cat([r.materialize()[1] for r in rows]).tolist() == first
