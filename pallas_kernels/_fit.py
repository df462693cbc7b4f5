"""A Triton-lowered kernel's GPU build checked against the device's shared memory before launch.

The shared memory a Triton kernel asks for per block follows from its tiles, its pipelined
loads (``num_stages``) and the compiler's layout conversions, so no closed formula gives it.
XLA compiles the kernel with the program around it and refuses a build over the device's
limit (``RESOURCE_EXHAUSTED: Shared memory size limit exceeded``) only then, naming neither
the kernel nor the knob. :func:`pallas_call` wraps ``pl.pallas_call``: on a GPU, before the
kernel joins the caller's program, it compiles the kernel alone on its arguments' shapes
(once per distinct kernel build, keyed by the lowered module) and raises ``ValueError``
naming the knobs and both byte counts when the build does not fit.

:data:`TARGET` (a ``jax.sharding.Sharding``) checks against that device instead of the
default one, e.g. a deviceless H200 target (``benchmarks.compile_report``).
"""

from __future__ import annotations

import hashlib
import re

import jax
from jax.experimental import pallas as pl

_LIMIT = re.compile(r"[Ss]hared memory size limit exceeded: requested (\d+)(?:, available: (\d+))?")

# the device to compile the check for; None: the default backend's, checked only on a GPU
TARGET: jax.sharding.Sharding | None = None

_verdicts: dict[str, tuple[int, int | None] | None] = {}


def pallas_call(kernel, *, knobs, interpret=False, **kwargs):
    """``pl.pallas_call(kernel, interpret=interpret, **kwargs)`` whose GPU build is checked
    by :func:`check_fits` when called (not in interpret mode); ``knobs``: the caller's knob
    dataclass, named in the error."""
    call = pl.pallas_call(kernel, interpret=interpret, **kwargs)
    if interpret is not False:
        return call

    def run(*args):
        check_fits(call, args, name=kwargs.get("name") or "pallas", knobs=knobs)
        return call(*args)

    return run


def _lower(call, avals):
    return jax.jit(call).trace(*avals).lower()


def _compile(lowered) -> None:
    lowered.compile()


def check_fits(call, args, *, name: str, knobs) -> None:
    """``ValueError`` naming ``blocks`` when ``call``'s GPU build on ``args``' shapes asks for
    more shared memory per block than the device gives; nothing off a GPU (unless
    :data:`TARGET` is set) or when it fits. Each distinct build compiles once a process. A
    check that fails for another reason (say, inside a multi-device trace) passes: the
    program's own compile reports what is wrong."""
    if TARGET is None and jax.devices()[0].platform != "gpu":
        return
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=TARGET) for a in args]
    try:
        lowered = _lower(call, avals)
        key = hashlib.sha1(lowered.as_text().encode()).hexdigest()
    except Exception:
        return
    if key not in _verdicts:
        try:
            _compile(lowered)
            _verdicts[key] = None
        except Exception as e:  # XLA's limit error is a JaxRuntimeError
            m = _LIMIT.search(str(e))
            need = m and (int(m.group(1)), int(m.group(2)) if m.group(2) else None)
            _verdicts[key] = need or None
    verdict = _verdicts[key]
    if verdict is not None:
        need, have = verdict
        limit = f"the {have} this GPU gives" if have is not None else "this GPU's limit"
        raise ValueError(
            f"blocks: {knobs!r} makes the {name} kernel's GPU build ask for {need} bytes of "
            f"shared memory per block, over {limit}; lower num_stages or the block sizes"
        )
