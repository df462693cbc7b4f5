"""The pre-launch shared-memory check of the Triton kernels' GPU builds (``pallas_kernels._fit``).

A GPU is not available here: the tests stand in for XLA's compile, which on an H200 refuses a
build over 232448 bytes per block with the message parsed below (the deviceless compile of
``benchmarks.compile_report --kernel moe_decode`` shows the real requests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.moe as moe
from pallas_kernels import _fit as fit
from pallas_kernels.chunk import kernel as chunk_kernel

LIMIT_ERROR = (
    "RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested {}, available: 232448"
)


class _Lowered:
    def __init__(self, text: str):
        self.text = text

    def as_text(self) -> str:
        return self.text


class _Builds(list):
    def __init__(self):
        super().__init__()
        self.need: dict[str, int] = {}


@pytest.fixture
def fake_gpu(monkeypatch):
    """Checks as on a GPU: each kernel build's 'lowered module' is its name and argument
    shapes; ``need(name)`` gives the bytes its build asks for, refused above 232448. Yields
    the list of compiled builds."""
    compiled = _Builds()
    need = compiled.need

    def lower(call, avals):
        jaxpr = jax.make_jaxpr(call)(*avals)
        return _Lowered(f"{getattr(call, 'name', '')} {jaxpr}")

    def compile_(lowered):
        compiled.append(lowered.text)
        for name, nbytes in need.items():
            if name in lowered.text and nbytes > 232448:
                raise RuntimeError(LIMIT_ERROR.format(nbytes))

    monkeypatch.setattr(fit, "TARGET", jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    monkeypatch.setattr(fit, "_lower", lower)
    monkeypatch.setattr(fit, "_compile", compile_)
    monkeypatch.setattr(fit, "_verdicts", {})
    yield compiled


class _Call:
    """A stand-in kernel call whose repr names it (the fake lowering keys on it)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return self.name

    def __call__(self, *args):
        return args[0]


def test_off_a_gpu_nothing_compiles(monkeypatch):
    """On this CPU (no TARGET) the check compiles nothing."""
    monkeypatch.setattr(fit, "_compile", lambda lowered: pytest.fail("compiled off a GPU"))
    fit.check_fits(_Call("k"), (jnp.ones(3),), name="k", knobs=None)


def test_refused_build_raises_value_error_naming_blocks_and_bytes(fake_gpu):
    fake_gpu.need["big"] = 430080
    blocks = moe.DecodeBlocks(block_hs=128)
    with pytest.raises(ValueError, match=r"^blocks: DecodeBlocks\(.*block_hs=128") as e:
        fit.check_fits(_Call("big"), (jnp.ones(3),), name="moe_decode", knobs=blocks)
    msg = str(e.value)
    assert "moe_decode kernel" in msg and "430080 bytes" in msg and "232448" in msg
    # a build that fits passes
    fit.check_fits(_Call("small"), (jnp.ones(3),), name="k", knobs=blocks)


def test_each_build_compiles_once(fake_gpu):
    fake_gpu.need["big"] = 300000
    args = (jnp.ones((2, 3)),)
    for _ in range(3):
        fit.check_fits(_Call("small"), args, name="k", knobs=None)
        with pytest.raises(ValueError):
            fit.check_fits(_Call("big"), args, name="k", knobs=None)
    assert len(fake_gpu) == 2
    fit.check_fits(_Call("small"), (jnp.ones((4, 3)),), name="k", knobs=None)  # new shape
    assert len(fake_gpu) == 3


def test_other_failures_of_the_check_pass(fake_gpu, monkeypatch):
    """A compile or lowering that fails for another reason leaves it to the program's own
    compile (no error from the check)."""

    def fail(*a):
        raise RuntimeError("INTERNAL: something else")

    monkeypatch.setattr(fit, "_compile", fail)
    fit.check_fits(_Call("k"), (jnp.ones(3),), name="k", knobs=None)
    monkeypatch.setattr(fit, "_lower", fail)
    fit.check_fits(_Call("j"), (jnp.ones(3),), name="j", knobs=None)


def _moe_args(m=1, e=4, h=32, i=16, k=2, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.normal(size=(m, h)), dtype),
        jnp.asarray(rng.random((m, k)), dtype),
        jnp.asarray(rng.integers(0, e, (m, k)), jnp.int32),
        jnp.asarray(rng.normal(size=(e, h, i)), dtype),
        jnp.asarray(rng.normal(size=(e, h, i)), dtype),
        jnp.asarray(rng.normal(size=(e, i, h)), dtype),
    )


@pytest.mark.parametrize(
    "fn, kernel",
    [
        (moe.routed_experts_decode, "moe_decode"),
        (moe.routed_experts_small_m, "moe_small_m_down"),
        (moe.routed_experts_grouped, "moe_grouped_gate_up"),
    ],
)
def test_moe_kernels_raise_before_launching(fake_gpu, fn, kernel):
    """An MoE op whose build is refused raises while it is traced, before any launch, and
    names its knobs; the same op in interpret mode runs (and checks nothing)."""
    fake_gpu.need[kernel] = 401408
    args = _moe_args()
    blocks = {
        "moe_decode": moe.DecodeBlocks(block_i=16, block_k=16, block_h=16, block_hs=16),
        "moe_small_m_down": moe.SmallMBlocks(block_i=16, block_h=16, block_kh=16, block_ki=16),
        "moe_grouped_gate_up": moe.GroupedBlocks(block_i=16, block_h=16, block_kh=16, block_ki=16),
    }[kernel]
    with pytest.raises(ValueError, match=f"^blocks: {type(blocks).__name__}.*{kernel} kernel"):
        jax.jit(lambda *a: fn(*a, blocks=blocks)).trace(*args)
    n = len(fake_gpu)
    out = fn(*args, blocks=blocks, interpret=True)
    assert out.shape == args[0].shape and bool(jnp.all(jnp.isfinite(out)))
    assert len(fake_gpu) == n


def test_chunked_prefill_kernels_are_checked(fake_gpu):
    fake_gpu.need["gdn_chunk_state"] = 262144
    rng = np.random.default_rng(1)
    t, hk, hv, d = 32, 1, 2, 16
    q, k = (jnp.asarray(rng.normal(size=(1, t, hk, d)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(1, t, hv, d)), jnp.float32)
    g = jnp.asarray(-rng.random((1, t, hv)), jnp.float32)
    beta = jnp.asarray(rng.random((1, t, hv)), jnp.float32)
    with pytest.raises(ValueError, match=r"^blocks: ChunkBlocks\(.*gdn_chunk_state kernel"):
        jax.jit(chunk_kernel.chunk_gated_delta_rule).trace(q, k, v, g, beta)
