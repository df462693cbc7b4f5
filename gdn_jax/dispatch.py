"""Chooses between the XLA path and the Pallas kernels (``impl="auto" | "xla" | "pallas" |
"pallas_tpu"``).

Pallas entry points are registered by name: the GPU (Triton) kernels in :data:`PALLAS_OPS` by
``gdn_jax.pallas_routes``, the TPU (Mosaic) kernels in :data:`TPU_OPS` by
``gdn_jax.pallas_tpu_routes``; each module (when present) adapts ``pallas_kernels`` to the op
signatures and fills its table on import. ``"pallas"`` uses a registered GPU kernel and
``"pallas_tpu"`` a registered TPU kernel, or raise (the kernel raises ``ValueError`` for shapes
it cannot take; off their device both run in interpret mode). ``"auto"`` picks the GPU kernels
on a GPU only for the ops in :data:`AUTO_PALLAS` (those measured faster than the XLA path on the
H200, benchmarks/README.md) and the TPU kernels on a TPU for the ops in :data:`AUTO_TPU`, each
only when that op's predicate accepts the call's arguments, XLA otherwise.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import jax

IMPLS = ("auto", "xla", "pallas", "pallas_tpu")
PALLAS_OPS: dict[str, Callable] = {}
AUTO_PALLAS: dict[str, Callable[..., bool]] = {}
TPU_OPS: dict[str, Callable] = {}
AUTO_TPU: dict[str, Callable[..., bool]] = {}
ROUTE_MODULES = ("gdn_jax.pallas_routes", "gdn_jax.pallas_tpu_routes")
_loaded = False


def _load_routes() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for name in ROUTE_MODULES:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                if e.name not in (name, "pallas_kernels"):
                    raise


def _table(impl: str) -> tuple[dict[str, Callable], dict[str, Callable[..., bool]]]:
    return (TPU_OPS, AUTO_TPU) if impl == "pallas_tpu" else (PALLAS_OPS, AUTO_PALLAS)


def resolve_impl(impl: str, op: str, *args) -> str:
    """Returns ``"xla"``, ``"pallas"`` or ``"pallas_tpu"`` for ``op`` called on ``args`` (for
    ``"auto"``'s eligibility predicate); raises ``ValueError`` for unknown names. ``"auto"``
    stays on XLA off GPU and TPU backends."""
    if impl not in IMPLS:
        raise ValueError(f"impl: must be one of {IMPLS}, got {impl!r}")
    if impl == "xla":
        return "xla"
    if impl == "auto":
        backend = jax.default_backend()
        if backend not in ("gpu", "tpu"):
            return "xla"
        kernel = "pallas" if backend == "gpu" else "pallas_tpu"
        _load_routes()
        ops, auto = _table(kernel)
        eligible = op in auto and op in ops and auto[op](*args)
        return kernel if eligible else "xla"
    _load_routes()
    if op not in _table(impl)[0]:
        kind = "TPU Pallas" if impl == "pallas_tpu" else "Pallas"
        raise ValueError(f"impl: no {kind} kernel is available for {op}; use 'xla' or 'auto'")
    return impl


def pallas_op(op: str, impl: str = "pallas") -> Callable:
    """The registered kernel of ``op`` for ``impl`` (``"pallas"``: GPU, ``"pallas_tpu"``:
    TPU)."""
    _load_routes()
    return _table(impl)[0][op]
