"""The device feed: where the batches of every host-fed source reach the device, and the one read-ahead rule.

Every source that reads its batches on the host hands them to `to_device`: `LoaderBatches` (gputrain's
DataLoader over a Dataset or over tensor columns that stay on the host, a user's DataLoader rebuilt, a
Hugging Face Dataset), `UserLoaderBatches` (a user's DataLoader used as is) and `IterableBatches` (an
IterableDataset, a Hugging Face IterableDataset, any iterable of batches). Tensors kept on the device
(data/resident.py) are there already and do not pass here.

The read-ahead rule: on CUDA, batch i+1 is read and copied to the GPU on a side stream while batch i
computes, unless a checkpoint saves the source's own state as the data position (`state_saved`: a
StatefulDataLoader, which also carries a Hugging Face IterableDataset's `state_dict()`). A checkpoint
takes that state where the stream stands, after the batches the run consumed (data/stream.py); a batch
read ahead would be inside it, and the resumed run would never train on that batch. Every other
source's position is a count (an epoch and batch that gputrain's sampler starts at, or the batches a
resumed run reads again up to it), which a batch read ahead leaves as it is. Without a side stream
the batches are moved one by one as they are asked for: with non_blocking on CUDA (in order on the
computing stream), as they are on other devices (MPS); the CPU takes them as they come.

What only CUDA runs (the side stream, the non_blocking copies on it, `record_stream`) is one function,
`_cuda_side_stream`; `read_ahead` is the order of the work, device-free, and the tests run it on the
CPU through a stand-in side stream (tests/conftest.py, `side_stream_on_cpu`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from gputrain import batch as batches

Handle = Callable[[Any], Any]  # a batch in, the batch (copied, or handed over) out


def to_device(source: Iterator[Any], device: torch.device, *, state_saved: bool) -> Iterator[Any]:
    """The batches of `source` on `device`, in order: read ahead on a side stream unless `state_saved`
    (True when a checkpoint saves the source's own state as the position; see the module docstring)."""
    side = None if state_saved else side_stream(device)
    if side is not None:
        return read_ahead(source, *side)
    if device.type == "cpu":
        return source
    # Pinned batches copy asynchronously on CUDA, in order on the stream that computes.
    non_blocking = device.type == "cuda"
    return (batches.move(b, device, non_blocking=non_blocking) for b in source)


def side_stream(device: torch.device) -> tuple[Handle, Handle] | None:
    """(start a batch's copy, hand a copied batch to the computing stream) on a side stream of
    `device`; None off CUDA, where no copy runs beside the compute."""
    if device.type != "cuda":  # cuda-only: the side stream
        return None
    return _cuda_side_stream(device)


def read_ahead(source: Iterator[Any], start_copy: Handle, hand_over: Handle) -> Iterator[Any]:
    """The batches of `source`, each read and its copy started one batch ahead.

    Batch i is handed over (the computing stream waits for its copy, not for the next one) before
    batch i+1 is read and its copy started; then batch i is yielded. An error reading batch i+1 is
    raised when batch i+1 is asked for, after batch i was trained on, as without reading ahead: the
    stream's note then names the batch that failed (data/stream.py).
    """
    pending, error = _read(source, start_copy)
    while pending is not None:
        batch = hand_over(pending[0])
        pending, error = _read(source, start_copy)
        yield batch
    if error is not None:
        raise error


def _read(source: Iterator[Any], start_copy: Handle) -> tuple[tuple[Any] | None, Exception | None]:
    """((the next batch, its copy started),) or None at the end; the error reading it, if any."""
    try:
        batch = next(source)
    except StopIteration:
        return None, None
    except Exception as exc:
        return None, exc
    return (start_copy(batch),), None


def _cuda_side_stream(device: torch.device) -> tuple[Handle, Handle]:
    """The side stream's two halves on a CUDA device. Only a GPU runs this (docs/gpu_checklist.md).

    start_copy: every tensor leaf of the batch copied with non_blocking on the side stream (from pinned
    memory the copy overlaps the compute). hand_over: the computing stream waits for the side stream,
    and record_stream tells the caching allocator that the computing stream uses each tensor, so its
    memory is not given to another allocation on the side stream while the step still reads it.
    """
    stream = torch.cuda.Stream(device)

    def start_copy(batch: Any) -> Any:
        with torch.cuda.stream(stream):
            return batches.move(batch, device, non_blocking=True)

    def hand_over(batch: Any) -> Any:
        main = torch.cuda.current_stream(device)
        main.wait_stream(stream)
        for t in batches.tensor_leaves(batch):
            t.record_stream(main)
        return batch

    return start_copy, hand_over
