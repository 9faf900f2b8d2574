"""Checkpoint tiers: saves committed into a node-local directory (``/dev/shm``, local NVMe) in seconds, drained to
the durable URI by a node agent that outlives the training process, and read back from the nearest copy.

``directory`` (where a tier keeps its copies, its queue and its records; room and pruning), ``drain`` (one rank's copy
to the durable store, and the durable commit once every rank's data is in), ``agent`` (the long-lived process that
drains the queue), ``nearest`` (which copy a restore reads, the newest committed checkpoint across tiers).
"""

from .agent import ensure_agent, run_agent
from .directory import Tier, TierFullError
from .nearest import held_files, latest_across, nearest_copy, tier_checkpoint

__all__ = ["Tier", "TierFullError", "ensure_agent", "held_files", "latest_across", "nearest_copy", "run_agent",
           "tier_checkpoint"]
