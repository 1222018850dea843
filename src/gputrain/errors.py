"""Errors a user can act on. Each message says what was wrong and what to do."""


class GputrainError(Exception):
    """Base class of every error gputrain raises on purpose."""


class DeviceError(GputrainError, RuntimeError):
    """A device was asked for that does not exist, cannot be used, or does not match the data."""


class ConfigError(GputrainError, ValueError):
    """A setting is invalid or impossible on this machine (e.g. fp16 on the CPU)."""


class CheckpointError(GputrainError):
    """A checkpoint file is missing, truncated, corrupt or belongs to another model."""


class DataError(GputrainError):
    """A data set is missing or malformed; the message says where to put which files."""
