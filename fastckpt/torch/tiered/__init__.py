"""Tensor state and checkpoint tiers: ``staging`` (CPU tensors copied straight into tier files mapped into memory,
handed to the node agent before they are hashed and committed) and ``peers`` (each rank's copy replicated to the tier
of the rank one node over; a lost node's copies restored from its peers)."""

from .peers import restore_tier

__all__ = ["restore_tier"]
