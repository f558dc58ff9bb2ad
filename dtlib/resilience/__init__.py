"""Fault tolerance: checkpoints that survive being killed and load on another layout
(:mod:`~dtlib.resilience.checkpoint`), a heartbeat that catches hung ranks
(:mod:`~dtlib.resilience.heartbeat`), restarts under torchrun (:mod:`~dtlib.resilience.elastic`),
and how often to checkpoint (:mod:`~dtlib.resilience.interval`)."""

from dtlib.extras import require

require("course", "torch", feature=__name__)
from dtlib.resilience.checkpoint import Checkpointer, CheckpointError

__all__ = ["Checkpointer", "CheckpointError"]
