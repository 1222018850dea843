"""Feeding the device: resident tensors, DataLoaders with a prefetcher, transforms, the memory rule.

Every loader yields batches already on the device and transformed, and can start at any (epoch,
batch) so that a resumed run sees exactly the batches it would have seen.
"""

from gputrain.data.loader import CudaPrefetcher, LoaderBatches, UserLoaderBatches, default_workers
from gputrain.data.placement import (Placement, as_columns, as_tensors, choose_device_resident, fits_on_device,
                                     make_loader)
from gputrain.data.resident import TensorBatches
from gputrain.data.stream import BatchStream, epoch_seed
from gputrain.data.transforms import BatchTransform, random_crop_flip

__all__ = ["BatchStream", "BatchTransform", "CudaPrefetcher", "LoaderBatches", "Placement", "TensorBatches",
           "UserLoaderBatches", "as_columns", "as_tensors", "choose_device_resident", "default_workers",
           "epoch_seed", "fits_on_device", "make_loader", "random_crop_flip"]
