"""The errors that mean bad input, not a bug: every command line reports them as one line, exit status 2."""

from __future__ import annotations

from nmtcore.allocator import AllocatorError
from nmtcore.bert import BertError
from nmtcore.checkpoint import CheckpointError
from nmtcore.config import ConfigError
from nmtcore.data import DataError
from nmtcore.sweep import SpaceError, SweepError
from nmtcore.tracking import TrackingError

USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, DataError, CheckpointError, TrackingError, SpaceError,
                                                SweepError, BertError, AllocatorError, FileNotFoundError,
                                                PermissionError)
