"""Fixtures shared by the Pallas kernel tests."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture
def h200(monkeypatch):
    """Lowers Pallas Triton kernels for an H200 (compute capability 9.0) on this machine;
    yields a function returning ``(name, Triton IR)`` of each kernel a call lowers to."""
    from jax._src.pallas.triton import gpu_info, lowering, pallas_call_registration

    info = gpu_info.GpuInfo(
        gpu_version=gpu_info.GpuVersion.H200, arch_name="9.0", compute_capability=90
    )
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: info)
    orig = lowering.lower_jaxpr_to_triton_module

    def lower(fn, *args):
        out = []

        def capture(jaxpr, *a, **kw):
            module = orig(jaxpr, *a, **kw)
            ir = module.module.operation.get_asm(enable_debug_info=False)
            out.append((jaxpr.debug_info.func_name, ir))
            return module

        monkeypatch.setattr(
            pallas_call_registration.lowering, "lower_jaxpr_to_triton_module", capture
        )
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        return out

    return lower
