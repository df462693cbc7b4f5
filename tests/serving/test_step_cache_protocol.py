"""Both cache storages implement :class:`gdn_jax.models.cache_protocol.StepCache`, the contract
of the step functions: every protocol member exists on ``ModelCache`` and ``ArenaCache`` with
the protocol's parameters, a class missing any member is rejected, and the step functions call
nothing on a cache that the protocol does not declare."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import jax.numpy as jnp
import pytest

from gdn_jax.models import steps
from gdn_jax.models.cache import ModelCache, init_cache
from gdn_jax.models.cache_protocol import StepCache
from serving.arena_cache import ArenaCache
from serving.arena_spec import ArenaSpec
from tests.serving.conftest import tiny_config

MEMBERS = sorted(StepCache.__protocol_attrs__)
METHODS = [m for m in MEMBERS if callable(getattr(StepCache, m, None))]


def _params(fn) -> list[tuple[str, inspect._ParameterKind, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _arena_cache() -> ArenaCache:
    spec = ArenaSpec(
        gdn_layers=1,
        state_shape=(2, 16, 16),
        state_dtype="float32",
        state_offset=0,
        conv_shape=(3, 96),
        conv_dtype="float32",
        conv_offset=512,
        attn_layers=1,
        page_size=16,
        kv_heads=1,
        head_dim=16,
        kv_dtype="float32",
        kv_offset=0,
        model_dtype="float32",
    )
    return ArenaCache(
        buffer=jnp.zeros((2, 1024), jnp.uint32),
        table=jnp.zeros((4, 2), jnp.int32),
        state_handles=jnp.zeros((1,), jnp.int32),
        page_handles=jnp.zeros((1, 1), jnp.int32),
        lengths=jnp.zeros((1,), jnp.int32),
        spec=spec,
    )


def test_protocol_names_every_member_the_steps_use():
    assert set(METHODS) == {
        "gdn_state",
        "with_gdn_state",
        "gdn_conv_state",
        "with_gdn_conv_state",
        "write_kv",
        "attention",
        "with_lengths",
        "gdn_step_rule",
        "gdn_prefill_rule",
        "gdn_tree_rule",
        "commit_gdn_state",
        "attention_decode_rule",
    }
    assert set(MEMBERS) - set(METHODS) == {"lengths"}
    # every attribute the step functions read off a cache is a protocol member
    tree = ast.parse(Path(inspect.getfile(steps)).read_text())
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in ("cache", "committed")
    }
    assert used and used <= set(MEMBERS), used - set(MEMBERS)


@pytest.mark.parametrize("cls", [ModelCache, ArenaCache])
def test_caches_implement_the_protocol(cls):
    assert "lengths" in {f.name for f in dataclasses.fields(cls)}
    for name in METHODS:
        impl = getattr(cls, name, None)
        assert callable(impl), f"{cls.__name__} lacks {name}"
        assert _params(impl) == _params(getattr(StepCache, name)), f"{cls.__name__}.{name}"


def test_instances_are_step_caches():
    assert isinstance(init_cache(tiny_config(), 1, max_len=16, dtype=jnp.float32), StepCache)
    assert isinstance(_arena_cache(), StepCache)


def test_model_cache_takes_the_default_path():
    cache = init_cache(tiny_config(), 1, max_len=16, dtype=jnp.float32)
    assert cache.gdn_step_rule(0) is None
    assert cache.gdn_prefill_rule(0, jnp.ones((1,), jnp.int32)) is None
    assert cache.gdn_tree_rule(0, 7) is None
    assert cache.commit_gdn_state(0, None, jnp.zeros((1, 1), jnp.int32), cache.lengths) is None
    conv = jnp.ones_like(cache.gdn_conv_state(1))
    assert (cache.with_gdn_conv_state(1, conv).gdn_state(1)[0] == 1).all()


@pytest.mark.parametrize("missing", MEMBERS)
def test_a_cache_missing_a_member_is_rejected(missing):
    def member(name):
        return jnp.zeros((1,), jnp.int32) if name == "lengths" else lambda self, *a, **k: None

    full = type("Full", (), {m: member(m) for m in MEMBERS})
    partial = type("Partial", (), {m: member(m) for m in MEMBERS if m != missing})
    assert isinstance(full(), StepCache)
    assert not isinstance(partial(), StepCache)
