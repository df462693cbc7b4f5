"""Chooses between the XLA path and the Pallas kernels (``impl="auto" | "xla" | "pallas"``).

Pallas entry points are registered by name in :data:`PALLAS_OPS`; the module
``gdn_jax.pallas_routes`` (when present) adapts ``pallas_kernels`` to the op signatures and fills
the table on import. ``"pallas"`` uses a registered kernel or raises (the kernel raises
``ValueError`` for shapes it cannot take); ``"auto"`` picks Pallas on a GPU only for the ops in
:data:`AUTO_PALLAS` (those measured faster than the XLA path on the H200,
benchmarks/README.md) and only when that op's predicate accepts the call's arguments, XLA
otherwise.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import jax

IMPLS = ("auto", "xla", "pallas")
PALLAS_OPS: dict[str, Callable] = {}
AUTO_PALLAS: dict[str, Callable[..., bool]] = {}
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


def resolve_impl(impl: str, op: str, *args) -> str:
    """Returns ``"xla"`` or ``"pallas"`` for ``op`` called on ``args`` (for ``"auto"``'s
    eligibility predicate); raises ``ValueError`` for unknown names. ``"auto"`` stays on XLA off
    GPU backends: the registered kernels are GPU (Triton) kernels."""
    if impl not in IMPLS:
        raise ValueError(f"impl: must be one of {IMPLS}, got {impl!r}")
    if impl == "xla" or (impl == "auto" and jax.default_backend() != "gpu"):
        return "xla"
    _load_routes()
    if impl == "pallas":
        if op not in PALLAS_OPS:
            raise ValueError(f"impl: no Pallas kernel is available for {op}; use 'xla' or 'auto'")
        return "pallas"
    eligible = op in AUTO_PALLAS and op in PALLAS_OPS and AUTO_PALLAS[op](*args)
    return "pallas" if eligible else "xla"


def pallas_op(op: str) -> Callable:
    """The registered Pallas implementation of ``op``."""
    _load_routes()
    return PALLAS_OPS[op]
