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
from gdn_jax.models.fused import is_fused
from gdn_jax.models.loading import F32_PARAMS, source_for
from gdn_jax.models.model import HybridLM
from gdn_jax.models.safetensors_io import write_safetensors


def hf_config(cfg: ModelConfig, **extra) -> dict:
    """The ``config.json`` dict of a dense ``qwen3_5_text`` config."""
    if cfg.model_type != "qwen3_5_text" or cfg.num_experts:
        raise ValueError(f"cfg: only dense qwen3_5_text is written, got {cfg.model_type!r}")
    conf = cfg.to_hf_dict()
    return dict(
        model_type=conf.pop("model_type"),
        architectures=["Qwen3_5ForCausalLM"],
        **conf,
        hidden_act="silu",
        torch_dtype="bfloat16",
        **extra,
    )


def save_pretrained(model: HybridLM, directory: str | Path, **config_extra) -> Path:
    """Saves ``model`` (bf16 weights, ``A_log``/``dt_bias`` in f32) into ``directory``."""
    if is_fused(model):
        raise ValueError(
            "model: its input projections are fused (gdn_jax.models.fuse_projections, as the "
            "serving engine runs a model); save the unfused model it was made from"
        )
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
