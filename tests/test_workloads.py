"""Built-in workloads: the data readers (on small files in the real formats), the MNIST-1D cache,
the models' shapes, the registry and user workloads, and the default runs' accuracy."""

from __future__ import annotations

import gzip
import pickle
import random
import struct
import sys
import textwrap

import numpy as np
import pytest
import torch

from gputrain.config import TrainConfig
from gputrain.errors import ConfigError, DataError
from gputrain.workloads import (
    WORKLOADS,
    Workload,
    get_workload,
    list_workloads,
    load_user_workload,
    resolve_workload,
)
from gputrain.workloads import datasets, models

# ---------------------------------------------------------------- CIFAR-10 files


def write_cifar(folder, n=4, n_test=3, seed=0):
    """A cifar-10-batches-py folder in the real format, with n images per training batch."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, m in [(f"data_batch_{i}", n) for i in range(1, 6)] + [("test_batch", n_test)]:
        batch = {b"batch_label": name.encode(), b"data": rng.integers(0, 256, (m, 3072), dtype=np.uint8),
                 b"labels": [int(v) for v in rng.integers(0, 10, m)], b"filenames": [b"x.png"] * m}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    return folder


def test_cifar10_reads_the_python_batches(tmp_path):
    folder = write_cifar(tmp_path / "cifar-10-batches-py", n=4, n_test=3)
    data = datasets.load_cifar10(folder)
    x, y = data.train
    assert x.shape == (20, 3, 32, 32) and x.dtype == torch.uint8
    assert y.shape == (20,) and y.dtype == torch.int64
    assert data.test[0].shape == (3, 3, 32, 32)
    assert data.mean == datasets.CIFAR10_MEAN and data.std == datasets.CIFAR10_STD
    # Row layout: 1024 red values, then green, then blue, each plane row-major.
    with open(folder / "data_batch_1", "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    assert torch.equal(x[0, 1, 2], torch.from_numpy(raw[b"data"][0, 1024 + 64:1024 + 96]))
    assert y[:4].tolist() == raw[b"labels"]


def test_cifar10_finds_the_folder_from_its_parent_and_the_env_var(tmp_path, monkeypatch):
    write_cifar(tmp_path / "cifar-10-batches-py")
    assert datasets.load_cifar10(tmp_path).num_train == 20
    monkeypatch.setenv("GPUTRAIN_CIFAR10_DIR", str(tmp_path))
    assert datasets.load_cifar10().num_train == 20


def test_cifar10_missing_folder_says_where_and_what(tmp_path):
    with pytest.raises(DataError) as err:
        datasets.load_cifar10(tmp_path / "nowhere")
    msg = str(err.value)
    assert "nowhere" in msg and "does not exist" in msg
    assert "data_batch_1" in msg and "test_batch" in msg and "cifar-10-python.tar.gz" in msg
    assert "GPUTRAIN_CIFAR10_DIR" in msg


def test_cifar10_missing_batch_is_named(tmp_path):
    folder = write_cifar(tmp_path / "c")
    (folder / "data_batch_3").unlink()
    with pytest.raises(DataError, match="lacks data_batch_3"):
        datasets.load_cifar10(folder)


def test_cifar10_corrupt_or_wrong_files(tmp_path):
    folder = write_cifar(tmp_path / "c")
    (folder / "data_batch_2").write_bytes(b"\x80\x04this is not a pickle")
    with pytest.raises(DataError, match="data_batch_2.*corrupt"):
        datasets.load_cifar10(folder)
    write_cifar(folder)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({b"data": np.zeros((3, 100), np.uint8), b"labels": [0, 1, 2]}, f)
    with pytest.raises(DataError, match=r"test_batch.*\(n, 3072\)"):
        datasets.load_cifar10(folder)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({b"data": np.zeros((3, 3072), np.uint8), b"fine_labels": [0, 1, 2]}, f)
    with pytest.raises(DataError, match="b'labels'"):
        datasets.load_cifar10(folder)


# ---------------------------------------------------------------- MNIST IDX files


def write_idx(path, array: np.ndarray, gz: bool = False, magic: int | None = None):
    """An IDX file: magic 0x0000080N (uint8, N dims), big-endian uint32 dims, raw values."""
    magic = (0x0800 | array.ndim) if magic is None else magic
    blob = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape) + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        blob = gzip.compress(blob)
    path.write_bytes(blob)
    return path


def write_mnist(folder, n=5, n_test=3, gz=False, seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {}
    for prefix, m in (("train", n), ("t10k", n_test)):
        images = rng.integers(0, 256, (m, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, m).astype(np.uint8)
        write_idx(folder / f"{prefix}-images-idx3-ubyte", images, gz=gz)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte", labels, gz=gz)
        arrays[prefix] = (images, labels)
    return arrays


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
def test_mnist_reads_idx_files(tmp_path, gz):
    arrays = write_mnist(tmp_path, n=5, n_test=3, gz=gz)
    data = datasets.load_mnist(tmp_path)
    x, y = data.train
    assert x.shape == (5, 1, 28, 28) and x.dtype == torch.uint8
    assert y.dtype == torch.int64 and y.tolist() == arrays["train"][1].tolist()
    assert np.array_equal(x[:, 0].numpy(), arrays["train"][0])
    assert data.test[0].shape == (3, 1, 28, 28)
    assert data.mean == datasets.MNIST_MEAN and data.std == datasets.MNIST_STD
    x.add_(1)  # writable memory (np.frombuffer alone would be read-only)


def test_mnist_torchvision_layout_and_env_var(tmp_path, monkeypatch):
    write_mnist(tmp_path / "MNIST" / "raw", gz=True)
    monkeypatch.setenv("GPUTRAIN_MNIST_DIR", str(tmp_path))
    assert datasets.load_mnist().num_train == 5


def test_mnist_bad_magic(tmp_path):
    write_mnist(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(5, np.uint8), magic=0x12345678)
    with pytest.raises(DataError, match="bad magic number 0x12345678") as err:
        datasets.load_mnist(tmp_path)
    assert "0x00000801" in str(err.value)


def test_mnist_truncated_missing_and_corrupt_gz(tmp_path):
    write_mnist(tmp_path)
    path = tmp_path / "t10k-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match="truncated"):
        datasets.load_mnist(tmp_path)
    path.unlink()
    with pytest.raises(DataError, match="lacks t10k-images-idx3-ubyte") as err:
        datasets.load_mnist(tmp_path)
    assert "GPUTRAIN_MNIST_DIR" in str(err.value)
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="corrupt"):
        datasets.load_mnist(tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        datasets.load_mnist(tmp_path / "nowhere")


def test_mnist_labels_must_match_images(tmp_path):
    write_mnist(tmp_path, n=5)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(4, np.uint8))
    with pytest.raises(DataError, match="expected 5 labels"):
        datasets.load_mnist(tmp_path)


# ---------------------------------------------------------------- MNIST-1D and its cache


def fake_mnist1d(calls):
    def generate(num_samples, seed):
        calls.append((num_samples, seed))
        rng = np.random.default_rng(seed)
        return {"x": rng.standard_normal((8, 40)), "y": rng.integers(0, 10, 8),
                "x_test": rng.standard_normal((2, 40)), "y_test": rng.integers(0, 10, 2)}
    return generate


def test_mnist1d_cache_is_written_once_and_reused(cache_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(datasets, "_generate_mnist1d", fake_mnist1d(calls))
    first = datasets.load_mnist1d()
    path = datasets.mnist1d_cache_path()
    assert path.parent == cache_dir and path.is_file()
    assert list(cache_dir.iterdir()) == [path]  # no temporary file left behind
    second = datasets.load_mnist1d()
    assert len(calls) == 1
    assert first.train[0].dtype == torch.float32 and first.train[1].dtype == torch.int64
    assert first.train[0].shape == (8, 40) and first.test[0].shape == (2, 40)
    assert torch.equal(first.train[0], second.train[0]) and torch.equal(first.test[1], second.test[1])


def test_mnist1d_unreadable_cache_is_regenerated(cache_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(datasets, "_generate_mnist1d", fake_mnist1d(calls))
    path = datasets.mnist1d_cache_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"half a file")
    assert datasets.load_mnist1d().num_train == 8
    assert len(calls) == 1
    assert datasets.load_mnist1d().num_train == 8 and len(calls) == 1


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("GPUTRAIN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert datasets.cache_root() == tmp_path / "xdg" / "gputrain"
    monkeypatch.setenv("GPUTRAIN_CACHE", str(tmp_path / "mine"))
    assert datasets.cache_root() == tmp_path / "mine"


def test_mnist1d_real_generator_small_and_leaves_global_rng_alone():
    np.random.seed(123)
    random.seed(123)
    expect_np, expect_py = np.random.rand(), random.random()
    np.random.seed(123)
    random.seed(123)
    out = datasets._generate_mnist1d(num_samples=50, seed=7)
    assert out["x"].shape == (40, 40) and out["x_test"].shape == (10, 40)
    assert set(np.unique(out["y"])) <= set(range(10))
    assert np.random.rand() == expect_np and random.random() == expect_py


# ---------------------------------------------------------------- generated and sklearn data


def test_synthetic_data_is_seeded_and_leaves_torch_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    a = datasets.make_synthetic_cifar(n=8, n_test=4, seed=0)
    assert torch.equal(torch.rand(3), expected)
    b = datasets.make_synthetic_cifar(n=8, n_test=4, seed=0)
    c = datasets.make_synthetic_cifar(n=8, n_test=4, seed=1)
    assert a.train[0].shape == (8, 3, 32, 32) and a.train[0].dtype == torch.uint8
    assert a.train[1].dtype == torch.int64 and int(a.train[1].max()) <= 9
    assert torch.equal(a.train[0], b.train[0]) and torch.equal(a.test[1], b.test[1])
    assert not torch.equal(a.train[0], c.train[0])
    for make in (datasets.make_linear_regression, datasets.make_binary):
        p, q = make(n=16, n_test=4, seed=3), make(n=16, n_test=4, seed=3)
        assert torch.equal(p.train[0], q.train[0]) and torch.equal(p.train[1], q.train[1])
        assert p.train[1].shape == (16, 1) and p.train[1].dtype == torch.float32


def test_binary_targets_follow_the_seed_rule():
    x, y = datasets.make_binary(n=64, n_test=1).train
    assert torch.equal(y.squeeze(1), (x.sum(1) > 0).float())


def test_linear_regression_noise_level():
    x, y = datasets.make_linear_regression(n=2000, n_test=1, noise=0.1).train
    design = torch.cat([x, torch.ones(len(x), 1)], 1)
    solution = torch.linalg.lstsq(design, y).solution
    mse = float(((design @ solution - y) ** 2).mean())
    assert 0.008 < mse < 0.012  # a perfect fit leaves the noise: 0.1**2


def test_iris_and_digits_splits():
    iris = datasets.load_iris()
    assert iris.train[0].shape == (120, 4) and iris.test[0].shape == (30, 4)
    assert iris.train[0].dtype == torch.float32 and iris.train[1].dtype == torch.int64
    assert torch.allclose(iris.train[0].mean(0), torch.zeros(4), atol=1e-5)  # standardized on train
    assert torch.bincount(iris.test[1]).tolist() == [10, 10, 10]  # stratified
    digits = datasets.load_digits()
    x = digits.train[0]
    assert x.shape == (1437, 1, 8, 8) and x.dtype == torch.uint8 and int(x.max()) == 16
    assert digits.test[0].shape == (360, 1, 8, 8)
    assert digits.mean[0] == pytest.approx(float(x.double().mean()))


# ---------------------------------------------------------------- models


@pytest.mark.parametrize("model, shape, out", [
    (models.CifarCNN, (2, 3, 32, 32), (2, 10)),
    (models.MNIST1DMLP, (2, 40), (2, 10)),
    (models.MNIST1DCNN, (2, 40), (2, 10)),
    (models.MNIST1DGRU, (2, 40), (2, 10)),
    (models.IrisMLP, (2, 4), (2, 3)),
    (models.DigitsCNN, (2, 1, 8, 8), (2, 10)),
    (models.MNISTCNN, (2, 1, 28, 28), (2, 10)),
    (models.LinearRegression, (2, 10), (2, 1)),
    (models.BinaryMLP, (2, 20), (2, 1)),
])
def test_model_output_shapes(model, shape, out):
    assert model()(torch.randn(shape)).shape == out


def test_cifar_cnn_is_the_seed_model():
    m = models.CifarCNN()
    assert models.count_parameters(m) == 145_578  # Prayer's parameter count
    assert not any(isinstance(layer, (torch.nn.ReLU,)) for layer in m.modules())  # the seed has none
    assert models.count_parameters(models.MNIST1DCNN()) == 5_210  # the paper's ConvBase


# ---------------------------------------------------------------- registry


def test_unknown_workload_lists_names_and_suggests():
    with pytest.raises(ConfigError) as err:
        get_workload("mnist1d-cnm")
    msg = str(err.value)
    assert "did you mean 'mnist1d-cnn'" in msg
    assert all(name in msg for name in WORKLOADS)


def test_unknown_option_is_a_config_error():
    with pytest.raises(ConfigError, match="'iris-mlp' takes no options; got data_dir"):
        get_workload("iris-mlp", data_dir="/x")
    with pytest.raises(ConfigError, match="n must be an integer"):
        get_workload("synthetic-cifar", n="many")


def test_workload_options_reach_the_data(tmp_path):
    w = get_workload("synthetic-cifar", n="16")  # strings from a command line are accepted
    assert w.make_data().num_train == 16
    assert get_workload("synthetic-cifar", size=12, n_test=2).make_data().test[0].shape[0] == 2
    write_cifar(tmp_path / "c")
    assert get_workload("cifar10-cnn", data_dir=str(tmp_path / "c")).make_data().num_train == 20
    with pytest.raises(DataError):
        get_workload("mnist-cnn", data_dir=str(tmp_path / "none")).make_data()


def test_list_workloads_rows():
    rows = list_workloads()
    assert [r["name"] for r in rows] == list(WORKLOADS)
    for r in rows:
        assert r["description"] and r["data"]
        assert isinstance(r["parameters"], int) and r["parameters"] > 0
        TrainConfig(**r["defaults"])  # every default is a valid TrainConfig field and value
    by_name = {r["name"]: r for r in rows}
    assert by_name["iris-mlp"]["full_batch"] is True
    assert "4,000 train / 1,000 test" in by_name["mnist1d-cnn"]["data"]
    assert by_name["cifar10-cnn"]["parameters"] == 145_578
    assert "data_dir" in by_name["cifar10-cnn"]["options"]


def test_list_workloads_builds_no_data(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("list_workloads must not build data")
    for name in ("load_mnist1d", "load_iris", "load_digits", "make_synthetic_cifar", "load_cifar10"):
        monkeypatch.setattr(datasets, name, boom)
    assert len(list_workloads()) == len(WORKLOADS)


USER_MODULE = textwrap.dedent("""
    import torch
    from torch import nn
    from gputrain.workloads import Workload, DataSplits

    def make(width=3):
        x = torch.randn(8, 2)
        data = DataSplits(train=(x, x.sum(1, keepdim=True)))
        return Workload(name="mine", description="tiny", make_data=lambda: data,
                        make_model=lambda: nn.Linear(2, 1), loss_fn=nn.MSELoss(), task="regression",
                        defaults={"epochs": width})

    def not_a_workload():
        return {"name": "mine"}
""")


def test_user_workload_from_module(tmp_path, monkeypatch):
    (tmp_path / "my_tasks_mod.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    w = load_user_workload("my_tasks_mod:make", width=5)
    assert isinstance(w, Workload) and w.name == "mine" and w.defaults == {"epochs": 5}
    assert resolve_workload("my_tasks_mod:make").defaults == {"epochs": 3}
    assert resolve_workload("iris-mlp").name == "iris-mlp"


def test_user_workload_from_file_path(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader adds the file's folder
    (tmp_path / "tasks_file.py").write_text(USER_MODULE)
    assert load_user_workload(f"{tmp_path / 'tasks_file.py'}:make").name == "mine"


def test_user_workload_errors(tmp_path, monkeypatch):
    (tmp_path / "my_tasks_err.py").write_text(USER_MODULE + "\nimport json\n")
    (tmp_path / "needs_missing.py").write_text("import surely_not_installed_pkg\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="returned dict; it must return a gputrain.workloads.Workload"):
        load_user_workload("my_tasks_err:not_a_workload")
    with pytest.raises(ConfigError, match="has no function 'nope'; it has make, not_a_workload"):
        load_user_workload("my_tasks_err:nope")
    with pytest.raises(ConfigError, match="no module named 'no_such_module_xyz'"):
        load_user_workload("no_such_module_xyz:make")
    with pytest.raises(ConfigError, match="needs the module 'surely_not_installed_pkg'"):
        load_user_workload("needs_missing:make")
    with pytest.raises(ConfigError, match="cannot take the options colour"):
        load_user_workload("my_tasks_err:make", colour="red")
    with pytest.raises(ConfigError, match="module:function"):
        load_user_workload("my_tasks_err:")
    with pytest.raises(ConfigError, match="does not exist"):
        load_user_workload(f"{tmp_path / 'missing.py'}:make")


# ---------------------------------------------------------------- default runs reach their bars


def _train_default(name):
    train = pytest.importorskip("gputrain.train", reason="gputrain's trainer is not importable yet")
    w = get_workload(name)
    config = TrainConfig(**w.defaults, device="cpu", precision="fp32")
    history, _ = train.fit_workload(w, config, full_batch=w.full_batch)
    return history.summary["final_eval_accuracy"]


@pytest.mark.parametrize("name, bar", [("iris-mlp", 0.93), ("digits-cnn", 0.97)])
def test_default_run_reaches_its_bar(name, bar, cache_dir):
    assert _train_default(name) >= bar


@pytest.mark.slow
@pytest.mark.parametrize("name, bar", [("mnist1d-cnn", 0.90), ("mnist1d-mlp", 0.60)])
def test_default_mnist1d_run_reaches_its_bar(name, bar, cache_dir):
    assert _train_default(name) >= bar


@pytest.mark.parametrize("name, options, says", [
    ("synthetic-cifar", {"n": "0"}, "option n must be >= 1, got '0'"),
    ("synthetic-cifar", {"size": "many"}, "option size must be an integer, got 'many'"),
    ("resnet18-cifar", {"augment": "maybe"}, "option augment must be true or false, got 'maybe'"),
    ("gpt-mini", {"text": "a.txt", "data_dir": "b"}, "give the text file once"),
    ("gpt-mini", {"data_seed": "x"}, "option data_seed must be an integer, got 'x'"),
    ("gpt-mini", {"dropout": "lots"}, "option dropout must be a number, got 'lots'"),
    ("gpt-mini", {"dropout": "1.0"}, r"option dropout must be in \[0, 1\), got 1.0"),
])
def test_bad_workload_options_are_config_errors_naming_the_option(name, options, says):
    with pytest.raises(ConfigError, match=says):
        get_workload(name, **options)


def test_workload_options_in_words_reach_the_workload():
    """Options come from the command line as text: "false"/"off"/"0" and "true"/"on"/"1" are booleans."""
    for text, augment in (("false", False), ("off", False), ("0", False), ("true", True), ("On", True), ("1", True)):
        w = get_workload("resnet18-cifar", data_dir="/nowhere", augment=text)
        assert ("crop-flip" in w.data_summary) is augment, text
    w = get_workload("gpt-mini", data_seed="3", dropout="0.25", n_layer="1", n_embd="8", n_head="2",
                     block_size="4", n_tokens="64")
    model = w.make_model()
    assert len(model.blocks) == 1 and model.block_size == 4 and model.drop.p == 0.25
    assert model.tok_emb.weight.shape[1] == 8 and "1 layers x 8 wide, 2 heads, context 4" in w.description


def test_user_workload_object_callable_and_import_failures(tmp_path, monkeypatch):
    """A Workload object named in the spec is taken as is (and takes no options); a name that is
    neither a function nor a Workload is refused; a file that fails to import leaves no half module
    behind; a module in the current directory is found as `python -m` would find it."""
    (tmp_path / "obj_tasks.py").write_text(USER_MODULE + "\nWORKLOAD = make()\nCOUNT = 3\n")
    (tmp_path / "broken_tasks.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    w = load_user_workload("obj_tasks:WORKLOAD")  # found in the current directory
    assert isinstance(w, Workload) and w.name == "mine"
    with pytest.raises(ConfigError, match="is a Workload object, not a function: it takes no options"):
        load_user_workload("obj_tasks:WORKLOAD", width=2)
    with pytest.raises(ConfigError, match="obj_tasks:COUNT is a int, not a function returning a Workload"):
        load_user_workload("obj_tasks:COUNT")
    with pytest.raises(RuntimeError, match="broken at import"):
        load_user_workload(f"{tmp_path / 'broken_tasks.py'}:make")
    assert "_gputrain_user_broken_tasks" not in sys.modules
