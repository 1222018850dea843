"""Trained weights out of gputrain: safetensors, Hugging Face (`save_pretrained`) and ONNX files.

- `export_safetensors(state_dict, path)`: one .safetensors file that `safetensors.torch.load_file`
  reads back and `model.load_state_dict` takes (tensors made contiguous, on the CPU; tensors that
  share memory, such as tied embeddings, are stored once each as copies).
- `export_hf(model, out_dir)`: a Hugging Face model's `save_pretrained` folder (config.json and
  model.safetensors), which `from_pretrained` loads into the same outputs; for a PEFT model its
  adapter as PEFT writes it (adapter_config.json and adapter_model.safetensors, not the base), which
  `PeftModel.from_pretrained(base, out_dir)` loads.
- `export_onnx(model, example, path)`: `torch.onnx.export` with a dynamic batch dimension; checked
  with onnxruntime (outputs within 1e-4 of PyTorch's on `example`) when it is installed, else with
  `onnx.checker`. It uses torch's TorchScript exporter (`dynamo=False`), which needs only onnx (torch
  2.13 still has it, deprecated); the dynamo exporter, which needs onnxscript too, is taken when the
  TorchScript one is gone.

Nothing is left at the destination by an export that fails: ONNX and Hugging Face files are
written and checked in a temporary folder first and copied into place (each file atomically) only
when they are good, and a failure raises ExportError saying which format failed, why, and which
formats still work. The model's own forward raising keeps its traceback, with a note.

The optional packages (safetensors, onnx, onnxruntime: `pip install 'gputrain[export]'`) are
imported only here, when an export runs.
"""

from __future__ import annotations

import collections.abc
import contextlib
import importlib.util
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import IO, Any, Iterator, Mapping

import torch
from torch import nn

from gputrain.errors import ConfigError, GputrainError

INSTALL_HINT = "pip install 'gputrain[export]'"
ONNX_TOLERANCE = 1e-4  # max |onnxruntime - torch| accepted, in the outputs' units


class ExportError(GputrainError):
    """An export could not be written or did not reproduce the model's outputs."""


def _failed(fmt: str, why: str, model: nn.Module | None = None) -> ExportError:
    """The one line of a failed export: the format, why, and the formats that still work."""
    others = [f for f in ("safetensors", "onnx", "hf") if f != fmt and (f != "hf" or (model is not None
                                                                                      and is_hf_model(model)))]
    return ExportError(f"--format {fmt} failed: {why}; nothing was written, and the other formats still work "
                       f"(--format {' or --format '.join(others)})")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


def _place(staged: Path, dest: Path) -> None:
    """Copy a staged file into place atomically (temp file beside `dest`, renamed over it)."""
    with open(staged, "rb") as src, _writing(dest) as f:
        shutil.copyfileobj(src, f)


@contextlib.contextmanager
def _writing(dest: Path) -> Iterator[IO[bytes]]:
    """atomic_file(dest), with the disk's refusal (a full disk, no permission) said in one line."""
    from gputrain.io.atomic import atomic_file

    try:
        with atomic_file(dest, "wb") as f:
            yield f
    except OSError as exc:
        raise ConfigError(f"{dest}: cannot write the export ({exc.strerror or exc}): free space or choose another "
                          "--out") from None


def _require(module: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{what} needs the {module} package: {INSTALL_HINT}")


def plain_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors that share no memory (what a .safetensors file holds)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        t = tensor.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
        if key in seen or t is tensor:
            t = t.clone()  # tied weights: each name its own copy; never the caller's own tensor
        seen.add((t.untyped_storage().data_ptr(), int(t.storage_offset())))
        out[name] = t
    return out


def export_safetensors(state: Mapping[str, torch.Tensor], path: str | os.PathLike,
                       metadata: Mapping[str, str] | None = None) -> Path:
    """Write `state` (a state_dict) to `path` as safetensors; returns the path."""
    _require("safetensors", "--format safetensors")
    from safetensors.torch import save

    path = Path(path)
    tensors = plain_state_dict(state)
    if not tensors:
        raise ExportError("nothing to export: the state dict holds no tensors")
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    try:
        data = save(tensors, metadata=meta or None)
    except Exception as exc:  # noqa: BLE001 - safetensors refuses what it cannot store (a dtype, ...) in its words
        raise _failed("safetensors", f"safetensors cannot store these weights ({_first_line(exc)})") from exc
    with _writing(path) as f:  # whole or absent, like the checkpoints
        f.write(data)
    return path


def is_hf_model(model: nn.Module) -> bool:
    return callable(getattr(model, "save_pretrained", None)) and hasattr(model, "config")


def is_peft_model(model: nn.Module) -> bool:
    """A PEFT model (peft.PeftModel): its save_pretrained writes the adapter, not the base."""
    return is_hf_model(model) and isinstance(getattr(model, "peft_config", None), dict)


def export_hf(model: nn.Module, out_dir: str | os.PathLike) -> Path:
    """`model.save_pretrained(out_dir)` (safetensors weights + config.json; a PEFT model's adapter:
    adapter_config.json + adapter_model.safetensors); returns the folder. Written into a temporary
    folder first; its files are copied into `out_dir` only when it succeeded."""
    if not is_hf_model(model):
        raise ConfigError(f"--format hf exports Hugging Face models (with save_pretrained); {type(model).__name__} "
                          "is not one: use --format safetensors (or onnx)")
    out = Path(out_dir)
    save_pretrained = getattr(model, "save_pretrained")
    with tempfile.TemporaryDirectory(prefix="gputrain-export-hf-") as staging:
        try:
            save_pretrained(staging)
        except Exception as exc:  # noqa: BLE001 - transformers' own errors, in its words
            raise _failed("hf", f"save_pretrained raised {_first_line(exc)}", model) from exc
        if is_peft_model(model) and not (Path(staging) / "adapter_config.json").is_file():
            raise _failed("hf", "PEFT's save_pretrained wrote no adapter_config.json (the adapter)", model)
        for staged in sorted(Path(staging).rglob("*")):
            if staged.is_file():
                _place(staged, out / staged.relative_to(staging))
    out.mkdir(parents=True, exist_ok=True)  # a model with no files to save still gets its folder
    return out


def _call_args(example: Any) -> tuple[tuple[Any, ...], dict[str, Any], list[str]]:
    """(args, kwargs, input names) to call the model with `example` (a tensor, a tuple, or a dict)."""
    if isinstance(example, torch.Tensor):
        return (example,), {}, ["input"]
    if isinstance(example, collections.abc.Mapping):
        kwargs = {k: v for k, v in example.items() if isinstance(v, torch.Tensor)}
        return (), kwargs, list(kwargs)
    if isinstance(example, (tuple, list)):
        return tuple(example), {}, [f"input_{i}" for i in range(len(example))]
    raise ConfigError(f"an ONNX export needs example inputs as a tensor, a tuple or a dict of tensors, "
                      f"got {type(example).__name__}")


def _output_tensors(outputs: Any) -> list[torch.Tensor]:
    from gputrain.batch import tensor_leaves
    from gputrain.outputs import logits_of

    return tensor_leaves(logits_of(outputs) if not isinstance(outputs, (tuple, list)) else outputs)


def export_onnx(model: nn.Module, example: Any, path: str | os.PathLike, *, opset: int | None = None,
                part: str | None = None) -> dict[str, Any]:
    """Export `model` called with `example` (inputs as the model takes them, on the CPU) to `path`.

    Returns {"path", "exporter", "check", "max_abs_diff"}. The file is exported and checked in a
    temporary folder and copied to `path` only when it passed. Raises ExportError when the exporter
    cannot convert the model, or onnxruntime cannot run the file or its outputs differ from
    PyTorch's by more than ONNX_TOLERANCE; the model's own forward raising keeps its traceback.
    part: the name of the part of a model that `model` is (--part): its inputs are not what the
    workload's data hold, so its raising on them is a ConfigError (one line) saying so.
    """
    _require("onnx", "--format onnx")
    path = Path(path)
    model = model.to("cpu").eval()
    args, kwargs, names = _call_args(example)
    try:
        with torch.no_grad():
            expected = _output_tensors(model(*args, **kwargs))
    except Exception as exc:
        if part is not None:  # the inputs are the whole model's: the part's own are not known here
            raise ConfigError(f"--format onnx --part {part}: the part does not run on its workload's inputs "
                              f"({_describe_inputs(args, kwargs)}: {_first_line(exc)}), and an "
                              "ONNX export needs inputs it takes; export its weights with --format safetensors") from None
        exc.add_note(f"gputrain export: the model raised on example inputs from its workload's data "
                     f"({_describe_inputs(args, kwargs)}), before the ONNX export: the error above is the model's")
        raise
    output_names = [f"output_{i}" if len(expected) > 1 else "output" for i in range(len(expected))]
    with tempfile.TemporaryDirectory(prefix="gputrain-export-onnx-") as staging:
        staged = Path(staging) / path.name
        exporter = _run_exporter(model, args, kwargs, names, output_names, staged, opset)
        report: dict[str, Any] = {"path": str(path), "exporter": exporter}
        report.update(_check_onnx(staged, args, kwargs, names, expected))
        for file in sorted(Path(staging).iterdir()):  # the model, and external data files beside it (large models)
            _place(file, path.parent / file.name)
    return report


def _describe_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    shapes = [f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in args if isinstance(t, torch.Tensor)]
    shapes += [f"{k} {tuple(t.shape)}" for k, t in kwargs.items()]
    return ", ".join(shapes) or "no tensors"


@contextlib.contextmanager
def _native_stdout_dropped() -> Iterator[None]:
    """torch's TorchScript exporter logs its whole graph to the process's stdout from C++ when it
    fails (`_jit_onnx_log`): a screen of IR before the one line that says what failed, and a broken
    document under --json. File descriptor 1 points at a discarded file meanwhile."""
    import sys

    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no usable stdout: nothing to protect
        yield
        return
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 1)
            try:
                yield
            finally:
                sys.stdout.flush()
                os.dup2(saved, 1)
    finally:
        os.close(saved)


def _run_exporter(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], names: list[str],
                  output_names: list[str], staged: Path, opset: int | None) -> str:
    """torch.onnx.export into `staged`; which exporter wrote it ("torchscript" or "dynamo")."""
    export_kwargs: dict[str, Any] = {"input_names": names, "output_names": output_names}
    if opset is not None:
        export_kwargs["opset_version"] = opset
    with warnings.catch_warnings(), _native_stdout_dropped():
        # The TorchScript exporter announces its deprecation on every call.
        for category in (DeprecationWarning, FutureWarning, UserWarning):
            warnings.simplefilter("ignore", category)
        try:
            torch.onnx.export(model, args, str(staged), kwargs=kwargs or None, dynamo=False,
                              dynamic_axes={n: {0: "batch"} for n in names + output_names}, **export_kwargs)
            return "torchscript"
        except (TypeError, NotImplementedError) as exc:  # a torch without the TorchScript exporter
            if importlib.util.find_spec("onnxscript") is None:
                raise _failed("onnx", f"this torch's ONNX exporter needs onnxscript ({_first_line(exc)}): "
                                      "pip install onnxscript") from exc
            fallback: BaseException = exc
        except Exception as exc:  # noqa: BLE001 - the exporter's own errors (an unsupported op, ...), in its words
            raise _failed("onnx", f"torch.onnx.export cannot convert this model ({_first_line(exc)})") from exc
        batch = torch.export.Dim("batch")
        dims = {k: {0: batch} for k in kwargs} if kwargs else tuple({0: batch} for _ in args)
        try:
            torch.onnx.export(model, args, str(staged), kwargs=kwargs or None, dynamo=True, dynamic_shapes=dims,
                              **export_kwargs)
        except Exception as exc:  # noqa: BLE001
            raise _failed("onnx", f"neither ONNX exporter converts this model (TorchScript: "
                                  f"{_first_line(fallback)}; dynamo: {_first_line(exc)})") from exc
    return "dynamo"


def _check_onnx(staged: Path, args: tuple[Any, ...], kwargs: dict[str, Any], names: list[str],
                expected: list[torch.Tensor]) -> dict[str, Any]:
    """Run the file under onnxruntime against PyTorch's outputs (else onnx.checker); {"check", "max_abs_diff"}."""
    if importlib.util.find_spec("onnxruntime") is None:
        import onnx

        try:
            onnx.checker.check_model(str(staged))
        except Exception as exc:  # noqa: BLE001 - onnx's ValidationError and friends
            raise _failed("onnx", f"onnx.checker rejects the exported file ({_first_line(exc)})") from exc
        return {"check": "onnx.checker", "max_abs_diff": None}
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(str(staged), providers=["CPUExecutionProvider"])
        fed = {i.name for i in session.get_inputs()}
        feed = {n: t.detach().cpu().numpy() for n, t in zip(names, list(args) + list(kwargs.values())) if n in fed}
        got = session.run(None, feed)
    except Exception as exc:  # noqa: BLE001 - onnxruntime's errors (an op it lacks, ...), in its words
        raise _failed("onnx", f"onnxruntime cannot run the exported file ({_first_line(exc)})") from exc
    diff = max((float((torch.from_numpy(g) - e.float()).abs().max()) for g, e in zip(got, expected)), default=0.0)
    if not diff <= ONNX_TOLERANCE:
        raise _failed("onnx", f"onnxruntime's outputs differ from PyTorch's by up to {diff:.3g} (more than "
                              f"{ONNX_TOLERANCE:g})")
    return {"check": "onnxruntime", "max_abs_diff": diff}
