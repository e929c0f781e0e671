"""Rebound adapter for Celery: retry decisions from the Rebound sidecar, with a fallback."""

from .assign import arm
from .client import TargetError
from .core import DEFAULT_IDENTITY, DEFAULT_POLICY, Rebound
from .decide import decide_local
from .task import DEAD_LETTER_TASK, KEY_HEADER, GiveUpRetried, ReboundTask, RetryRequested, WorkerLost, enqueue, replay

__all__ = ["DEFAULT_IDENTITY", "DEFAULT_POLICY", "DEAD_LETTER_TASK", "KEY_HEADER", "Rebound", "ReboundTask",
           "RetryRequested", "TargetError", "GiveUpRetried", "WorkerLost", "arm", "decide_local", "enqueue", "replay"]
__version__ = "0.1.0"
