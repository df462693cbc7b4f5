"""Gated full attention of Qwen3-Next / Qwen3.5.

``q_proj`` yields, per head, the query and an output gate (``[q_h | gate_h]``); q and k get a
zero-centred RMSNorm per head, then partial RoPE; GQA softmax attention; the output is multiplied
by ``sigmoid(gate)`` before ``o_proj``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gdn_jax.models.config import ModelConfig
from gdn_jax.models.linear import Linear
from gdn_jax.models.norm import RMSNorm
from gdn_jax.models.rope import apply_rope
from gdn_jax.models.tree_attention import attend


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, hq, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        hkv = cfg.num_key_value_heads
        self.q_proj = Linear(h, hq * d * (2 if cfg.attn_output_gate else 1), dtype=dtype, rngs=rngs)
        self.k_proj = Linear(h, hkv * d, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(h, hkv * d, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(hq * d, h, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)
        # q_proj, k_proj, v_proj as one matmul (gdn_jax.models.fused)
        self.fused_in = nnx.data(None)
        self.cfg = cfg
        self.scale = d**-0.5

    def project(self, x: jax.Array, positions: jax.Array):
        """``(q [B, T, Hq, D], k, v [B, T, Hkv, D], gate [B, T, Hq * D] | None)``, roped at
        ``positions [B, T]``."""
        cfg = self.cfg
        b, t = x.shape[:2]
        d = cfg.head_dim
        if self.fused_in is not None:
            qg, k, v = self.fused_in(x)
        else:
            qg, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qg = qg.reshape(b, t, cfg.num_attention_heads, -1)
        q, gate = qg[..., :d], (qg[..., d:].reshape(b, t, -1) if cfg.attn_output_gate else None)
        k = k.reshape(b, t, cfg.num_key_value_heads, d)
        v = v.reshape(b, t, cfg.num_key_value_heads, d)
        rope = dict(rotary_dim=cfg.rotary_dim, theta=cfg.rope_theta)
        q = apply_rope(self.q_norm(q), positions, **rope)
        k = apply_rope(self.k_norm(k), positions, **rope)
        return q, k, v, gate

    def project_decode(self, x: jax.Array, positions: jax.Array, valid: jax.Array, rule):
        """One token a row (``x [B, 1, H]``) through a cache's
        :meth:`~gdn_jax.models.cache_protocol.StepCache.attention_decode_rule`: ``(q [B, 1, Hq,
        D], gate, cache)``, the token's K/V written by the rule; ``None`` where the layer has no
        fused projection or the rule does not take it (then :meth:`project` and ``write_kv``)."""
        if self.fused_in is None:
            return None
        cfg = self.cfg
        b, d = x.shape[0], cfg.head_dim
        proj = self.fused_in.matmul(x)[:, 0]  # [B, C]
        out = rule(
            proj,
            positions[:, 0],
            valid[:, 0],
            q_norm=self.q_norm.weight[...],
            k_norm=self.k_norm.weight[...],
            num_heads=cfg.num_attention_heads,
            head_dim=d,
            rotary_dim=cfg.rotary_dim,
            theta=cfg.rope_theta,
            eps=self.q_norm.eps,
            gated=cfg.attn_output_gate,
        )
        if out is None:
            return None
        q, cache = out
        gate = None
        if cfg.attn_output_gate:
            qg = proj[:, : cfg.num_attention_heads * 2 * d].reshape(
                b, 1, cfg.num_attention_heads, 2 * d
            )
            gate = qg[..., d:].reshape(b, 1, -1)
        return q[:, None], gate, cache

    def finish(self, o: jax.Array, gate: jax.Array | None) -> jax.Array:
        o = o.reshape(*o.shape[:2], -1)
        if gate is not None:
            o = o * jax.nn.sigmoid(gate)
        return self.o_proj(o)

    def __call__(self, x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Causal self-attention over ``x [B, T, H]`` (no cache); positions default to
        ``0..T-1``."""
        b, t = x.shape[:2]
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        q, k, v, gate = self.project(x, positions)
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        return self.finish(attend(q, k, v, causal, self.scale), gate)
