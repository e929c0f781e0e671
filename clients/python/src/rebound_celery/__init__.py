"""Rebound adapter for Celery: retry decisions from the Rebound sidecar, with a fallback."""

from .core import DEFAULT_POLICY, Rebound
from .decide import decide_local
from .task import DEAD_LETTER_TASK, KEY_HEADER, ReboundTask, enqueue

__all__ = ["DEFAULT_POLICY", "DEAD_LETTER_TASK", "KEY_HEADER", "Rebound", "ReboundTask", "decide_local", "enqueue"]
__version__ = "0.1.0"
