"""Routed mixture-of-experts FFN: each token's ``k`` selected SwiGLU experts, weighted and summed.

For ``x: [M, H]``, routing weights ``w: [M, k]``, expert ids ``e: [M, k]`` and expert weights
``gate_proj, up_proj: [E, H, I]``, ``down_proj: [E, I, H]`` (input-major)::

    out[m] = sum_j w[m, j] * down_{e[m, j]}( silu(x[m] gate_{e[m, j]}) * (x[m] up_{e[m, j]}) )

Dropless and exact: every token-expert pair is computed, whatever the load on an expert
(no capacity factor, no token dropping); the cost scales with ``M * k``, not with ``E``. A
token may name the same expert twice (both pairs count). A pair whose expert id lies outside
``[0, E)`` adds nothing and costs no expert work on any path: expert parallelism hands a
device the pairs of other devices' experts that way.

``impl="xla"`` sorts the ``M * k`` pairs by expert (a stable argsort, so within an expert pairs
keep token order) and runs the three projections as grouped matmuls (``lax.ragged_dot``) over
the sorted rows, then scatter-adds the weighted rows into their tokens. ``impl="pallas"`` runs
the GPU kernels of :mod:`pallas_kernels.moe` (interpret mode off GPU), ``impl="auto"`` picks
them where :mod:`gdn_jax.pallas_routes` says so (XLA off GPU). ``impl="pallas_tpu"`` runs jax's
megablox grouped matmul (:mod:`pallas_kernels.tpu.moe`; TPU interpret mode off TPU), which
``"auto"`` does not take.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from gdn_jax._prep import as_arrays
from gdn_jax.dispatch import pallas_op, resolve_impl
from pallas_kernels.moe._common import sort_pairs
from pallas_kernels.moe.decode import SharedGLU


def _fail(arg: str, rule: str) -> None:
    raise ValueError(f"{arg}: {rule}")


def _check_float(name: str, a: jax.Array) -> None:
    if not jnp.issubdtype(a.dtype, jnp.floating):
        _fail(name, f"must be floating point, got {a.dtype}")


def check_routed_inputs(x, weights, experts, gate_proj, up_proj, down_proj) -> tuple[int, ...]:
    """Validates the shapes and dtypes of a :func:`routed_experts` call on the host (a
    ``ValueError`` naming the argument); returns ``(M, k, E, H, I)``. The expert ids' values
    (traced under jit) are not checked."""
    if x.ndim != 2:
        _fail("x", f"expected rank 2 [M, H], got shape {x.shape}")
    _check_float("x", x)
    m, h = x.shape
    if gate_proj.ndim != 3:
        _fail("gate_proj", f"expected rank 3 [E, H, I], got shape {gate_proj.shape}")
    e, h_g, i = gate_proj.shape
    if h_g != h:
        _fail("gate_proj", f"expected [E, H={h}, I], got shape {gate_proj.shape}")
    if e < 1 or i < 1:
        _fail("gate_proj", f"needs at least one expert and I >= 1, got shape {gate_proj.shape}")
    _check_float("gate_proj", gate_proj)
    if up_proj.shape != gate_proj.shape:
        _fail("up_proj", f"expected gate_proj's shape {gate_proj.shape}, got {up_proj.shape}")
    if down_proj.shape != (e, i, h):
        _fail("down_proj", f"expected [E, I, H] = {(e, i, h)}, got {down_proj.shape}")
    for name, a in (("up_proj", up_proj), ("down_proj", down_proj)):
        if a.dtype != gate_proj.dtype:
            _fail(name, f"must have gate_proj's dtype {gate_proj.dtype}, got {a.dtype}")
    if experts.ndim != 2 or experts.shape[0] != m:
        _fail("experts", f"expected [M={m}, k], got shape {experts.shape}")
    if not jnp.issubdtype(experts.dtype, jnp.integer):
        _fail("experts", f"must be an integer array of expert ids, got {experts.dtype}")
    k = experts.shape[1]
    if not 1 <= k <= e:
        _fail("experts", f"k = {k} experts per token must be in [1, E = {e}]")
    if weights.shape != experts.shape:
        _fail("weights", f"expected experts' shape [M, k] = {experts.shape}, got {weights.shape}")
    _check_float("weights", weights)
    return m, k, e, h, i


def routed_experts(
    x: Float[Array, "M H"],
    weights: Float[Array, "M k"],
    experts: Int[Array, "M k"],
    gate_proj: Float[Array, "E H I"],
    up_proj: Float[Array, "E H I"],
    down_proj: Float[Array, "E I H"],
    *,
    impl: str = "auto",
    shared=None,
) -> Float[Array, "M H"]:
    """``out[m] = sum_j weights[m, j] * expert_{experts[m, j]}(x[m])`` (module docstring).

    ``expert_e(v) = (silu(v gate_proj[e]) * (v up_proj[e])) down_proj[e]``. A pair whose id lies
    outside ``[0, E)`` is dropped (adds nothing). ``x`` is cast to the expert weights' dtype;
    the result ``[M, H]`` has the expert weights' dtype. ``impl``: ``"auto"``, ``"xla"``,
    ``"pallas"`` or ``"pallas_tpu"``.

    ``shared = (h_s [M, I_s], w_s [H, I_s])`` adds ``h_s w_s^T`` to every token (a shared
    expert's down projection, ``w_s`` in a linear layer's ``[out, in]`` layout, ``h_s`` its
    gated activation): on the GPU's decode kernel it runs in the routed experts' launch
    (:mod:`pallas_kernels.moe.decode`), elsewhere as one matmul added after them, in the
    weights' dtype. ``shared =`` :class:`SharedGLU` ``(act, w_s, gate_col, up_col, logit_col)``
    gives ``h_s`` by its pre-activations, columns of ``act [M, C]`` (a fused projection's
    output): ``h_s = sigmoid(logit) * silu(gate) * up``, formed inside the decode kernel (no
    launch of its own) or by XLA elsewhere.
    """
    x, weights, experts, gate_proj, up_proj, down_proj = as_arrays(
        x, weights, experts, gate_proj, up_proj, down_proj
    )
    m, _, _, h, _ = check_routed_inputs(x, weights, experts, gate_proj, up_proj, down_proj)
    if shared is not None:
        from pallas_kernels.moe.decode import check_shared

        shared = tuple(as_arrays(*shared)) if isinstance(shared, tuple | list) else shared
        check_shared(shared, m, h)
        if isinstance(shared, SharedGLU):
            shared = SharedGLU(
                *as_arrays(shared.act, shared.w_s),
                gate_col=shared.gate_col,
                up_col=shared.up_col,
                logit_col=shared.logit_col,
            )
    args = (x, weights, experts.astype(jnp.int32), gate_proj, up_proj, down_proj)
    path = resolve_impl(impl, "routed_experts", *args)
    if m == 0:
        return jnp.zeros((0, h), gate_proj.dtype)
    if path == "pallas":
        return pallas_op("routed_experts", path)(*args, shared=shared)
    out = pallas_op("routed_experts", path)(*args) if path != "xla" else _routed_xla(*args)
    return out if shared is None else out + shared_term(*shared_pair(shared), out.dtype)


def shared_pair(shared) -> tuple[jax.Array, jax.Array]:
    """``(h_s, w_s)`` of a ``shared`` argument of :func:`routed_experts` (a
    :class:`SharedGLU`'s activation computed by XLA)."""
    if isinstance(shared, SharedGLU):
        return shared.activation(), shared.w_s
    return tuple(shared)


def shared_term(h_s: jax.Array, w_s: jax.Array, dtype) -> jax.Array:
    """``h_s w_s^T`` in ``dtype`` (``h_s`` cast to ``w_s``'s dtype, f32 accumulation): the
    ``shared`` term of :func:`routed_experts` off the decode kernel."""
    y = jnp.einsum(
        "mi,hi->mh",
        h_s.astype(w_s.dtype),
        w_s,
        precision=_precision(w_s.dtype),
        preferred_element_type=jnp.float32,
    )
    return y.astype(dtype)


def _precision(dtype) -> jax.lax.Precision:
    """HIGHEST for f32 expert weights (a TF32 default on GPU would lose f32 parity), else
    DEFAULT; the same rule as the model's dense layers."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


@jax.jit
def _routed_xla(x, weights, experts, gate_proj, up_proj, down_proj):
    """The XLA path: pairs sorted by expert, three ``lax.ragged_dot`` over the sorted rows (each
    rounded to the weights' dtype), the routing weight applied to the down projection's rows in
    that dtype, and a scatter-add of the rows into their tokens."""
    m, k = experts.shape
    order, sizes, valid = sort_pairs(experts, gate_proj.shape[0])
    token = order // k
    prec = _precision(gate_proj.dtype)
    xs = x[token].astype(gate_proj.dtype)
    h = jax.nn.silu(jax.lax.ragged_dot(xs, gate_proj, sizes, precision=prec))
    h = h * jax.lax.ragged_dot(xs, up_proj, sizes, precision=prec)
    y = jax.lax.ragged_dot(h, down_proj, sizes, precision=prec)
    y = jnp.where(valid[:, None], y * weights.reshape(-1)[order][:, None].astype(y.dtype), 0)
    return jnp.zeros((m, x.shape[-1]), y.dtype).at[token].add(y)


def route_topk(
    logits: Float[Array, "M E"],
    k: int,
    *,
    normalize: bool = True,
    dtype=jnp.float32,
    impl: str = "auto",
    num_experts: int | None = None,
) -> tuple[Float[Array, "M k"], Int[Array, "M k"]]:
    """The router's choice: ``(weights [M, k] in dtype, expert ids int32 [M, k])``, the ``k``
    largest logits of each row (ties to the lower expert id, as ``lax.top_k``) weighted by
    ``softmax(logits)``, renormalised over the ``k`` when ``normalize`` (then the softmax of
    the ``k`` selected logits: the full softmax over the experts is never formed). The weights
    are formed in f32 and stored in ``dtype``.

    ``impl="pallas"``: one GPU kernel (:mod:`pallas_kernels.moe.route`; interpret mode off
    GPU) where XLA runs a sort, a slice and a softmax; ``"auto"``
    takes it on a GPU where it fits.

    ``num_experts``: the logits are the first ``E`` columns of a wider ``[M, >= E]`` array
    (a fused projection's output: the kernel reads them in place, no copy of the slice)."""
    return _dispatch_route("route_topk", _route_xla, logits, k, normalize, dtype, impl, num_experts)


def _dispatch_route(op: str, xla, logits, k, normalize, dtype, impl, num_experts):
    """A router call (``op``: ``"route_topk"`` or ``"balanced_route"``) on its Pallas kernel
    where ``impl`` resolves to it, else ``xla(logits[:, :E], k, normalize, dtype)``."""
    (logits,) = as_arrays(logits)
    e = _check_route_args(logits, k, num_experts)
    path = resolve_impl(impl, op, logits, k)
    if path != "xla":
        return pallas_op(op, path)(
            logits, k, normalize=normalize, dtype=dtype, num_experts=num_experts
        )
    return xla(logits[:, :e], k, normalize, jnp.dtype(dtype))


def _check_route_args(logits, k, num_experts) -> int:
    """``E`` of a :func:`route_topk` / :func:`balanced_route` call; ``ValueError`` naming the
    argument for logits that are not ``[M, >= E]``, ``num_experts`` past their columns or ``k``
    outside ``[1, E]``."""
    if logits.ndim != 2:
        raise ValueError(f"logits: expected [M, E], got shape {logits.shape}")
    e = logits.shape[1] if num_experts is None else num_experts
    if not isinstance(e, int) or not 1 <= e <= logits.shape[1]:
        raise ValueError(
            f"num_experts: must be an int in [1, {logits.shape[1]}] (logits' columns), got {e!r}"
        )
    if not isinstance(k, int) or not 1 <= k <= e:
        raise ValueError(f"k: must be an int in [1, E = {e}], got {k!r}")
    return e


def balanced_route(
    logits: Float[Array, "M E"],
    k: int,
    *,
    normalize: bool = True,
    dtype=jnp.float32,
    impl: str = "auto",
    num_experts: int | None = None,
) -> tuple[Float[Array, "M k"], Int[Array, "M k"]]:
    """A benchmark's stand-in for :func:`route_topk` that spreads rows over the experts as a
    trained router does, whatever the logits: row ``m`` takes the ``k`` experts
    ``r, r + E/k, r + 2E/k, ...`` of one residue class ``r = hash(m) mod E/k`` (murmur3's
    finaliser of the row index), so a row's ``k`` experts are distinct and rows draw
    their classes independently, touching ``E (1 - (1 - k/E)^M)`` experts in expectation, as
    uniform routing would. The weights are the router's own, formed from ``logits`` at those
    ids as :func:`route_topk` forms them (the softmax of the ``k`` when ``normalize``, else
    their probabilities under the softmax over all ``E``). With ``E`` not a multiple of ``k``
    the classes are modulo ``floor(E / k)`` and the last ``E mod k`` experts are never taken.

    Random weights route most tokens to a few experts once the residual stream is dominated
    by context averages, so a benchmark with them reads fewer expert bytes than a served
    model; this keeps the router's matmul and the expert kernels' work realistic. The experts
    follow a row's index in the call, not its token: a model routed this way computes
    different outputs for one sequence in different batch layouts, so it serves timing, not
    output comparisons.

    ``impl="pallas"``: one GPU kernel (:mod:`pallas_kernels.moe.route` with ``balanced``;
    interpret mode off GPU) where XLA runs a gather and a softmax fusion; ``"auto"`` takes it
    on a GPU where it fits. ``num_experts``: the logits are the first ``E`` columns of a wider
    ``[M, >= E]`` array, as in :func:`route_topk`."""
    return _dispatch_route(
        "balanced_route", _balanced_xla, logits, k, normalize, dtype, impl, num_experts
    )


def _balanced_xla(logits, k: int, normalize: bool, dtype):
    m, e = logits.shape
    classes = e // k
    h = jnp.arange(1, m + 1, dtype=jnp.uint32)  # murmur3's finaliser of the row index
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    r = (h ^ (h >> 16)) % jnp.uint32(classes)
    ids = (r[:, None] + classes * jnp.arange(k, dtype=jnp.uint32)[None, :]).astype(jnp.int32)
    lg = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(lg, ids, axis=1)
    if normalize:
        w = jax.nn.softmax(picked, axis=-1)
    else:
        w = jnp.exp(picked - jax.nn.logsumexp(lg, axis=-1, keepdims=True))
    return w.astype(dtype), ids


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _route_xla(logits, k: int, normalize: bool, dtype):
    logits = logits.astype(jnp.float32)
    if normalize:
        top_l, top_i = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top_l, axis=-1).astype(dtype), top_i.astype(jnp.int32)
    top_p, top_i = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    return top_p.astype(dtype), top_i.astype(jnp.int32)
