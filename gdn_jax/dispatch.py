"""Chooses between the XLA path and the Pallas kernels (``impl="auto" | "xla" | "pallas"``).

Pallas entry points are registered by name in :data:`PALLAS_OPS`; the module
``gdn_jax.pallas_routes`` (when present) adapts ``pallas_kernels`` to the op signatures and fills
the table on import. ``"auto"`` picks Pallas on GPU/TPU when the op has a kernel, XLA otherwise.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import jax

IMPLS = ("auto", "xla", "pallas")
PALLAS_OPS: dict[str, Callable] = {}
_loaded = False


def _load_routes() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        try:
            importlib.import_module("gdn_jax.pallas_routes")
        except ModuleNotFoundError as e:
            if e.name not in ("gdn_jax.pallas_routes", "pallas_kernels"):
                raise


def resolve_impl(impl: str, op: str) -> str:
    """Returns ``"xla"`` or ``"pallas"`` for ``op``; raises ``ValueError`` for unknown names."""
    if impl not in IMPLS:
        raise ValueError(f"impl: must be one of {IMPLS}, got {impl!r}")
    if impl == "xla":
        return "xla"
    _load_routes()
    if impl == "pallas":
        if op not in PALLAS_OPS:
            raise ValueError(f"impl: no Pallas kernel is available for {op}; use 'xla' or 'auto'")
        return "pallas"
    on_accel = jax.default_backend() in ("gpu", "cuda", "rocm", "tpu")
    return "pallas" if on_accel and op in PALLAS_OPS else "xla"


def pallas_op(op: str) -> Callable:
    """The registered Pallas implementation of ``op``."""
    _load_routes()
    return PALLAS_OPS[op]
