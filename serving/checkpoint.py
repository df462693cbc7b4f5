"""Writes a :class:`HybridLM` as an HF-format directory (``config.json`` + ``model.safetensors``)
that :func:`gdn_jax.models.from_pretrained` reads back: the inverse of its name mapping for the
Qwen3.5 dense layout (the only layout the shipped tiny models use)."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from gdn_jax.models.config import ModelConfig
from gdn_jax.models.loading import F32_PARAMS, source_for
from gdn_jax.models.model import HybridLM
from gdn_jax.models.safetensors_io import write_safetensors


def hf_config(cfg: ModelConfig, **extra) -> dict:
    """The ``config.json`` dict of a dense ``qwen3_5_text`` config."""
    if cfg.model_type != "qwen3_5_text" or cfg.num_experts:
        raise ValueError(f"cfg: only dense qwen3_5_text is written, got {cfg.model_type!r}")
    return dict(
        model_type="qwen3_5_text",
        architectures=["Qwen3_5ForCausalLM"],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        layer_types=list(cfg.layer_types),
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        attn_output_gate=cfg.attn_output_gate,
        rope_theta=cfg.rope_theta,
        partial_rotary_factor=cfg.partial_rotary_factor,
        linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        intermediate_size=cfg.intermediate_size,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        mtp_num_hidden_layers=cfg.mtp_num_hidden_layers,
        hidden_act="silu",
        torch_dtype="bfloat16",
        **extra,
    )


def save_pretrained(model: HybridLM, directory: str | Path, **config_extra) -> Path:
    """Saves ``model`` (bf16 weights, ``A_log``/``dt_bias`` in f32) into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    conf = hf_config(cfg, **config_extra)
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tensors: dict[str, np.ndarray] = {}

    def visit(prefix: str, node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                visit(f"{prefix}.{key}" if prefix else str(key), value)
            return
        arr = np.asarray(jnp.asarray(node, jnp.float32))
        src = source_for(cfg, None, prefix, arr.shape)
        keep_f32 = prefix.rsplit(".", 1)[-1] in F32_PARAMS
        out = arr.reshape(src.shapes[0])
        tensors[src.names[0]] = out if keep_f32 else out.astype(ml_dtypes.bfloat16)

    visit("", pure)
    write_safetensors(directory / "model.safetensors", dict(sorted(tensors.items())))
    with open(directory / "config.json", "w") as f:
        json.dump(conf, f, indent=2)
    return directory
