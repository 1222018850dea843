"""Feeding the device: resident tensors, DataLoaders, iterables, Hugging Face datasets, the one device
feed that copies their batches (read ahead on a side stream on CUDA), transforms, the memory rule.

Every loader yields batches already on the device and transformed, and can start at any (epoch,
batch) so that a resumed run sees exactly the batches it would have seen (`BatchStream` holds that
position, data/stream.py). For an IterableDataset: `my_part`, `take_part` and `Sharded` give each
process and DataLoader worker its own part of the stream (data/iterable.py).

- `feed`: `make_loader`, the one place that turns what a user passes into the source a run reads;
  `placement`: where the data live for a run (the memory rule); `sources`: which source feeds data that
  are neither tensor columns nor a plain map-style Dataset.
- `resident`: mini-batches gathered from tensors that stay on the device; `deferred`: a batch not yet
  assembled, so that a CUDA graph assembles it inside the replay.
- `loader`: a DataLoader driven epoch by epoch; `user_loader`: your own DataLoader, rebuilt to shard and
  resume, or used as is; `iterable`: IterableDatasets and iterables of batches; `hf`: Hugging Face datasets.
- `device_feed`: where host batches reach the device (the one read-ahead rule); `transforms`: per-batch
  work on the device; `stream`: the resumable data position across epochs.
- `splits`: a workload's train and test columns (`DataSplits`); `checks`: bad data, said clearly;
  `tokens`: `count_tokens`, for `fit(num_items=...)`.
"""

from gputrain.data.iterable import IterableBatches, Sharded, my_part, take_part
from gputrain.data.loader import LoaderBatches, UserLoaderBatches, default_workers
from gputrain.data.feed import make_loader
from gputrain.data.placement import Placement, as_columns, as_tensors, choose_device_resident, fits_on_device
from gputrain.data.resident import TensorBatches
from gputrain.data.stream import BatchStream, epoch_seed
from gputrain.data.tokens import count_tokens
from gputrain.data.transforms import BatchTransform, random_crop_flip

__all__ = ["BatchStream", "BatchTransform", "IterableBatches", "LoaderBatches", "Placement",
           "Sharded", "TensorBatches", "UserLoaderBatches", "as_columns", "as_tensors", "choose_device_resident",
           "count_tokens", "default_workers", "epoch_seed", "fits_on_device", "make_loader", "my_part",
           "random_crop_flip", "take_part"]
