"""Random models for benchmarks: built on the device (never a host copy), optionally sharded.

A model above :data:`LAYERWISE_PARAMS` parameters is created layer by layer: one compiled
program per distinct decoder-layer kind (a 40-layer model compiles two small programs instead
of one 40-layer program, which on a GPU compiles a kernel per parameter), called once per layer
with that layer's key; embeddings, final norm, LM head and MTP head come from one more program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from gdn_jax.models.config import ModelConfig
from gdn_jax.models.layer import DecoderLayer
from gdn_jax.models.model import HybridLM, param_count

LAYERWISE_PARAMS = 1_000_000_000  # models above this many parameters are created layer by layer


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
    """A randomly initialised model, created by jitted programs on the device(s).

    ``sharding(abstract_state)`` may return a pytree of shardings (or one sharding) for the
    parameter state; the parameters are then created already sharded. Models above
    :data:`LAYERWISE_PARAMS` parameters are created layer by layer (module docstring; their
    values differ from the one-program creation's for the same seed).
    """
    abstract = abstract_model(config, dtype)
    graphdef, abstract_state = nnx.split(abstract)
    out = sharding(abstract_state) if sharding is not None else None
    if param_count(abstract) <= LAYERWISE_PARAMS:

        def create():
            return nnx.split(HybridLM(config, dtype=dtype, rngs=nnx.Rngs(seed)))[1]

        state = jax.jit(create, out_shardings=out)()
        return nnx.merge(graphdef, state)
    return nnx.merge(graphdef, _layerwise_state(config, dtype, seed, abstract_state, out))


def _layerwise_state(config, dtype, seed, abstract_state, out) -> nnx.State:
    """The parameter state of :func:`init_random`, one program per distinct layer kind (and
    layer shardings)."""
    outer = dataclasses.replace(config, num_hidden_layers=0, layer_types=())

    def make_outer(key):
        return nnx.split(HybridLM(outer, dtype=dtype, rngs=nnx.Rngs(key)))[1]

    outer_key = jax.random.fold_in(jax.random.key(seed), 0)
    flat = dict(nnx.to_flat_state(jax.jit(make_outer, out_shardings=_part(out, None))(outer_key)))
    programs = {}
    for i, kind in enumerate(config.layer_types):
        moe, shardings = config.is_moe_layer(i), _part(out, i)
        tag = (kind, moe, repr(jax.tree.structure(shardings)), repr(jax.tree.leaves(shardings)))
        if tag not in programs:

            def make_layer(key, kind=kind, moe=moe):
                layer = DecoderLayer(config, kind, moe, dtype=dtype, rngs=nnx.Rngs(key))
                return nnx.split(layer)[1]

            programs[tag] = jax.jit(make_layer, out_shardings=shardings)
        key = jax.random.fold_in(jax.random.key(seed), i + 1)
        for path, v in nnx.to_flat_state(programs[tag](key)):
            flat[("layers", i, *path)] = v
    return nnx.from_flat_state([(p, flat[p]) for p, _ in nnx.to_flat_state(abstract_state)])


def _part(out, layer: int | None):
    """The shardings of one layer's state (``layer``) or of everything but the layers
    (``None``); ``None`` or one sharding for all pass through."""
    if out is None or not isinstance(out, nnx.State):
        return out
    if layer is not None:
        return out["layers"][layer]
    return nnx.from_flat_state([(p, v) for p, v in nnx.to_flat_state(out) if p[0] != "layers"])
