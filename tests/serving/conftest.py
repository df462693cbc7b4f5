"""Tiny random hybrid models (f32, so greedy ties do not depend on rounding) for the engine
tests, built once per session."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.models import ModelConfig, init_random
from gdn_jax.models.config import FULL, LINEAR

VOCAB = 48


def tiny_config(**kw) -> ModelConfig:
    base = ModelConfig(
        model_type="qwen3_5_text",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        intermediate_size=64,
        tie_word_embeddings=True,
        mtp_num_hidden_layers=1,
    )
    return dataclasses.replace(base, **kw)


def sharpened(model, factor: float = 6.0):
    """Scales every weight matrix: a random model at the default init std repeats one token;
    larger weights give varied, input-dependent greedy outputs (a harder exactness test)."""
    state = nnx.state(model, nnx.Param)
    state = jax.tree.map(lambda x: x * factor if x.ndim == 2 else x, state)
    nnx.update(model, state)
    return model


@pytest.fixture(scope="session")
def target():
    return sharpened(init_random(tiny_config(), jnp.float32, seed=1))


@pytest.fixture(scope="session")
def draft():
    cfg = tiny_config(
        num_hidden_layers=2, layer_types=(LINEAR, FULL), mtp_num_hidden_layers=0, hidden_size=16
    )
    return sharpened(init_random(cfg, jnp.float32, seed=2))


# One engine geometry for every test, so the jitted programs are compiled once per session.
ENGINE = dict(
    dtype="float32",
    max_num_seqs=4,
    batch_buckets=(4,),
    max_model_len=96,
    page_size=8,
    prefill_chunk=16,
)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts with repeats (so n-gram lookup finds matches), lengths 5 to 40."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        motif = rng.integers(0, VOCAB, rng.integers(3, 8)).tolist()
        p = (motif * 8)[: int(rng.integers(5, 40))]
        out.append(p)
    return out


def host_speculation(llm):
    """``llm`` with its speculative steps on the host's multi-program path (drafting, verify,
    acceptance and commit as separate calls) instead of the one device program, for tests of
    that path's runner calls."""
    llm.engine.device_spec = None
    return llm
