"""Asymmetric paged memory for hybrid GDN/attention caches (docs/design.md).

One device arena, cut into segments owned by a KV-page pool, a state-slot pool and a
speculative-stash pool, each at its natural unit size, behind one space of stable virtual
handles; segments migrate between pools only when an allocation fails. The baselines
(``unified_padded``, ``static_dual``, ``multi_ended``) run through the same code.
"""

from serving.memory.arena import Arena, view
from serving.memory.errors import (
    AllocationTooLargeError,
    DoubleFreeError,
    HandleKindError,
    MemoryManagerError,
    OutOfMemoryError,
    UnknownHandleError,
    UnknownKindError,
    UnknownRequestError,
)
from serving.memory.layout import KINDS, Field, HybridLayout, layer_types, layout_for
from serving.memory.manager import MemoryManager
from serving.memory.policies import POLICIES

__all__ = [
    "KINDS",
    "POLICIES",
    "AllocationTooLargeError",
    "Arena",
    "DoubleFreeError",
    "Field",
    "HandleKindError",
    "HybridLayout",
    "MemoryManager",
    "MemoryManagerError",
    "OutOfMemoryError",
    "UnknownHandleError",
    "UnknownKindError",
    "UnknownRequestError",
    "layer_types",
    "layout_for",
    "view",
]
