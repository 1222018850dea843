"""Trained weights out of gputrain: safetensors, Hugging Face (`save_pretrained`) and ONNX files.

- `export_safetensors(state_dict, path)`: one .safetensors file that `safetensors.torch.load_file`
  reads back and `model.load_state_dict` takes (tensors made contiguous, on the CPU; tensors that
  share memory, such as tied embeddings, are stored once each as copies).
- `export_hf(model, out_dir)`: a Hugging Face model's `save_pretrained` folder (config.json and
  model.safetensors), which `from_pretrained` loads into the same outputs.
- `export_onnx(model, example, path)`: `torch.onnx.export` with a dynamic batch dimension; checked
  with onnxruntime (outputs within 1e-4 of PyTorch's on `example`) when it is installed, else with
  `onnx.checker`. It uses torch's TorchScript exporter (`dynamo=False`), which needs only onnx (torch
  2.13 still has it, deprecated); the dynamo exporter, which needs onnxscript too, is taken when the
  TorchScript one is gone.

The optional packages (safetensors, onnx, onnxruntime: `pip install 'gputrain[export]'`) are
imported only here, when an export runs.
"""

from __future__ import annotations

import collections.abc
import importlib.util
import os
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from gputrain.errors import ConfigError, GputrainError

INSTALL_HINT = "pip install 'gputrain[export]'"
ONNX_TOLERANCE = 1e-4  # max |onnxruntime - torch| accepted, in the outputs' units


class ExportError(GputrainError):
    """An export could not be written or did not reproduce the model's outputs."""


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

    from gputrain.io.atomic import atomic_file

    path = Path(path)
    tensors = plain_state_dict(state)
    if not tensors:
        raise ExportError("nothing to export: the state dict holds no tensors")
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    data = save(tensors, metadata=meta or None)
    with atomic_file(path, "wb") as f:  # whole or absent, like the checkpoints
        f.write(data)
    return path


def is_hf_model(model: nn.Module) -> bool:
    return callable(getattr(model, "save_pretrained", None)) and hasattr(model, "config")


def export_hf(model: nn.Module, out_dir: str | os.PathLike) -> Path:
    """`model.save_pretrained(out_dir)` (safetensors weights + config.json); returns the folder."""
    if not is_hf_model(model):
        raise ConfigError(f"--format hf exports Hugging Face models (with save_pretrained); {type(model).__name__} "
                          "is not one: use --format safetensors (or onnx)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained = getattr(model, "save_pretrained")
    save_pretrained(str(out))
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


def export_onnx(model: nn.Module, example: Any, path: str | os.PathLike, *, opset: int | None = None
                ) -> dict[str, Any]:
    """Export `model` called with `example` (inputs as the model takes them, on the CPU) to `path`.

    Returns {"path", "exporter", "check", "max_abs_diff"}. Raises ExportError when onnxruntime's
    outputs differ from PyTorch's by more than ONNX_TOLERANCE.
    """
    _require("onnx", "--format onnx")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = model.to("cpu").eval()
    args, kwargs, names = _call_args(example)
    with torch.no_grad():
        expected = _output_tensors(model(*args, **kwargs))
    output_names = [f"output_{i}" if len(expected) > 1 else "output" for i in range(len(expected))]
    export_kwargs: dict[str, Any] = {"input_names": names, "output_names": output_names}
    if opset is not None:
        export_kwargs["opset_version"] = opset
    exporter = "torchscript"
    with warnings.catch_warnings():
        # The TorchScript exporter announces its deprecation on every call.
        for category in (DeprecationWarning, FutureWarning, UserWarning):
            warnings.simplefilter("ignore", category)
        try:
            torch.onnx.export(model, args, str(path), kwargs=kwargs or None, dynamo=False,
                              dynamic_axes={n: {0: "batch"} for n in names + output_names}, **export_kwargs)
        except (TypeError, NotImplementedError) as exc:  # a torch without the TorchScript exporter
            if importlib.util.find_spec("onnxscript") is None:
                raise ConfigError(f"this torch's ONNX export needs onnxscript ({exc}): pip install onnxscript") from None
            batch = torch.export.Dim("batch")
            dims = {k: {0: batch} for k in kwargs} if kwargs else tuple({0: batch} for _ in args)
            torch.onnx.export(model, args, str(path), kwargs=kwargs or None, dynamo=True, dynamic_shapes=dims,
                              **export_kwargs)
            exporter = "dynamo"
    report: dict[str, Any] = {"path": str(path), "exporter": exporter}
    if importlib.util.find_spec("onnxruntime") is not None:
        import onnxruntime as ort

        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        fed = {i.name for i in session.get_inputs()}
        feed = {n: t.detach().cpu().numpy() for n, t in zip(names, list(args) + list(kwargs.values())) if n in fed}
        got = session.run(None, feed)
        diff = max((float((torch.from_numpy(g) - e.float()).abs().max()) for g, e in zip(got, expected)), default=0.0)
        report.update(check="onnxruntime", max_abs_diff=diff)
        if not diff <= ONNX_TOLERANCE:
            raise ExportError(f"{path}: onnxruntime's outputs differ from PyTorch's by up to {diff:.3g} "
                              f"(more than {ONNX_TOLERANCE:g})")
    else:
        import onnx

        onnx.checker.check_model(str(path))
        report.update(check="onnx.checker", max_abs_diff=None)
    return report
