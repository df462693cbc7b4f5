"""Sparse MoE block: softmax router, top-k routed SwiGLU experts, sigmoid-gated shared expert.

``p = softmax(x Wr^T)`` (f32), the top-k of ``p`` (renormalised to sum 1 when
``norm_topk_prob``) weight the selected experts; the shared expert is added as
``sigmoid(x w_g) * shared(x)``. The routed experts are :func:`gdn_jax.moe.routed_experts`
(dropless; compute scales with ``k``, not with the expert count): grouped matmuls over the
token-expert pairs sorted by expert on the XLA path, the Pallas kernels of
:mod:`pallas_kernels.moe` where ``impl`` selects them. Expert weights are stored input-major:
``gate_proj, up_proj: [E, H, I]``, ``down_proj: [E, I, H]``.
"""

from __future__ import annotations

import jax
from flax import nnx

from gdn_jax.models.linear import Linear, normal_init
from gdn_jax.models.mlp import MLP
from gdn_jax.moe import SharedGLU, balanced_route, route_topk, routed_experts


class SparseMoE(nnx.Module):
    def __init__(
        self,
        hidden: int,
        *,
        num_experts: int,
        top_k: int,
        intermediate: int,
        shared_intermediate: int,
        norm_topk_prob: bool,
        dtype,
        rngs: nnx.Rngs,
        impl: str = "auto",
    ):
        self.gate = Linear(hidden, num_experts, dtype=dtype, rngs=rngs)  # the router
        self.gate_proj = nnx.Param(normal_init(rngs, (num_experts, hidden, intermediate), dtype))
        self.up_proj = nnx.Param(normal_init(rngs, (num_experts, hidden, intermediate), dtype))
        self.down_proj = nnx.Param(normal_init(rngs, (num_experts, intermediate, hidden), dtype))
        self.shared_expert = MLP(hidden, shared_intermediate, dtype=dtype, rngs=rngs)
        self.shared_expert_gate = Linear(hidden, 1, dtype=dtype, rngs=rngs)
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.impl = impl  # routed_experts' impl: "auto" | "xla" | "pallas" | "pallas_tpu"
        # "model": the router's top-k; "balanced": gdn_jax.moe.balanced_route (benchmarks of
        # random weights: set_moe_routing)
        self.routing = "model"
        self.parallel = None  # tensor / expert parallel: gdn_jax.sharding.MoEParallel
        # the router, the shared expert's gate and up projections and its gate as one matmul
        # (gdn_jax.models.fused)
        self.fused_in = nnx.data(None)

    def route(self, x: jax.Array, raw: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """``(weights [M, k] in x's dtype, expert ids int32 [M, k])`` for ``x: [M, H]``
        (:func:`gdn_jax.moe.route_topk` on the router's logits ``raw``, default ``gate(x)``;
        ``raw`` may be wider, the router's ``E`` columns first, as a fused projection's output,
        in ``impl``: with ``norm_topk_prob`` the softmax of the top-k logits, never the full
        softmax; :func:`gdn_jax.moe.balanced_route` where ``routing`` is ``"balanced"``)."""
        if raw is None:
            raw = self.gate(x) if self.fused_in is None else self.fused_in.matmul(x)
        e = self.num_experts  # ``raw`` may be the fused projection: the router's columns first
        route = balanced_route if self.routing == "balanced" else route_topk
        return route(
            raw,
            self.top_k,
            normalize=self.norm_topk_prob,
            dtype=raw.dtype,
            impl="auto" if self.impl == "pallas_tpu" else self.impl,  # no TPU router kernel
            num_experts=e,
        )

    def routed(
        self, x: jax.Array, weights: jax.Array, experts: jax.Array, shared=None
    ) -> jax.Array:
        """Sum over the ``k`` selected experts of ``weight * expert(x)``; ``x: [M, H]``
        (:func:`gdn_jax.moe.routed_experts`, in the expert weights' dtype), plus ``shared``'s
        term where given (a pair ``(h_s, w_s)`` or a :class:`gdn_jax.moe.SharedGLU`)."""
        gw, uw, dw = self.gate_proj[...], self.up_proj[...], self.down_proj[...]
        return routed_experts(x, weights, experts, gw, uw, dw, impl=self.impl, shared=shared)

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.fused_in is not None:
            proj = self.fused_in.matmul(x2)
            weights, experts = self.route(x2, proj)  # the router reads its columns in place
            # the shared expert: its gated activation from its columns of the projection (in
            # place) and its down projection run with the routed experts (one kernel at
            # decode: pallas_kernels.moe.decode)
            cols = self.fused_in.columns  # [router | gate | up | shared gate] offsets
            shared = SharedGLU(
                proj,
                self.shared_expert.down_proj.weight[...],
                gate_col=cols[1],
                up_col=cols[2],
                logit_col=cols[3],
            )
            out = self.routed(x2, weights, experts, shared=shared)
            return out.astype(x.dtype).reshape(shape)
        weights, experts = self.route(x2)
        if self.parallel is not None:  # routed and shared expert over devices, one psum
            return self.parallel(self, x2, weights, experts).astype(x.dtype).reshape(shape)
        out = self.routed(x2, weights, experts)
        shared = jax.nn.sigmoid(self.shared_expert_gate(x2)) * self.shared_expert(x2)
        return (out + shared).astype(x.dtype).reshape(shape)
