"""The Gated DeltaNet token mixer of Qwen3-Next / Qwen3.5 (docs/design.md).

Per token: ``[q | k | v] = conv(in_proj_qkv(x))`` (depthwise causal conv, SiLU),
``z = in_proj_z(x)``, ``beta = sigmoid(in_proj_b(x))``,
``g = -exp(A_log) softplus(in_proj_a(x) + dt_bias)``; the gated delta rule with q/k l2norm; then
``out_proj(gated_rmsnorm(o, z))`` per value head. Qwen3-Next's fused ``in_proj_qkvz`` /
``in_proj_ba`` (grouped per key head) are split into this layout when loading.

Caches: ``conv_state [B, W-1, C]`` (the last pre-conv inputs, model dtype) and the recurrent state
``[B, Hv, K, V]`` (f32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gdn_jax import (
    TreeCache,
    causal_conv1d,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    snapshot_tree_verify,
    tree_causal_conv1d,
    tree_verify,
)
from gdn_jax.models.config import ModelConfig
from gdn_jax.models.linear import Linear, normal_init
from gdn_jax.models.norm import GatedRMSNorm


def conv_state_after(conv_state: jax.Array, x: jax.Array, num_tokens: jax.Array) -> jax.Array:
    """The last ``W-1`` inputs of ``concat(conv_state, x[b, :num_tokens[b]])``: ``[B, W-1, C]``."""
    wm1 = conv_state.shape[1]
    full = jnp.concatenate([conv_state, x.astype(conv_state.dtype)], axis=1)
    idx = num_tokens.astype(jnp.int32)[:, None] + jnp.arange(wm1)[None, :]
    return jnp.take_along_axis(full, idx[:, :, None], axis=1)


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, hv = cfg.hidden_size, cfg.linear_num_value_heads
        self.in_proj_qkv = Linear(h, cfg.conv_dim, dtype=dtype, rngs=rngs)
        self.in_proj_z = Linear(h, cfg.linear_value_dim, dtype=dtype, rngs=rngs)
        self.in_proj_b = Linear(h, hv, dtype=dtype, rngs=rngs)
        self.in_proj_a = Linear(h, hv, dtype=dtype, rngs=rngs)
        self.conv_weight = nnx.Param(
            normal_init(rngs, (cfg.conv_dim, cfg.linear_conv_kernel_dim), dtype, std=0.2)
        )
        self.dt_bias = nnx.Param(jnp.ones((hv,), jnp.float32))
        a = jax.random.uniform(rngs.params(), (hv,), jnp.float32, 1.0, 16.0)
        self.A_log = nnx.Param(jnp.log(a))
        self.norm = GatedRMSNorm(cfg.linear_value_head_dim, eps=cfg.rms_norm_eps, dtype=dtype)
        self.out_proj = Linear(cfg.linear_value_dim, h, dtype=dtype, rngs=rngs)
        self.fused_in = nnx.data(None)  # in_proj_{qkv,z,b,a} as one matmul (gdn_jax.models.fused)
        self.cfg = cfg
        self.impl = "auto"  # chunk_gated_delta_rule's and tree_verify's impl (set_kernel_impl)
        # [q | k | v] blocks of the channels: 1, or the tensor-parallel size, whose device
        # blocks are each [q_d | k_d | v_d] (gdn_jax.sharding.qkv_rows)
        self.qkv_groups = 1

    def in_projections(self, x: jax.Array):
        """``(qkv [B, T, C] pre-conv, z [B, T, Hv * V], a, b f32 [B, T, Hv])``: the four input
        projections, as one matmul when fused (:func:`gdn_jax.models.fused.fuse_projections`)."""
        if self.fused_in is not None:
            qkv, z, b, a = self.fused_in(x)
        else:
            qkv, z = self.in_proj_qkv(x), self.in_proj_z(x)
            b, a = self.in_proj_b(x), self.in_proj_a(x)
        return qkv, z, a.astype(jnp.float32), b.astype(jnp.float32)

    def gate_inputs(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The gates' raw projections ``(a, b)``, f32 ``[B, T, Hv]``: ``g = -exp(A_log)
        softplus(a + dt_bias)``, ``beta = sigmoid(b)``."""
        return self.in_projections(x)[2:]

    def takes_conv(self, rule) -> bool:
        """Whether ``rule`` runs this layer's conv on its conv state itself (its ``conv`` form,
        taken when the channels are one ``[q | k | v]`` block): :meth:`__call__`."""
        return getattr(rule, "conv", None) is not None and self.qkv_groups == 1

    def project(self, x: jax.Array, raw: bool = False):
        """``(qkv [B, T, C] pre-conv, z [B, T, Hv, V], g f32 [B, T, Hv], beta f32 [B, T, Hv])``;
        with ``raw`` also the gates' raw projections ``(a, b)`` (:meth:`gate_inputs`)."""
        qkv, z, a, b = self.in_projections(x)
        z = z.reshape(*x.shape[:2], self.cfg.linear_num_value_heads, -1)
        beta = jax.nn.sigmoid(b)
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a + self.dt_bias[...])
        return (qkv, z, g, beta, a, b) if raw else (qkv, z, g, beta)

    def split(self, mixed: jax.Array):
        """``[q | k | v]`` channels (in ``qkv_groups`` blocks) to ``q, k [B, T, Hk, K]`` and
        ``v [B, T, Hv, V]``."""
        cfg = self.cfg
        b, t = mixed.shape[:2]
        mixed = mixed.reshape(b, t, self.qkv_groups, -1)
        kd = cfg.linear_key_dim // self.qkv_groups
        q = mixed[..., :kd].reshape(b, t, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
        k = mixed[..., kd : 2 * kd].reshape(b, t, cfg.linear_num_key_heads, -1)
        v = mixed[..., 2 * kd :].reshape(b, t, cfg.linear_num_value_heads, -1)
        return q, k, v

    def finish(self, o: jax.Array, z: jax.Array) -> jax.Array:
        y = self.norm(o, z)
        return self.out_proj(y.reshape(*y.shape[:2], -1))

    def __call__(
        self,
        x: jax.Array,
        conv_state: jax.Array | None = None,
        ssm_state: jax.Array | None = None,
        *,
        num_tokens: jax.Array | None = None,
        recurrent: bool = False,
        rule=None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """A sequence ``x [B, T, H]`` continuing from the caches (zeros when ``None``).

        Only the first ``num_tokens[b]`` tokens of row ``b`` update the caches (the rest get
        ``beta = 0, g = 0``, which leaves the state unchanged). ``recurrent`` picks the
        token-by-token rule (decode) over the chunked one. Returns ``(y, conv_state, ssm_state)``.

        ``rule``: a rule that finds the recurrent state itself (``rule(q, k, v, g, beta, *,
        use_qk_l2norm) -> (o, result)``, e.g. the serving arena's in-place decode kernel);
        ``ssm_state`` is then unused and the third output is the rule's ``result``. A rule with
        a ``raw`` attribute takes the layer's raw inputs instead (``rule.raw(mixed, a, b, A_log,
        dt_bias, *, num_tokens, use_qk_l2norm)``: the conv's output channels and the gates'
        projections, :meth:`gate_inputs`), so no separate kernel splits the channels or forms
        the gates; used when the channels are one ``[q | k | v]`` block (no tensor-parallel
        groups). A rule with a ``conv`` attribute also owns the conv state (``rule.conv(qkv,
        conv_weight, a, b, A_log, dt_bias, *, num_tokens, use_qk_l2norm, cols)`` on the
        pre-conv channels; a fused layer passes its whole projection output as ``qkv``, ``a``
        and ``b``, with ``cols`` the columns where each starts): ``conv_state`` is then unused
        and the second output is ``None``. A rule whose ``conv_norm`` is true also takes the
        gated norm at one token (``norm=(weight, eps, z [B, 1, >= z_col + Hv V], z_col)``)
        and returns the normed output.
        """
        if self.takes_conv(rule):  # the rule runs the conv too
            if self.fused_in is not None:
                # its kernels read q, k, v and the gates' columns of the fused projection in
                # place: no copies of its slices
                proj = self.fused_in.matmul(x)
                qkv_col, z_col, b_col, a_col = self.fused_in.columns
                qkv = a = b_ = proj
                z = proj[..., z_col:b_col].reshape(
                    *x.shape[:2], self.cfg.linear_num_value_heads, -1
                )
                cols = (qkv_col, a_col, b_col)
                z_in = (proj, z_col)
            else:
                qkv, z, _, _, a, b_ = self.project(x, raw=True)
                cols = None
                z_in = (z.reshape(*z.shape[:2], -1), 0)
            # a rule with ``conv_norm`` applies the gated norm in its kernel too
            normed = getattr(rule, "conv_norm", False) and x.shape[1] == 1
            norm = (self.norm.weight[...], self.norm.eps, *z_in) if normed else None
            o, result = rule.conv(
                qkv,
                self.conv_weight[...],
                a,
                b_,
                self.A_log[...],
                self.dt_bias[...],
                num_tokens=num_tokens,
                use_qk_l2norm=True,
                cols=cols,
                **({} if norm is None else dict(norm=norm)),
            )
            if normed:
                return self.out_proj(o.reshape(*o.shape[:2], -1)), None, result
            return self.finish(o, z), None, result
        qkv, z, g, beta, a, b_ = self.project(x, raw=True)
        b, t = x.shape[:2]
        if conv_state is None:
            conv_state = jnp.zeros((b, self.cfg.linear_conv_kernel_dim - 1, qkv.shape[-1]), x.dtype)
        mixed, new_conv = causal_conv1d(qkv, self.conv_weight[...], conv_state)
        if num_tokens is not None:
            live = (jnp.arange(t)[None, :] < num_tokens[:, None])[..., None]
            g, beta = jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0)
            new_conv = conv_state_after(conv_state, qkv, num_tokens)
        raw = getattr(rule, "raw", None)
        if raw is not None and self.qkv_groups == 1:
            o, new_ssm = raw(
                mixed,
                a,
                b_,
                self.A_log[...],
                self.dt_bias[...],
                num_tokens=num_tokens,
                use_qk_l2norm=True,
            )
            return self.finish(o, z), new_conv, new_ssm
        q, k, v = self.split(mixed)
        if rule is not None:
            o, new_ssm = rule(q, k, v, g, beta, use_qk_l2norm=True)
            return self.finish(o, z), new_conv, new_ssm
        if recurrent:  # no GPU kernel takes the token loop: "pallas" means "auto" here
            o, new_ssm = recurrent_gated_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                ssm_state,
                use_qk_l2norm=True,
                impl=self.impl if self.impl in ("xla", "pallas_tpu") else "auto",
            )
        else:
            o, new_ssm = chunk_gated_delta_rule(
                q, k, v, g, beta, ssm_state, use_qk_l2norm=True, impl=self.impl
            )
        return self.finish(o, z), new_conv, new_ssm

    def tree(
        self,
        x: jax.Array,
        parents: jax.Array,
        conv_state: jax.Array,
        ssm_state: jax.Array,
        *,
        snapshot: bool = False,
        rule=None,
    ) -> tuple[jax.Array, TreeCache | jax.Array, jax.Array]:
        """Every draft node ``x [B, N, H]`` over its own path (conv by the tree conv, the rule by
        ``tree_verify``). Returns ``(y, TreeCache, qkv pre-conv [B, N, C])`` for the commit.

        ``snapshot=True`` is the vLLM/SGLang baseline: the rule by ``snapshot_tree_verify``, and
        the per-node states ``[B, N, Hv, K, V]`` in place of the ``TreeCache``.

        ``rule``: a tree-verify rule that finds the initial state itself (``rule(q, k, v, g,
        beta, parents, *, use_qk_l2norm) -> (o, TreeCache)``, e.g. a kernel reading it in place
        from the serving arena); ``ssm_state`` is then unused (``None``)."""
        qkv, z, g, beta = self.project(x)
        mixed = tree_causal_conv1d(qkv, parents, conv_state, self.conv_weight[...])
        q, k, v = self.split(mixed)
        if rule is not None:
            if snapshot:
                raise ValueError("rule: the snapshot method keeps per-node states; no rule")
            o, cache = rule(q, k, v, g, beta, parents, use_qk_l2norm=True)
            return self.finish(o, z), cache, qkv
        if snapshot:
            # the snapshot kernel is a GPU one (no TPU build): pallas_tpu runs the XLA loop
            impl = "xla" if self.impl == "pallas_tpu" else self.impl
            o, cache = snapshot_tree_verify(
                q, k, v, g, beta, parents, ssm_state, use_qk_l2norm=True, impl=impl
            )
        else:
            o, cache = tree_verify(
                q, k, v, g, beta, parents, ssm_state, use_qk_l2norm=True, impl=self.impl
            )
        return self.finish(o, z), cache, qkv
