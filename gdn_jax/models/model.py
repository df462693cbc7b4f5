"""The hybrid Qwen3-Next / Qwen3.5 causal LM as a Flax NNX module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from gdn_jax.models.config import ModelConfig
from gdn_jax.models.layer import DecoderLayer
from gdn_jax.models.linear import Linear, matmul_precision, normal_init
from gdn_jax.models.mtp import MTP
from gdn_jax.models.norm import RMSNorm


class HybridLM(nnx.Module):
    """Embeddings, ``num_hidden_layers`` decoder layers in the ``layer_types`` pattern, final
    norm, LM head (tied to the embeddings when ``tie_word_embeddings``), optional MTP head."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        self.config = cfg
        self.embed_tokens = nnx.Param(normal_init(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List(
            [
                DecoderLayer(cfg, t, cfg.is_moe_layer(i), dtype=dtype, rngs=rngs)
                for i, t in enumerate(cfg.layer_types)
            ]
        )
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)
        )
        self.mtp = MTP(cfg, dtype=dtype, rngs=rngs) if cfg.mtp_num_hidden_layers else None

    def embed(self, input_ids: Int[Array, "B T"]) -> Float[Array, "B T H"]:
        return jnp.take(self.embed_tokens[...], input_ids, axis=0)

    def logits(self, hidden: Float[Array, "B T H"]) -> Float[Array, "B T V"]:
        """LM head on already-normed hidden states."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        w = self.embed_tokens[...]
        return jnp.einsum(
            "...h,vh->...v", hidden.astype(w.dtype), w, precision=matmul_precision(w.dtype)
        )

    def hidden_states(self, input_ids: Int[Array, "B T"]) -> Float[Array, "B T H"]:
        """Final normed hidden states of a fresh sequence (no cache)."""
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)

    def __call__(self, input_ids: Int[Array, "B T"]) -> Float[Array, "B T V"]:
        """Logits ``[B, T, vocab]`` of a fresh sequence."""
        return self.logits(self.hidden_states(input_ids))

    def mtp_logits(
        self, hidden: Float[Array, "B T H"], next_ids: Int[Array, "B T"]
    ) -> Float[Array, "B T V"]:
        """MTP draft logits for token ``t + 2`` from ``hidden[t]`` and token ``next_ids[t]``."""
        if self.mtp is None:
            raise ValueError("mtp: this model has no MTP head (mtp_num_hidden_layers == 0)")
        return self.logits(self.mtp(self.embed(next_ids), hidden))


def param_count(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def set_kernel_impl(model: nnx.Module, impl: str) -> None:
    """Sets the ``impl`` (``"auto"``, ``"xla"``, ``"pallas"`` or ``"pallas_tpu"``) of every
    kernel-routed op the model's layers call: ``chunk_gated_delta_rule``, ``tree_verify`` and
    the token loop ``recurrent_gated_delta_rule`` in the GDN layers (``"pallas"`` leaves the
    token loop on ``"auto"``: no GPU kernel takes it), ``routed_experts`` in the MoE layers
    (``tree_commit`` takes it from :func:`gdn_jax.models.steps.commit`'s ``impl``), and the
    norms' residual add and RMSNorm (:func:`gdn_jax.models.norm.add_rms_norm`: ``"xla"`` for
    ``"xla"``, ``"auto"`` for every other ``impl``, so its GPU kernel runs on a GPU only).
    ``"pallas_tpu"`` runs the TPU kernels (TPU interpret mode off a TPU); its MoE route takes
    bf16 or f16 weights only."""
    from gdn_jax.models.gdn import GatedDeltaNet
    from gdn_jax.models.moe import SparseMoE

    if impl not in ("auto", "xla", "pallas", "pallas_tpu"):
        raise ValueError(f"impl: must be 'auto', 'xla', 'pallas' or 'pallas_tpu', got {impl!r}")
    for _, module in nnx.iter_graph(model):
        if isinstance(module, GatedDeltaNet | SparseMoE):
            module.impl = impl
        elif isinstance(module, RMSNorm):  # its kernel on a GPU unless "xla"
            module.impl = "xla" if impl == "xla" else "auto"


def set_moe_routing(model: nnx.Module, routing: str) -> None:
    """Sets how every MoE layer of ``model`` picks its experts: ``"model"`` (the router's
    top-k) or ``"balanced"`` (:func:`gdn_jax.moe.balanced_route`: the rows spread over the
    experts as under uniform routing, the router's own weights; for benchmarks of random
    weights, whose routing collapses onto a few experts)."""
    from gdn_jax.models.moe import SparseMoE

    if routing not in ("model", "balanced"):
        raise ValueError(f"routing: must be 'model' or 'balanced', got {routing!r}")
    for _, module in nnx.iter_graph(model):
        if isinstance(module, SparseMoE):
            module.routing = routing
