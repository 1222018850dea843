"""Workloads by name: the built-in ones, and the user's own as "module:function".

Building a Workload is cheap: its data and model are made by `make_data()` / `make_model()` only
when a run asks for them, so listing workloads never generates or reads a data set.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any, Callable

from torch import nn

from gputrain.errors import ConfigError
from gputrain.workloads import datasets, models
from gputrain.workloads.base import Workload

# ---------------------------------------------------------------- built-in workloads
#
# Each factory's defaults were tuned with benchmarks/accuracy.py so that the default run reaches
# its accuracy bar on a 2-core CPU in well under two minutes (figures in that script's docstring).


def _summary(source: str, n_train: int, n_test: int, shape: tuple[int, ...], dtype: str) -> str:
    return f"{source}: {n_train:,} train / {n_test:,} test, {dtype} {tuple(shape)}"


MAX_OPTION = 2**31 - 1  # a workload's counts (samples, tokens, widths) index int32-sized tensors and loops


def _as_int(name: str, value: Any) -> int:
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"option {name} must be an integer, got {value!r}") from None
    if out < 1:
        raise ConfigError(f"option {name} must be >= 1, got {value!r}")
    if out > MAX_OPTION:
        raise ConfigError(f"option {name} must be at most {MAX_OPTION} (a count that tensors can index), got {value!r}")
    return out


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"option {name} must be true or false, got {value!r}")
    return bool(value)


def iris_mlp() -> Workload:
    # The tutorial this workload comes from trains 20000 full-batch epochs (SGD); with AdamW a few
    # hundred reach the same test accuracy. `epochs=20000` reproduces its run length; log_every=200
    # its logging rate.
    return Workload(
        name="iris-mlp",
        description="iris MLP 4-10-3, full batch: the run where the GPU loses to the CPU",
        make_data=datasets.load_iris,
        make_model=models.IrisMLP,
        loss_fn=nn.CrossEntropyLoss(),
        defaults={"epochs": 500, "lr": 0.01, "log_every": 100},
        full_batch=True,
        data_summary=_summary("sklearn iris, standardized", 120, 30, (4,), "float32"),
    )


def digits_cnn() -> Workload:
    return Workload(
        name="digits-cnn",
        description="small CNN on sklearn's 8x8 handwritten digits",
        make_data=datasets.load_digits,
        make_model=models.DigitsCNN,
        loss_fn=nn.CrossEntropyLoss(),
        defaults={"batch_size": 64, "epochs": 20, "lr": 2e-3, "weight_decay": 0.01, "schedule": "cosine",
                  "log_every": 50},
        data_summary=_summary("sklearn digits", 1437, 360, (1, 8, 8), "uint8"),
    )


_MNIST1D_SUMMARY = _summary("MNIST-1D, generated offline and cached", 4000, 1000, (40,), "float32")


def _mnist1d(name: str, description: str, make_model, defaults: dict) -> Workload:
    """A model of the MNIST-1D paper on its data (the three share data, loss and summary)."""
    return Workload(name=name, description=description, make_data=datasets.load_mnist1d, make_model=make_model,
                    loss_fn=nn.CrossEntropyLoss(), defaults=defaults, data_summary=_MNIST1D_SUMMARY)


def mnist1d_cnn() -> Workload:
    return _mnist1d("mnist1d-cnn", "MNIST-1D paper's ConvBase (3 Conv1d, 25 channels); paper: 94% test accuracy",
                    models.MNIST1DCNN, {"batch_size": 100, "epochs": 100, "lr": 2e-2, "weight_decay": 0.1,
                                        "schedule": "cosine", "log_every": 400})


def mnist1d_mlp() -> Workload:
    # Test accuracy keeps rising while the test loss rises (over-confident but better ranked): the
    # paper's 6000 steps of batch 100 are needed, weight decay does not help here.
    return _mnist1d("mnist1d-mlp", "MNIST-1D paper's MLP 40-100-100-10; paper: 68% test accuracy",
                    models.MNIST1DMLP, {"batch_size": 100, "epochs": 150, "lr": 1e-2, "schedule": "cosine",
                                        "log_every": 500})


def mnist1d_gru() -> Workload:
    return _mnist1d("mnist1d-gru", "MNIST-1D paper's bidirectional GRU (hidden 6); paper: 91% test accuracy",
                    models.MNIST1DGRU, {"batch_size": 100, "epochs": 50, "lr": 2e-2, "weight_decay": 0.1,
                                        "schedule": "cosine", "log_every": 200})


def linear_regression(n: int = 1000) -> Workload:
    return _synthetic("linear-regression", "Linear(10, 1) on y = x @ w + b + noise (MSE; the noise floor is 0.01)",
                      datasets.make_linear_regression, n, (10,), models.LinearRegression, nn.MSELoss(), "regression",
                      {"batch_size": 32, "epochs": 20, "lr": 3e-2, "schedule": "cosine", "log_every": 50})


def mlp_binary(n: int = 10000) -> Workload:
    return _synthetic("mlp-binary", "MLP 20-64-32-1 on y = (x.sum(1) > 0), BCEWithLogitsLoss", datasets.make_binary,
                      n, (20,), models.BinaryMLP, nn.BCEWithLogitsLoss(), "binary",
                      {"batch_size": 64, "epochs": 5, "lr": 1e-3, "log_every": 50})


def _synthetic(name: str, description: str, make: Callable[..., Any], n: Any, features: tuple[int, ...],
               make_model: Callable[[], nn.Module], loss_fn: nn.Module, task: str, defaults: dict[str, Any]) -> Workload:
    """A seeded synthetic data set of n float32 samples (a fifth as many for testing) and its model."""
    n = _as_int("n", n)
    n_test = max(1, n // 5)
    return Workload(name=name, description=description, make_data=partial(make, n=n, n_test=n_test),
                    make_model=make_model, loss_fn=loss_fn, task=task, defaults=defaults,
                    data_summary=_summary("synthetic, seeded", n, n_test, features, "float32"))


_CIFAR_DEFAULTS = {"batch_size": 64, "epochs": 10, "lr": 1e-3, "weight_decay": 0.01, "schedule": "cosine",
                   "log_every": 100}


def cifar10_cnn(data_dir: str | None = None, augment: bool = False) -> Workload:
    augment = _as_bool("augment", augment)
    return Workload(
        name="cifar10-cnn",
        description="a 3-conv CNN on CIFAR-10 (your cifar-10-batches-py folder)",
        make_data=partial(datasets.load_cifar10, data_dir=data_dir, augment=augment),
        make_model=models.CifarCNN,
        loss_fn=nn.CrossEntropyLoss(),
        defaults=dict(_CIFAR_DEFAULTS),
        data_summary=_summary("CIFAR-10 from local files", 50000, 10000, (3, 32, 32), "uint8"),
    )


def synthetic_cifar(n: int = 50000, n_test: int | None = None, size: int | None = None) -> Workload:
    """`size` is another name for `n` (training samples)."""
    n = _as_int("size", size) if size is not None else _as_int("n", n)
    n_test = _as_int("n_test", n_test) if n_test is not None else min(10000, max(1, n // 5))
    return Workload(
        name="synthetic-cifar",
        description="cifar10-cnn's CNN on random CIFAR-sized images: speed and memory without the files",
        make_data=partial(datasets.make_synthetic_cifar, n=n, n_test=n_test),
        make_model=models.CifarCNN,
        loss_fn=nn.CrossEntropyLoss(),
        defaults={**_CIFAR_DEFAULTS, "epochs": 1},
        data_summary=_summary("random noise, seeded", n, n_test, (3, 32, 32), "uint8"),
    )


def mnist_cnn(data_dir: str | None = None) -> Workload:
    return Workload(
        name="mnist-cnn",
        description="small CNN on MNIST (your IDX files)",
        make_data=partial(datasets.load_mnist, data_dir=data_dir),
        make_model=models.MNISTCNN,
        loss_fn=nn.CrossEntropyLoss(),
        defaults={"batch_size": 128, "epochs": 3, "lr": 2e-3, "schedule": "onecycle", "log_every": 100},
        data_summary=_summary("MNIST from local IDX files", 60000, 10000, (1, 28, 28), "uint8"),
    )


# ---------------------------------------------------------------- real models (issue 14: fast on real models)

# AdamW (the trainer's optimizer), not the papers' SGD: lr 2e-3 with a one-cycle schedule and
# decoupled weight decay 0.05 is the usual AdamW recipe for ResNets on CIFAR.
_RESNET_DEFAULTS = {"batch_size": 256, "epochs": 30, "lr": 2e-3, "weight_decay": 0.05, "schedule": "onecycle",
                    "log_every": 50}


def resnet18_cifar(data_dir: str | None = None, augment: bool = True, n: int = 50000, n_test: int | None = None,
                   width: int = 64) -> Workload:
    """ResNet-18 (CIFAR stem). data_dir: real CIFAR-10 (crop-flip augmentation unless augment=false);
    without it, synthetic CIFAR-shaped noise of n / n_test samples. width: first-stage channels
    (64 = the real ResNet-18; smaller for tests)."""
    from gputrain.workloads.real_models import ResNet18Cifar

    augment = _as_bool("augment", augment)
    width = _as_int("width", width)
    if data_dir:
        make_data = partial(datasets.load_cifar10, data_dir=data_dir, augment=augment)
        summary = _summary("CIFAR-10 from local files" + (", crop-flip" if augment else ""), 50000, 10000,
                           (3, 32, 32), "uint8")
    else:
        n = _as_int("n", n)
        n_test = _as_int("n_test", n_test) if n_test is not None else min(10000, max(1, n // 5))
        make_data = partial(datasets.make_synthetic_cifar, n=n, n_test=n_test)
        summary = _summary("random noise, seeded (give data_dir for CIFAR-10)", n, n_test, (3, 32, 32), "uint8")
    return Workload(
        name="resnet18-cifar",
        description="ResNet-18 (3x3 stem, no max-pool) on CIFAR-10 or CIFAR-shaped noise",
        make_data=make_data,
        make_model=partial(ResNet18Cifar, num_classes=10, width=width),
        loss_fn=nn.CrossEntropyLoss(),
        defaults=dict(_RESNET_DEFAULTS),
        data_summary=summary,
    )


# nanoGPT's shakespeare-char recipe (lr 1e-3, batch 64 x 256, warm-up 100, weight decay 0.1) with
# the trainer's AdamW; 20 epochs of tiny Shakespeare's 3.9k windows are about 1,100 steps.
_GPT_DEFAULTS = {"batch_size": 64, "epochs": 20, "lr": 1e-3, "weight_decay": 0.1, "schedule": "cosine",
                 "warmup_steps": 100, "log_every": 50}


def gpt_mini(text: str | None = None, data_dir: str | None = None, n_tokens: int = 2**20, n_layer: int = 6,
             n_embd: int = 384, n_head: int = 6, block_size: int = 256, dropout: float = 0.1,
             data_seed: int = 0) -> Workload:
    """A 6-layer GPT on characters. text (or data_dir): a local UTF-8 text file (or a folder with
    input.txt); without it, n_tokens from a random Markov chain over 65 symbols (seeded by data_seed).
    n_layer, n_embd, n_head, block_size, dropout: the model's size (small ones for tests)."""
    from gputrain.workloads import text as textdata
    from gputrain.workloads.real_models import GPTMini, next_token_loss

    if text and data_dir and str(text) != str(data_dir):
        raise ConfigError(f"gpt-mini: give the text file once (text={text!r} and data_dir={data_dir!r})")
    path = text or data_dir
    n_layer, n_embd, n_head = _as_int("n_layer", n_layer), _as_int("n_embd", n_embd), _as_int("n_head", n_head)
    block_size = _as_int("block_size", block_size)
    try:
        data_seed = int(data_seed)
    except (TypeError, ValueError):
        raise ConfigError(f"option data_seed must be an integer, got {data_seed!r}") from None
    try:
        dropout = float(dropout)
    except (TypeError, ValueError):
        raise ConfigError(f"option dropout must be a number, got {dropout!r}") from None
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"option dropout must be in [0, 1), got {dropout!r}")
    if n_embd % n_head:
        raise ConfigError(f"option n_embd ({n_embd}) must be a multiple of n_head ({n_head})")

    # The vocabulary (the model's size) comes from the data: read the corpus once, on first use by
    # make_data or make_model, and share it between them.
    cache: dict = {}

    def corpus():
        if "corpus" not in cache:
            if path:
                cache["corpus"] = textdata.load_char_corpus(path, block_size)
            else:
                cache["corpus"], _ = textdata.synthetic_corpus(_as_int("n_tokens", n_tokens), seed=data_seed)
        return cache["corpus"]

    def make_model() -> nn.Module:
        vocab = corpus().vocab_size if path else textdata.SYNTHETIC_VOCAB
        return GPTMini(vocab, block_size=block_size, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                       dropout=dropout)

    if path:
        summary = f"characters of {path} (vocabulary from the file), windows of {block_size}, int64"
    else:
        summary = (f"synthetic Markov chain over {textdata.SYNTHETIC_VOCAB} symbols (entropy rate "
                   f"{textdata.entropy_rate(textdata.markov_chain(textdata.SYNTHETIC_VOCAB, textdata.SYNTHETIC_BRANCHING, data_seed)):.3f} "
                   "nats/token), "
                   f"{textdata.tokens_summary(_as_int('n_tokens', n_tokens), block_size)}")
    return Workload(
        name="gpt-mini",
        description=f"GPT {n_layer} layers x {n_embd} wide, {n_head} heads, context {block_size}, on characters",
        make_data=lambda: textdata.corpus_splits(corpus(), block_size),
        make_model=make_model,
        loss_fn=next_token_loss,
        # Loss only: the trainer's accuracy (argmax over dim 1) does not apply to (B, T, V) logits.
        task=None,  # loss only: next-token cross-entropy, no accuracy
        defaults=dict(_GPT_DEFAULTS),
        data_summary=summary,
    )


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "iris-mlp": iris_mlp,
    "digits-cnn": digits_cnn,
    "mnist1d-cnn": mnist1d_cnn,
    "mnist1d-mlp": mnist1d_mlp,
    "mnist1d-gru": mnist1d_gru,
    "linear-regression": linear_regression,
    "mlp-binary": mlp_binary,
    "cifar10-cnn": cifar10_cnn,
    "mnist-cnn": mnist_cnn,
    "synthetic-cifar": synthetic_cifar,
    "resnet18-cifar": resnet18_cifar,
    "gpt-mini": gpt_mini,
}


def _options_of(factory: Callable) -> list[str]:
    return [p.name for p in inspect.signature(factory).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def get_workload(name: str, **options: Any) -> Workload:
    """The built-in workload `name`, built with `options` (e.g. data_dir=..., n=...).

    Raises ConfigError for an unknown name (listing the names, with the closest match) or an
    option the workload does not take.
    """
    factory = WORKLOADS.get(name)
    if factory is None:
        close = difflib.get_close_matches(name, list(WORKLOADS), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"unknown workload {name!r}: {hint}the built-in workloads are {', '.join(WORKLOADS)}; "
                          "or give your own as module:function")
    accepted = _options_of(factory)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        takes = f"takes the options {', '.join(accepted)}" if accepted else "takes no options"
        raise ConfigError(f"workload {name!r} {takes}; got {', '.join(unknown)}")
    return factory(**options)


def list_workloads() -> list[dict[str, Any]]:
    """One row per built-in workload: name, description, task, data (a summary), parameters (the
    model's parameter count), defaults, full_batch and options. Builds each model (small) but no data."""
    rows = []
    for name, factory in WORKLOADS.items():
        w = factory()
        rows.append({
            "name": name,
            "description": w.description,
            "task": w.task,
            "data": w.data_summary,
            "parameters": models.count_parameters(w.make_model()),
            "defaults": dict(w.defaults),
            "full_batch": w.full_batch,
            "options": _options_of(factory),
        })
    return rows


# ---------------------------------------------------------------- the user's own workloads


def _import_from_file(path: Path):
    """Import a .py file as a module (its folder joins sys.path so that it can import its neighbours)."""
    if not path.is_file():
        raise ConfigError(f"workload file {path} does not exist")
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_name = f"_gputrain_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def _is_module_or_parent(missing: str | None, module_name: str) -> bool:
    """Whether ModuleNotFoundError's `missing` is the module asked for (or a package above it),
    rather than something that module imports."""
    return missing is not None and (module_name == missing or module_name.startswith(missing + "."))


def _import_module(module_name: str):
    """Import a dotted module; modules in the current directory are found too (as `python -m` would)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if not _is_module_or_parent(exc.name, module_name):
            raise ConfigError(f"importing {module_name!r} failed: it needs the module {exc.name!r}, "
                              "which is not installed") from exc
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if not _is_module_or_parent(exc.name, module_name):
                raise ConfigError(f"importing {module_name!r} failed: it needs the module {exc.name!r}, "
                                  "which is not installed") from exc
    raise ConfigError(f"no module named {module_name!r}: give an importable module (pkg.module:function, "
                      f"searched on sys.path and in {cwd}) or a file (path/to/file.py:function)")


def _import_user_module(module_part: str, looks_like_file: bool):
    """The user's module (a file, or a dotted name): a syntax error in it, or a module it imports that
    is not installed, is one line naming the file and what to do; any other error raised while it is
    imported keeps its traceback, with a note."""
    try:
        if looks_like_file:
            return _import_from_file(Path(module_part).expanduser())
        return _import_module(module_part)
    except SyntaxError as exc:
        where = f"{exc.filename or module_part}, line {exc.lineno}" if exc.lineno else (exc.filename or module_part)
        raise ConfigError(f"the workload module {module_part} does not compile: {exc.msg} ({where}); fix it, or "
                          "name another workload") from None
    except ModuleNotFoundError as exc:
        if not looks_like_file:
            raise  # _import_module said it already
        raise ConfigError(f"importing {module_part!r} failed: it needs the module {exc.name!r}, which is not "
                          "installed") from None
    except ConfigError:
        raise
    except Exception as exc:
        exc.add_note(f"gputrain: importing the workload module {module_part} raised; the error is in that module "
                     "(above)")
        raise


def load_user_workload(spec: str, **options: Any) -> Workload:
    """Import "pkg.module:function" (or "path/to/file.py:function") and return function(**options).

    The function must return a gputrain Workload (a Workload object named there is taken as is).
    Raises ConfigError when the module cannot be found, has no such function, or the function
    returns something else.
    """
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise ConfigError(f"a user workload is given as module:function (e.g. mypkg.tasks:make_workload "
                          f"or ./tasks.py:make_workload), got {spec!r}")
    looks_like_file = module_part.endswith(".py") or "/" in module_part or os.sep in module_part
    module = _import_user_module(module_part, looks_like_file)
    if not hasattr(module, attr):
        found = sorted(n for n, v in vars(module).items()
                       if not n.startswith("_") and (callable(v) or isinstance(v, Workload))
                       and getattr(v, "__module__", module.__name__) == module.__name__)
        listing = f"; it has {', '.join(found)}" if found else ""
        raise ConfigError(f"module {module_part!r} has no function {attr!r}{listing}")
    target = getattr(module, attr)
    if isinstance(target, Workload):
        if options:
            raise ConfigError(f"{spec} is a Workload object, not a function: it takes no options "
                              f"(got {', '.join(sorted(options))})")
        return target
    if not callable(target):
        raise ConfigError(f"{spec} is a {type(target).__name__}, not a function returning a Workload")
    try:
        inspect.signature(target).bind(**options)
    except TypeError as exc:
        raise ConfigError(f"{spec} cannot take the options {', '.join(sorted(options)) or '(none)'}: {exc}") from None
    except ValueError:
        pass  # no signature (a builtin): let the call decide
    try:
        result = target(**options)
    except Exception as exc:  # the user's own code: its traceback stays, with what gputrain was doing
        given = f" with the options {', '.join(f'{k}={v!r}' for k, v in options.items())}" if options else ""
        exc.add_note(f"gputrain: the workload function {spec} raised while building the workload{given}; the "
                     "error is in that function (above)")
        raise
    if not isinstance(result, Workload):
        raise ConfigError(f"{spec} returned {type(result).__name__}; it must return a gputrain.workloads.Workload "
                          "(name, description, make_data, make_model, loss_fn, ...)")
    return result


def resolve_workload(spec: str, **options: Any) -> Workload:
    """A built-in workload by name, or the user's when `spec` contains ':' (module:function)."""
    if ":" in spec:
        return load_user_workload(spec, **options)
    return get_workload(spec, **options)
