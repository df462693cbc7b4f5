"""One decoder layer: ``x += mixer(norm(x)); x += ffn(norm(x))``, the mixer being a Gated
DeltaNet (``linear_attention``) or gated full attention (``full_attention``), the ffn a dense
MLP or the sparse MoE."""

from __future__ import annotations

import jax
from flax import nnx

from gdn_jax.models.attention import Attention
from gdn_jax.models.config import FULL, LINEAR, ModelConfig
from gdn_jax.models.gdn import GatedDeltaNet
from gdn_jax.models.mlp import MLP
from gdn_jax.models.moe import SparseMoE
from gdn_jax.models.norm import RMSNorm


def make_ffn(cfg: ModelConfig, moe: bool, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
    if moe:
        return SparseMoE(
            cfg.hidden_size,
            num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            intermediate=cfg.moe_intermediate_size,
            shared_intermediate=cfg.shared_expert_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            dtype=dtype,
            rngs=rngs,
        )
    return MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, moe: bool, *, dtype, rngs: nnx.Rngs):
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        if layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, dtype=dtype, rngs=rngs)
        elif layer_type == FULL:
            self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        else:
            raise ValueError(f"layer_type: unsupported {layer_type!r}")
        self.mlp = make_ffn(cfg, moe, dtype=dtype, rngs=rngs)

    def ffn(self, x: jax.Array) -> jax.Array:
        """The residual feed-forward half: ``x + mlp(post_attention_layernorm(x))``."""
        return x + self.mlp(self.post_attention_layernorm(x))

    def __call__(self, x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """The whole layer over a fresh sequence (no cache)."""
        h = self.input_layernorm(x)
        if self.layer_type == LINEAR:
            mixed, _, _ = self.linear_attn(h)
        else:
            mixed = self.self_attn(h, positions)
        return self.ffn(x + mixed)
