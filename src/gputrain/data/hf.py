"""Hugging Face datasets, passed straight to fit: columns become dict batches.

- `datasets.Dataset` (map-style, in memory or memory-mapped Arrow; with or without
  `set_format("torch")`): each batch is one `dataset[index_list]` read, a dict of columns turned
  into tensors (strings stay lists), through gputrain's sampler (sharded by rank, resumable at
  any batch). With a `collate_fn` (a tokenizer's `DataCollatorWithPadding`, say) the rows are read
  one by one and the collate_fn makes the batch, padding included.
- `datasets.IterableDataset` (`streaming=True`, local JSON lines, Parquet, CSV, ...): split across
  processes with `split_dataset_by_node`, batched by a StatefulDataLoader (torchdata) whose state
  holds the dataset's own `state_dict()`, so a resumed run continues from the same example.

Rows of different lengths in one batch need padding: without a collate_fn that pads, the error says
which column and how to pad. `datasets` is imported only here and only when such a dataset is given.
"""

from __future__ import annotations

import collections.abc
import numbers
from typing import Any, cast

import torch
from torch.utils.data import Dataset

from gputrain.errors import DataError


def _hf_kind(obj: Any) -> str | None:
    """"Dataset" / "IterableDataset" for the Hugging Face classes (without importing datasets), else None."""
    for cls in type(obj).__mro__:
        if cls.__module__.split(".")[0] == "datasets" and cls.__name__ in ("Dataset", "IterableDataset"):
            return cls.__name__
    return None


def is_hf_dataset(obj: Any) -> bool:
    """A map-style `datasets.Dataset`."""
    return _hf_kind(obj) == "Dataset"


def is_hf_iterable(obj: Any) -> bool:
    """A streaming `datasets.IterableDataset`."""
    return _hf_kind(obj) == "IterableDataset"


def split_by_node(dataset: Any, rank: int, world_size: int) -> tuple[Any, bool]:
    """This rank's part of an IterableDataset (`split_dataset_by_node`), and whether it was split here
    (False: the user had split it already)."""
    if world_size <= 1 or getattr(dataset, "_distributed", None) is not None:
        return dataset, False
    from datasets.distributed import split_dataset_by_node

    return split_dataset_by_node(dataset, rank=rank, world_size=world_size), True


# ---------------------------------------------------------------- columns -> tensors


def _ragged(name: str, lengths: list[int]) -> DataError:
    a, b = max(lengths), min(lengths)
    return DataError(f"column {name!r} has rows of different lengths in one batch ({a} and {b}): pad them, with a "
                     "collate_fn that pads, e.g. fit(..., collate_fn=DataCollatorWithPadding(tokenizer)) from "
                     "transformers, or in the dataset (tokenizer(..., padding='max_length', max_length=N) in "
                     "dataset.map); or remove the column (dataset.remove_columns)")


def to_column(name: str, values: Any) -> Any:
    """One column of a batch as a tensor (numbers, equal-length lists, arrays, tensors), or as it is
    (strings, None). Raises DataError for rows of different lengths."""
    if isinstance(values, torch.Tensor):
        return values
    if hasattr(values, "__array__") and not isinstance(values, (list, tuple)):
        return torch.as_tensor(values)  # a numpy column (set_format("numpy"))
    if not isinstance(values, (list, tuple)) or not values:
        return values
    first = values[0]
    if isinstance(first, torch.Tensor):
        if any(v.shape != first.shape for v in values):
            raise _ragged(name, [v.shape[0] if v.dim() else 1 for v in values])
        return torch.stack(list(values))
    if isinstance(first, (str, bytes)) or first is None or isinstance(first, collections.abc.Mapping):
        return list(values)
    if isinstance(first, (list, tuple)) and len({len(v) for v in values}) > 1:
        raise _ragged(name, [len(v) for v in values])
    if isinstance(first, (numbers.Number, list, tuple)) or hasattr(first, "__array__"):
        try:
            return torch.tensor(values) if not hasattr(first, "__array__") else torch.stack(
                [torch.as_tensor(v) for v in values])
        except (ValueError, TypeError, RuntimeError):
            return list(values)  # nested in a way tensors cannot hold: passed through
    return list(values)


def columns_to_batch(columns: collections.abc.Mapping) -> dict[str, Any]:
    """{column: values of the batch's rows} -> {column: tensor or list}."""
    return {k: to_column(k, v) for k, v in columns.items()}


def collate_rows(rows: list[collections.abc.Mapping]) -> dict[str, Any]:
    """A batch from rows (dicts): one tensor per column; strings stay lists (the collate of HF rows)."""
    if not rows:
        return {}
    if not isinstance(rows[0], collections.abc.Mapping):
        from torch.utils.data import default_collate

        return default_collate(rows)
    return {k: to_column(k, [r[k] for r in rows]) for k in rows[0].keys()}


class HFColumns(Dataset):
    """A `datasets.Dataset` read a batch at a time: `self[index_list]` is one Arrow read, as tensors."""

    def __init__(self, dataset: Any):
        fmt = getattr(dataset, "format", {}) or {}
        # Arrow -> torch without Python lists, unless the user chose torch or numpy output already.
        self.dataset = dataset if fmt.get("type") in ("torch", "numpy") else dataset.with_format("torch")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: list[int]) -> dict[str, Any]:
        return columns_to_batch(self.dataset[list(idx)])


class HFRows(Dataset):
    """A `datasets.Dataset` read row by row, for a collate_fn that makes the batch (and pads)."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[int(i)]

    def __getitems__(self, idx: list[int]) -> list:
        """A batch's rows in one Arrow read (the Dataset's own __getitems__: 136 against 638 us for 32
        rows of 64 tokens read one by one, here); row by row where the Dataset has none."""
        rows = [int(i) for i in idx]
        getitems = getattr(self.dataset, "__getitems__", None)
        return cast(list, getitems(rows)) if callable(getitems) else [self.dataset[i] for i in rows]
