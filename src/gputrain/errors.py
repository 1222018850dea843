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


class StopRequested(GputrainError):
    """A stop signal (SIGTERM, SIGINT, SIGUSR1) ended the run after a checkpoint; `exit_code` is
    the conventional status (128 + the signal's number: 143 for SIGTERM, 130 for SIGINT)."""

    def __init__(self, message: str, exit_code: int, step: int, checkpoint: str | None):
        super().__init__(message)
        self.exit_code, self.step, self.checkpoint = exit_code, step, checkpoint


def user_frame_summary(exc: BaseException):
    """The innermost frame of `exc` outside torch and gputrain (a `traceback.FrameSummary`), or None:
    where in the user's code (model, loss, data, step) it was raised. gputrain's frames are told by
    its package folder, not by "/gputrain/" in the path: a checkout named gputrain holds the user's
    tests and examples too."""
    import os
    import traceback

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep  # .../gputrain/
    for fr in reversed(traceback.extract_tb(exc.__traceback__)):
        if "/torch/" not in fr.filename.replace("\\", "/") and not os.path.abspath(fr.filename).startswith(package):
            return fr
    return None


def user_frame(exc: BaseException) -> str:
    """file:line (function) of the user's frame of `exc` (`user_frame_summary`); without one, the
    innermost frame."""
    import traceback

    fr = user_frame_summary(exc)
    if fr is not None:
        return f"{fr.filename}:{fr.lineno} ({fr.name})"
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "an unknown place"
