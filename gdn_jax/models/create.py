"""Random models for benchmarks: built on the device (never a host copy), optionally sharded."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from gdn_jax.models.config import ModelConfig
from gdn_jax.models.model import HybridLM


def abstract_model(config: ModelConfig, dtype=jnp.bfloat16) -> HybridLM:
    """The model with ``jax.ShapeDtypeStruct`` leaves: shapes and dtypes, no memory."""
    return nnx.eval_shape(lambda: HybridLM(config, dtype=dtype, rngs=nnx.Rngs(0)))


def init_random(
    config: ModelConfig,
    dtype=jnp.bfloat16,
    seed: int = 0,
    *,
    sharding: Callable[[nnx.State], object] | None = None,
) -> HybridLM:
    """A randomly initialised model, created by one jitted program on the device(s).

    ``sharding(abstract_state)`` may return a pytree of shardings (or one sharding) for the
    parameter state; the parameters are then created already sharded.
    """
    graphdef, abstract_state = nnx.split(abstract_model(config, dtype))

    def create():
        return nnx.split(HybridLM(config, dtype=dtype, rngs=nnx.Rngs(seed)))[1]

    out = sharding(abstract_state) if sharding is not None else None
    state = jax.jit(create, out_shardings=out)()
    return nnx.merge(graphdef, state)
