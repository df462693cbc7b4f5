"""The Qwen3.5 / Qwen3-Next multi-token-prediction (MTP) head, used as a drafter.

For the main model's final (normed) hidden state ``h_t`` and the embedding ``e_{t+1}`` of the
next token: ``x = fc([norm_e(e_{t+1}) | norm_h(h_t)])``, then ``mtp_num_hidden_layers``
full-attention decoder layers and ``norm``; the main model's LM head turns it into logits for
token ``t + 2``. Tensors ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
``mtp.layers.*``, ``mtp.norm``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gdn_jax.models.config import FULL, ModelConfig
from gdn_jax.models.layer import DecoderLayer
from gdn_jax.models.linear import Linear
from gdn_jax.models.norm import RMSNorm


class MTP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = Linear(2 * h, h, dtype=dtype, rngs=rngs)
        self.pre_fc_norm_embedding = RMSNorm(h, eps=eps, dtype=dtype)
        self.pre_fc_norm_hidden = RMSNorm(h, eps=eps, dtype=dtype)
        self.layers = nnx.List(
            [
                DecoderLayer(
                    cfg, FULL, cfg.is_moe_layer(cfg.num_hidden_layers + i), dtype=dtype, rngs=rngs
                )
                for i in range(cfg.mtp_num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(h, eps=eps, dtype=dtype)

    def __call__(
        self, next_embeds: jax.Array, hidden: jax.Array, positions: jax.Array | None = None
    ) -> jax.Array:
        """``next_embeds, hidden: [B, T, H]`` -> the MTP's normed hidden states ``[B, T, H]``."""
        x = jnp.concatenate(
            [self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        for layer in self.layers:
            x = layer(x, positions)
        return self.norm(x)
