"""Per-batch work done on the device: uint8 -> normalized float, augmentation, memory layout.

A transform applies to one leaf of a batch, the one a workload names (`key`): the inputs of a pair
by default, or a key of a dict batch such as "pixel_values". Every other leaf passes through.
"""

from __future__ import annotations

import collections.abc
from dataclasses import dataclass
from typing import Any

import torch

from gputrain.batch import describe
from gputrain.errors import ConfigError, DataError


@dataclass
class BatchTransform:
    """uint8 -> normalized float, then augmentation, then channels_last, on one leaf of the batch.

    mean/std are per channel in the stored units (0..255 for uint8 images). key: which leaf (None:
    the inputs of a pair, or the batch itself when it is one tensor; a str/int: batch[key]).
    """

    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    augment: str | None = None  # "crop-flip"
    channels_last: bool = False
    key: str | int | None = None

    def __post_init__(self) -> None:
        if self.augment not in (None, "crop-flip"):
            raise ConfigError(f"unknown augmentation {self.augment!r}: the built-in one is 'crop-flip'")
        self._scale: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def is_identity(self) -> bool:
        return self.mean is None and self.augment is None and not self.channels_last

    def for_eval(self) -> "BatchTransform":
        """The same normalization and layout without augmentation."""
        return BatchTransform(self.mean, self.std, None, self.channels_last, self.key)

    def _affine(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x*scale + shift == (x - mean) / std, with the constants cached on the device.
        if x.device not in self._scale:
            mean = torch.tensor(self.mean, dtype=torch.float32, device=x.device)
            std = torch.tensor(self.std, dtype=torch.float32, device=x.device)
            shape = (1, -1) + (1,) * (x.dim() - 2)
            self._scale[x.device] = ((1.0 / std).view(shape), (-mean / std).view(shape))
        return self._scale[x.device]

    def tensor(self, x: torch.Tensor, train: bool, generator: torch.Generator | None = None,
               params: "CropFlip | None" = None) -> torch.Tensor:
        """The transform of one tensor, e.g. (B, C, H, W) uint8 -> float32 normalized.

        Augmentation draws its offsets and flips from `generator`, or takes them from `params` (drawn
        ahead for the batch's samples: resident data draw them once per epoch, so that a batch can
        be assembled inside a CUDA graph without random draws).
        """
        if self.mean is not None:
            scale, shift = self._affine(x)
            x = torch.addcmul(shift, x.float(), scale)
        elif not torch.is_floating_point(x) and (self.augment or x.dim() == 4):
            x = x.float()  # images without normalization; token ids and other integer inputs stay as they are
        if train and self.augment == "crop-flip":
            x = crop_flip(x, params) if params is not None else random_crop_flip(x, pad=PAD, generator=generator)
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def __call__(self, batch: Any, train: bool, generator: torch.Generator | None = None,
                 params: "CropFlip | None" = None) -> Any:
        """The batch with its named leaf transformed (the batch itself when the transform is identity)."""
        if self.is_identity:
            return batch
        if isinstance(batch, torch.Tensor) and self.key is None:
            return self.tensor(batch, train, generator, params)
        key = 0 if self.key is None else self.key
        if isinstance(batch, collections.abc.Mapping):
            if key not in batch:
                raise DataError(f"the transform applies to batch[{key!r}], but the batch is {describe(batch)}: "
                                "name the leaf with the workload's transform key")
            out = dict(batch) if type(batch) is dict else _copy_mapping(batch)
            out[key] = self.tensor(batch[key], train, generator, params)
            return out
        if isinstance(batch, (list, tuple)) and isinstance(key, int) and key < len(batch):
            items = list(batch)
            items[key] = self.tensor(items[key], train, generator, params)
            return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
        raise DataError(f"cannot apply the transform to leaf {key!r} of {describe(batch)}")


def _copy_mapping(batch: collections.abc.Mapping):
    import copy

    out = copy.copy(batch)
    return out if isinstance(out, collections.abc.MutableMapping) else dict(batch)


PAD = 4  # crop-flip's reflect padding, pixels per side: offsets are 0..2*PAD


@dataclass
class CropFlip:
    """Per-sample crop offsets and flips, (N,) each: drawn ahead, sliced or gathered with the samples."""

    dy: torch.Tensor  # int64, 0..2*PAD
    dx: torch.Tensor  # int64, 0..2*PAD
    flip: torch.Tensor  # bool

    @staticmethod
    def empty(n: int, device: torch.device) -> "CropFlip":
        return CropFlip(torch.zeros(n, dtype=torch.int64, device=device),
                        torch.zeros(n, dtype=torch.int64, device=device),
                        torch.zeros(n, dtype=torch.bool, device=device))

    def draw_(self, generator: torch.Generator | None = None) -> "CropFlip":
        """Fresh draws, in place: the buffers keep their addresses (a captured graph reads them)."""
        n = self.dy.shape[0]
        torch.randint(0, 2 * PAD + 1, (n,), generator=generator, out=self.dy)
        torch.randint(0, 2 * PAD + 1, (n,), generator=generator, out=self.dx)
        self.flip.copy_(torch.rand(n, device=self.flip.device, generator=generator) < 0.5)
        return self

    def __getitem__(self, rows) -> "CropFlip":
        """Rows [lo:hi] (a slice: views, no kernel) or at device positions (a gather)."""
        if isinstance(rows, torch.Tensor):
            return CropFlip(self.dy.index_select(0, rows), self.dx.index_select(0, rows),
                            self.flip.index_select(0, rows))
        return CropFlip(self.dy[rows], self.dx[rows], self.flip[rows])


def crop_flip(x: torch.Tensor, params: CropFlip, pad: int = PAD) -> torch.Tensor:
    """Crop with reflect padding at the given offsets, flipped horizontally where asked; one gather.

    x: (B, C, H, W) float on any device; params: B offsets and flips. No host reads: capturable.
    """
    B, C, H, W = x.shape
    dev = x.device
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad), mode="reflect")  # (B, C, H+2p, W+2p)
    rows = params.dy[:, None] + torch.arange(H, device=dev)  # (B, H)
    cols = torch.arange(W, device=dev).expand(B, W)
    cols = torch.where(params.flip[:, None], cols.flip(1), cols) + params.dx[:, None]  # (B, W), flipped where asked
    b = torch.arange(B, device=dev)[:, None, None, None]
    c = torch.arange(C, device=dev)[None, :, None, None]
    return padded[b, c, rows[:, None, :, None], cols[:, None, None, :]]


def random_crop_flip(x: torch.Tensor, pad: int = PAD, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random crop with reflect padding and random horizontal flip, vectorized over the batch.

    x: (B, C, H, W) float on any device. Each sample gets its own offsets and flip; one gather.
    """
    B = x.shape[0]
    dev = x.device
    dy = torch.randint(0, 2 * pad + 1, (B,), device=dev, generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (B,), device=dev, generator=generator)
    flip = torch.rand(B, device=dev, generator=generator) < 0.5
    return crop_flip(x, CropFlip(dy, dx, flip), pad)
