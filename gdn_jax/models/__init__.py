"""Flax NNX Qwen3-Next / Qwen3.5 hybrid models: layers, HF loading, and the pure step functions
(prefill, decode, verify_tree, commit) over paged KV and GDN state caches."""

from gdn_jax.models.cache_protocol import StepCache
from gdn_jax.models.config import ModelConfig
from gdn_jax.models.create import abstract_model, init_random
from gdn_jax.models.fused import fuse_projections
from gdn_jax.models.loading import CheckpointError, from_pretrained
from gdn_jax.models.model import HybridLM, param_count, set_moe_routing

__all__ = [
    "CheckpointError",
    "HybridLM",
    "ModelConfig",
    "StepCache",
    "abstract_model",
    "from_pretrained",
    "fuse_projections",
    "init_random",
    "param_count",
    "set_moe_routing",
]
