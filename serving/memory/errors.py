"""Errors raised by the memory manager.

Every error names the argument at fault. Input errors subclass ``ValueError`` or ``KeyError``
so callers can catch them generically; running out of memory is a ``RuntimeError`` because the
same call may succeed later, after other requests free memory.
"""

from __future__ import annotations


class MemoryManagerError(Exception):
    """Base class of all memory-manager errors."""

    def __str__(self) -> str:
        # KeyError's default str() is the repr of its argument; keep messages readable.
        return str(self.args[0]) if self.args else ""


class OutOfMemoryError(MemoryManagerError, RuntimeError):
    """The allocation does not fit now, even after migration; nothing was changed."""


class AllocationTooLargeError(MemoryManagerError, ValueError):
    """The allocation could not fit even in an empty arena under this policy."""


class UnknownKindError(MemoryManagerError, ValueError):
    """``kind`` is not one of the layout's kinds."""


class HandleKindError(MemoryManagerError, ValueError):
    """The handle is live but belongs to another kind than the one given."""


class UnknownHandleError(MemoryManagerError, KeyError):
    """The handle was never allocated, or has been freed."""


class DoubleFreeError(MemoryManagerError, KeyError):
    """The handle (or every handle of the request) was already freed."""


class UnknownRequestError(MemoryManagerError, KeyError):
    """The request holds no live allocation."""
