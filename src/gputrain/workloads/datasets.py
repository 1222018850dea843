"""The data of the built-in workloads, as DataSplits of host tensors. Nothing is downloaded.

Conventions: classification targets are int64 (N,); images are uint8 (N, C, H, W) with per-channel
mean/std in the stored units (0..255, or 0..16 for sklearn's digits), applied on the device per
batch; every other input is float32. Random data is drawn from seeded generators, never from the
global RNG, so building data does not change what a later `torch.manual_seed` gives.

Files the user provides (CIFAR-10, MNIST) are read from a folder given as an argument, an
environment variable, or the gputrain cache dir; a missing or malformed file raises DataError
saying where to put which files and where to get them.
"""

from __future__ import annotations

import errno
import gzip
import logging
import os
import pickle
import random
import zipfile
from pathlib import Path

import numpy as np
import torch

from gputrain.errors import ConfigError, DataError
from gputrain.io.atomic import atomic_file
from gputrain.workloads.base import DataSplits

log = logging.getLogger("gputrain")

# Per-channel statistics of the training sets, in 0..255 units.
CIFAR10_MEAN = (125.307, 122.950, 113.865)  # (0.4914, 0.4822, 0.4465) * 255
CIFAR10_STD = (62.993, 62.089, 66.705)  # (0.2470, 0.2435, 0.2616) * 255
MNIST_MEAN = (33.318,)  # 0.1307 * 255
MNIST_STD = (78.567,)  # 0.3081 * 255

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
MNIST_URLS = ("https://ossci-datasets.s3.amazonaws.com/mnist/ (the files torchvision uses), "
              "or https://yann.lecun.com/exdb/mnist/")
CIFAR10_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def cache_root() -> Path:
    """gputrain's cache folder: $GPUTRAIN_CACHE, else $XDG_CACHE_HOME/gputrain, else ~/.cache/gputrain."""
    if os.environ.get("GPUTRAIN_CACHE"):
        return Path(os.environ["GPUTRAIN_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "gputrain"
    return Path.home() / ".cache" / "gputrain"


def cache_error(path: Path, exc: OSError) -> ConfigError:
    """The one line for a cache file that cannot be written: where, why, and how to choose another folder."""
    blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    why = f"{blocking} is a file, not a folder" if blocking is not None else exc.strerror or type(exc).__name__
    return ConfigError(f"cannot write gputrain's cache file {path} ({why}): set "
                       "GPUTRAIN_CACHE to a folder you can write (the cache is $GPUTRAIN_CACHE, else "
                       "$XDG_CACHE_HOME/gputrain, else ~/.cache/gputrain)")


def _check_cache_folder(path: Path) -> None:
    """The folder of the cache file `path` made (if missing) and writable, else `cache_error`'s one line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise cache_error(path, exc) from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise cache_error(path, PermissionError(errno.EACCES, os.strerror(errno.EACCES)))


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _split_indices(targets: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A stratified, seeded train/test split of indices."""
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(targets))
    train, test = train_test_split(idx, test_size=test_fraction, stratify=targets, random_state=seed)
    return np.asarray(train), np.asarray(test)  # already arrays (no copy); the stub says "list"


# ---------------------------------------------------------------- small tabular / image sets (sklearn)


def load_iris(test_fraction: float = 0.2, seed: int = 0) -> DataSplits:
    """Iris (150 flowers, 4 features, 3 classes): float32 (N, 4) standardized with the training
    split's mean/std; a stratified held-out test split."""
    from sklearn.datasets import load_iris as sk_iris

    x, y = (np.asarray(a) for a in sk_iris(return_X_y=True))  # arrays (sklearn may type them as frames)
    tr, te = _split_indices(y, test_fraction, seed)
    mean, std = x[tr].mean(0), x[tr].std(0)
    x = ((x - mean) / std).astype(np.float32)
    y = y.astype(np.int64)
    return DataSplits(train=(torch.from_numpy(x[tr]), torch.from_numpy(y[tr])),
                      test=(torch.from_numpy(x[te]), torch.from_numpy(y[te])))


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> DataSplits:
    """sklearn's handwritten digits (1797 images, 8x8, values 0..16): uint8 (N, 1, 8, 8) with the
    training split's mean/std (in the same 0..16 units); a stratified held-out test split."""
    from sklearn.datasets import load_digits as sk_digits

    x, y = (np.asarray(a) for a in sk_digits(return_X_y=True))  # arrays (sklearn may type them as frames)
    x = x.astype(np.uint8).reshape(-1, 1, 8, 8)
    y = y.astype(np.int64)
    tr, te = _split_indices(y, test_fraction, seed)
    xtr = x[tr].astype(np.float64)
    return DataSplits(train=(torch.from_numpy(x[tr]), torch.from_numpy(y[tr])),
                      test=(torch.from_numpy(x[te]), torch.from_numpy(y[te])),
                      mean=(float(xtr.mean()),), std=(float(xtr.std()),))


# ---------------------------------------------------------------- MNIST-1D (generated, cached)


MNIST1D_SAMPLES = 5000  # the paper's set: 4000 train / 1000 test
MNIST1D_SEED = 42


def _generate_mnist1d(num_samples: int, seed: int) -> dict[str, np.ndarray]:
    """Build MNIST-1D with the `mnist1d` package's own generator (no download).

    Returns x (N_train, 40), y, x_test, y_test as numpy arrays. The generator seeds the global
    `random` and `numpy.random` states; they are put back afterwards.
    """
    from mnist1d.data import get_dataset_args, make_dataset
    from mnist1d.utils import ObjectView

    settings = get_dataset_args(as_dict=True)
    assert isinstance(settings, dict), "get_dataset_args(as_dict=True) gives a dict"
    args = ObjectView({**settings, "num_samples": num_samples, "seed": seed})  # make_dataset reads attributes
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        data = make_dataset(args)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    return {k: data[k] for k in ("x", "y", "x_test", "y_test")}


def mnist1d_cache_path(num_samples: int = MNIST1D_SAMPLES, seed: int = MNIST1D_SEED) -> Path:
    return cache_root() / f"mnist1d-n{num_samples}-seed{seed}.npz"


def load_mnist1d(num_samples: int = MNIST1D_SAMPLES, seed: int = MNIST1D_SEED) -> DataSplits:
    """MNIST-1D: float32 (N, 40) signals, 10 classes; 4000 train / 1000 test by default.

    Generated offline on first use (about a second) and cached as .npz in `cache_root()`; a cache
    file that cannot be read is regenerated.
    """
    path = mnist1d_cache_path(num_samples, seed)
    arrays = None
    if path.exists():
        try:
            with np.load(path) as f:
                arrays = {k: f[k] for k in ("x", "y", "x_test", "y_test")}
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            log.warning("MNIST-1D cache %s is unreadable (%s): regenerating it", path, exc)
    if arrays is None:
        _check_cache_folder(path)  # before generating: mnist1d imports matplotlib, which warns of a bad HOME first
        generated = _generate_mnist1d(num_samples, seed)
        arrays = {k: np.asarray(generated[k], np.int64 if k.startswith("y") else np.float32)
                  for k in ("x", "y", "x_test", "y_test")}
        try:
            with atomic_file(path, "wb") as f:  # a reader never sees half a file
                np.savez(f, allow_pickle=False, **arrays)  # numeric arrays only, as np.load reads them
        except OSError as exc:  # a read-only or missing HOME, GPUTRAIN_CACHE naming a file
            raise cache_error(path, exc) from None
    t = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64 if k.startswith("y") else np.float32))
         for k, v in arrays.items()}
    return DataSplits(train=(t["x"], t["y"]), test=(t["x_test"], t["y_test"]))


# ---------------------------------------------------------------- synthetic sets (seeded)


def make_linear_regression(n: int = 1000, n_test: int = 200, features: int = 10, noise: float = 0.1,
                           seed: int = 0) -> DataSplits:
    """The linear-regression workload's data: x ~ randn(N, 10), y = x @ w + b + noise, float32 (N, 1).

    w ~ randn(10, 1) and b ~ randn(1) are fixed by `seed`; `noise` is the noise's std, so a perfect
    fit has MSE noise**2 (0.01 by default).
    """
    g = _generator(seed)
    w = torch.randn(features, 1, generator=g)
    b = torch.randn(1, generator=g)

    def draw(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(m, features, generator=g)
        return x, x @ w + b + noise * torch.randn(m, 1, generator=g)

    return DataSplits(train=draw(n), test=draw(n_test))


def make_binary(n: int = 10000, n_test: int = 2000, features: int = 20, seed: int = 0) -> DataSplits:
    """The mlp-binary workload's task: x ~ randn(N, 20), y = (x.sum(1) > 0) as float32 (N, 1)."""
    g = _generator(seed)

    def draw(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(m, features, generator=g)
        return x, (x.sum(dim=1) > 0).float().unsqueeze(1)

    return DataSplits(train=draw(n), test=draw(n_test))


def make_synthetic_cifar(n: int = 50000, n_test: int = 10000, seed: int = 0) -> DataSplits:
    """Random CIFAR-10-shaped data: uint8 (N, 3, 32, 32) noise and labels 0..9 (int64).

    The real CIFAR-10's sizes and statistics, so the whole pipeline (device-resident uint8, on-device
    normalization) runs as on CIFAR-10 without the files. There is nothing to learn: accuracy stays
    near 10%. For speed and memory measurements.
    """
    g = _generator(seed)

    def draw(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, 256, (m, 3, 32, 32), generator=g, dtype=torch.uint8)
        return x, torch.randint(0, 10, (m,), generator=g)

    train = draw(n)
    test = draw(n_test) if n_test > 0 else None
    return DataSplits(train=train, test=test, mean=CIFAR10_MEAN, std=CIFAR10_STD)


# ---------------------------------------------------------------- CIFAR-10 from the user's files


def _folder(data_dir: str | os.PathLike | None, env: str, default_name: str) -> tuple[Path, str]:
    """The folder to read and a phrase saying where the choice came from."""
    if data_dir:
        return Path(data_dir).expanduser(), "data_dir"
    if os.environ.get(env):
        return Path(os.environ[env]).expanduser(), f"${env}"
    return cache_root() / default_name, "the default location"


def _cifar_help() -> str:
    return (f"CIFAR-10 needs the python version's files {', '.join(CIFAR10_FILES)} in one folder "
            f"(`cifar-10-batches-py`). Get {CIFAR10_URL} (163 MB), unpack it with "
            "`tar xzf cifar-10-python.tar.gz`, then pass the folder (--data-dir / data_dir=...) or set "
            f"GPUTRAIN_CIFAR10_DIR, or put it at {cache_root() / 'cifar-10-batches-py'}. "
            "gputrain never downloads it.")


def read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 python batch file -> (uint8 (n, 3, 32, 32), int64 (n,)). Raises DataError."""
    try:
        with open(path, "rb") as f:
            # pickle runs code stored in the file, so it is used for nothing but these files, which
            # the user downloaded and placed here: pickled dicts are CIFAR-10's own distribution format.
            batch = pickle.load(f, encoding="bytes")
    except Exception as exc:  # truncated, not a pickle, ...: all mean a bad file
        raise DataError(f"{path} is not a readable CIFAR-10 batch ({type(exc).__name__}: {exc}); "
                        f"the file is corrupt or incomplete: replace it. {_cifar_help()}") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        keys = sorted(batch)[:6] if isinstance(batch, dict) else type(batch).__name__
        raise DataError(f"{path} is not a CIFAR-10 batch: expected a dict with b'data' and b'labels', "
                        f"found {keys} (CIFAR-100 uses b'fine_labels'). {_cifar_help()}")
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[b"labels"])
    n = data.shape[0] if data.ndim else 0
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataError(f"{path}: b'data' should be uint8 of shape (n, 3072), got {data.dtype} {data.shape}. "
                        f"{_cifar_help()}")
    if labels.shape != (n,) or (n and (labels.min() < 0 or labels.max() > 9)):
        raise DataError(f"{path}: b'labels' should be {n} labels in 0..9, got shape {labels.shape}. "
                        f"{_cifar_help()}")
    # Each row is 1024 red, 1024 green, 1024 blue values, each plane row-major: (n, 3, 32, 32).
    return data.reshape(n, 3, 32, 32), labels.astype(np.int64)


def find_cifar10(data_dir: str | os.PathLike | None = None) -> Path:
    """The folder holding CIFAR-10's batches (the given one or its `cifar-10-batches-py`)."""
    folder, source = _folder(data_dir, "GPUTRAIN_CIFAR10_DIR", "cifar-10-batches-py")
    if not folder.is_dir():
        raise DataError(f"CIFAR-10 folder {folder} (from {source}) does not exist. {_cifar_help()}")
    for candidate in (folder, folder / "cifar-10-batches-py"):
        if any((candidate / name).exists() for name in CIFAR10_FILES):
            folder = candidate
            break
    missing = [name for name in CIFAR10_FILES if not (folder / name).is_file()]
    if missing:
        raise DataError(f"CIFAR-10 folder {folder} (from {source}) lacks {', '.join(missing)}. {_cifar_help()}")
    return folder


def load_cifar10(data_dir: str | os.PathLike | None = None, augment: bool = False) -> DataSplits:
    """CIFAR-10 from the user's `cifar-10-batches-py` folder: uint8 (50000, 3, 32, 32) train and
    (10000, 3, 32, 32) test, int64 labels, the standard per-channel mean/std. Raises DataError."""
    folder = find_cifar10(data_dir)
    parts = [read_cifar_batch(folder / f"data_batch_{i}") for i in range(1, 6)]
    x_test, y_test = read_cifar_batch(folder / "test_batch")
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    return DataSplits(train=(torch.from_numpy(x), torch.from_numpy(y)),
                      test=(torch.from_numpy(x_test), torch.from_numpy(y_test)),
                      mean=CIFAR10_MEAN, std=CIFAR10_STD, augment="crop-flip" if augment else None)


# ---------------------------------------------------------------- MNIST from the user's IDX files

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def _mnist_help() -> str:
    names = [n for pair in MNIST_FILES.values() for n in pair]
    return (f"MNIST needs the four IDX files {', '.join(names)} (each raw or .gz) in one folder. "
            f"Get them from {MNIST_URLS}, then pass the folder (--data-dir / data_dir=...) or set "
            f"GPUTRAIN_MNIST_DIR, or put them in {cache_root() / 'mnist'}. gputrain never downloads them.")


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (raw or .gz) as a numpy array. Raises DataError on a bad header or size.

    Layout: 2 zero bytes, a dtype code (0x08 = uint8), the number of dimensions, then each
    dimension as a big-endian uint32, then the values in row-major order.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as exc:
        raise DataError(f"{path} could not be read ({exc}): the file is corrupt or incomplete. "
                        f"{_mnist_help()}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        magic = raw[:4].hex() if len(raw) >= 4 else "(file too short)"
        raise DataError(f"{path} is not an IDX file: bad magic number 0x{magic} (images start with "
                        f"0x00000803, labels with 0x00000801). {_mnist_help()}")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header. {_mnist_help()}")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise DataError(f"{path}: the header says {dims} values ({expected} bytes) but the file holds "
                        f"{len(raw) - header} bytes after it: the file is truncated or corrupt. {_mnist_help()}")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)


def _idx_file(folder: Path, name: str) -> Path | None:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def find_mnist(data_dir: str | os.PathLike | None = None) -> Path:
    """The folder holding MNIST's IDX files (the given one, or its MNIST/raw or raw subfolder)."""
    folder, source = _folder(data_dir, "GPUTRAIN_MNIST_DIR", "mnist")
    if not folder.is_dir():
        raise DataError(f"MNIST folder {folder} (from {source}) does not exist. {_mnist_help()}")
    names = [n for pair in MNIST_FILES.values() for n in pair]
    for candidate in (folder, folder / "MNIST" / "raw", folder / "raw"):  # torchvision's layout too
        if any(_idx_file(candidate, n) for n in names):
            folder = candidate
            break
    missing = [n for n in names if _idx_file(folder, n) is None]
    if missing:
        raise DataError(f"MNIST folder {folder} (from {source}) lacks {', '.join(missing)} (raw or .gz). "
                        f"{_mnist_help()}")
    return folder


def _read_mnist_pair(folder: Path, images_name: str, labels_name: str) -> tuple[np.ndarray, np.ndarray]:
    images_path, labels_path = _idx_file(folder, images_name), _idx_file(folder, labels_name)
    if images_path is None or labels_path is None:
        raise DataError(f"MNIST folder {folder} lacks {images_name} or {labels_name} (raw or .gz). {_mnist_help()}")
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
        raise DataError(f"{images_path}: expected uint8 images of shape (n, 28, 28), got {images.dtype} "
                        f"{images.shape}. {_mnist_help()}")
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise DataError(f"{labels_path}: expected {images.shape[0]} labels (one per image in "
                        f"{images_path.name}), got shape {labels.shape}. {_mnist_help()}")
    if labels.size and labels.max() > 9:
        raise DataError(f"{labels_path}: labels should be 0..9, found {int(labels.max())}. {_mnist_help()}")
    return images.reshape(-1, 1, 28, 28), labels.astype(np.int64)


def load_mnist(data_dir: str | os.PathLike | None = None) -> DataSplits:
    """MNIST from the user's IDX files: uint8 (60000, 1, 28, 28) train, (10000, 1, 28, 28) test,
    int64 labels, the standard mean/std. Raises DataError."""
    folder = find_mnist(data_dir)
    x, y = _read_mnist_pair(folder, *MNIST_FILES["train"])
    x_test, y_test = _read_mnist_pair(folder, *MNIST_FILES["test"])
    # np.frombuffer arrays are read-only; copy so torch gets writable memory.
    return DataSplits(train=(torch.from_numpy(x.copy()), torch.from_numpy(y)),
                      test=(torch.from_numpy(x_test.copy()), torch.from_numpy(y_test)),
                      mean=MNIST_MEAN, std=MNIST_STD)
