"""Random models for benchmarks: built on the device (never a host copy), optionally sharded.

A model above :data:`LAYERWISE_PARAMS` parameters is created layer by layer: one compiled
program per distinct decoder-layer kind (a 40-layer model compiles two small programs instead
of one 40-layer program, which on a GPU compiles a kernel per parameter), called once per layer
with that layer's key; embeddings, final norm, LM head and MTP head come from one more program.
"""

from __future__ import annotations

import dataclasses
import functools
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
    """The parameter state of :func:`init_random`, one program per distinct layer kind."""
    outer = dataclasses.replace(config, num_hidden_layers=0, layer_types=())
    outer_key = jax.random.fold_in(jax.random.key(seed), 0)
    flat = dict(nnx.to_flat_state(_outer_program(outer, dtype, _part(out, None))(outer_key)))
    for i, kind in enumerate(config.layer_types):
        key = jax.random.fold_in(jax.random.key(seed), i + 1)
        make = _layer_program(config, kind, config.is_moe_layer(i), dtype, _part(out, i))
        for path, v in nnx.to_flat_state(make(key)):
            flat[("layers", i, *path)] = v
    expected = [p for p, _ in nnx.to_flat_state(abstract_state)]
    missing = [p for p in expected if p not in flat]
    if missing or len(flat) != len(expected):
        raise AssertionError(f"layer-by-layer creation does not match the model: {missing[:3]}")
    return nnx.from_flat_state([(p, flat[p]) for p in expected])


def _part(out, layer: int | None):
    """The shardings of one layer's state (``layer``) or of everything but the layers
    (``None``); ``None`` or one sharding for all pass through."""
    if out is None or not isinstance(out, nnx.State):
        return out
    if layer is not None:
        return out["layers"][layer]
    flat = [(p, v) for p, v in nnx.to_flat_state(out) if p[0] != "layers"]
    return nnx.from_flat_state(flat)


def _outer_program(outer: ModelConfig, dtype, out):
    def create(key):
        return nnx.split(HybridLM(outer, dtype=dtype, rngs=nnx.Rngs(key)))[1]

    return jax.jit(create, out_shardings=out)


def _layer_program(config, kind, moe, dtype, out):
    # compiled once per (kind, moe, shardings): jax.jit caches on the function object
    return _layer_program_cached(config, kind, moe, jnp.dtype(dtype), _Hashable(out))


class _Hashable:
    """Shardings as a cache key (by their tree structure and leaves' string forms)."""

    def __init__(self, value):
        self.value = value
        self.key = repr(jax.tree.leaves(value)) + repr(jax.tree.structure(value))

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _Hashable) and self.key == other.key


@functools.lru_cache(maxsize=16)
def _layer_program_cached(config, kind, moe, dtype, out: _Hashable):
    def create(key):
        return nnx.split(DecoderLayer(config, kind, moe, dtype=dtype, rngs=nnx.Rngs(key)))[1]

    return jax.jit(create, out_shardings=out.value)
