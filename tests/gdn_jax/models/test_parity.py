"""Parity of the JAX models with HF transformers, and exactness of the step functions."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.models import from_pretrained
from gdn_jax.models.cache import init_cache
from gdn_jax.models.fused import fuse_projections, is_fused
from gdn_jax.models.steps import commit, decode, prefill, verify_tree

from .conftest import KINDS, PARENTS, PROMPT

prefill_j = nnx.jit(prefill, static_argnames="all_logits")
decode_j = nnx.jit(decode)
verify_j = nnx.jit(verify_tree)
commit_j = nnx.jit(commit)
forward_j = nnx.jit(lambda model, ids: model(ids))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(
    scope="module",
    params=[(k, f) for k in KINDS for f in (False, True)],
    ids=lambda p: p[0] + ("-fused" if p[1] else ""),
)
def loaded(request, hf_models):
    """A model from an HF checkpoint; ``-fused``: with its input projections fused (as the
    serving engine runs it), every block that reads one input several times."""
    kind, fused = request.param
    ckpt, inputs, ref = hf_models(kind)
    model = from_pretrained(ckpt, dtype=jnp.float32)
    if fused:
        layers = model.config.num_hidden_layers + model.config.mtp_num_hidden_layers
        assert fuse_projections(model) == 2 * layers  # a mixer and an ffn per layer
        assert is_fused(model) and fuse_projections(model) == 0
    return model, inputs, ref


def fresh_cache(model, batch=2, max_len=40, page_size=4):
    # pages deliberately interleaved across rows: the page table, not contiguity, must matter
    mp = -(-max_len // page_size)
    table = np.arange(batch * mp, dtype=np.int32).reshape(mp, batch).T[:, ::-1].copy()
    return init_cache(
        model.config,
        batch,
        max_len=max_len,
        page_size=page_size,
        page_table=jnp.asarray(table),
        dtype=jnp.float32,
    )


def test_forward_matches_hf(loaded):
    model, inputs, ref = loaded
    err = rel_err(forward_j(model, jnp.asarray(inputs["ids"])), ref["logits"])
    assert err < 1e-4, err


def test_prefill_matches_hf(loaded):
    model, inputs, ref = loaded
    logits, cache = prefill_j(
        model, jnp.asarray(inputs["ids"]), fresh_cache(model), all_logits=True
    )
    assert rel_err(logits, ref["logits"]) < 1e-4
    np.testing.assert_array_equal(cache.lengths, [inputs["ids"].shape[1]] * 2)


def test_decode_step_by_step_equals_prefill(loaded):
    model, inputs, ref = loaded
    ids = jnp.asarray(inputs["ids"])
    logits, cache = prefill_j(model, ids[:, :PROMPT], fresh_cache(model))
    steps = [logits]
    for t in range(PROMPT, ids.shape[1] - 1):
        logits, cache = decode_j(model, ids[:, t], cache)
        steps.append(logits)
    steps = np.stack(steps, 1)
    assert rel_err(steps, ref["decode_logits"]) < 1e-4  # HF's own cached decode
    assert rel_err(steps, ref["logits"][:, PROMPT - 1 : -1]) < 1e-4  # the full prefill


def test_verify_tree_equals_each_path(loaded):
    """Node n's logits equal the model (HF) run on prompt + path(n), for every node."""
    model, inputs, ref = loaded
    ids = jnp.asarray(inputs["ids"])
    _, cache = prefill_j(model, ids[:, :PROMPT], fresh_cache(model))
    logits, _ = verify_j(model, jnp.asarray(inputs["tree_tokens"]), jnp.asarray(PARENTS), cache)
    for n in range(len(PARENTS)):
        assert rel_err(logits[:, n], ref["path_logits"][:, n]) < 1e-4, n


@pytest.mark.parametrize("accepted", [[0, 1, 3], [7], [0, 2, 5], []])
def test_commit_then_decode_equals_sequential(loaded, accepted):
    model, inputs, _ = loaded
    ids = jnp.asarray(inputs["ids"])
    tree = jnp.asarray(inputs["tree_tokens"])
    _, cache0 = prefill_j(model, ids[:, :PROMPT], fresh_cache(model))
    _, state = verify_j(model, tree, jnp.asarray(PARENTS), cache0)
    path = np.zeros((2, 4), np.int32)
    path[:, : len(accepted)] = accepted
    cache = commit_j(cache0, state, jnp.asarray(path), jnp.full((2,), len(accepted), jnp.int32))
    nxt = jnp.asarray([5, 17])
    got, cache = decode_j(model, nxt, cache)

    seq = cache0
    for node in accepted:
        _, seq = decode_j(model, tree[:, node], seq)
    want, seq = decode_j(model, nxt, seq)
    assert rel_err(got, want) < 1e-4
    np.testing.assert_array_equal(cache.lengths, seq.lengths)
    for a, b in ((cache.ssm, seq.ssm), (cache.conv, seq.conv)):
        assert rel_err(a, b) < 1e-4


def test_ragged_prefill_rows(loaded):
    """Rows of different lengths in one prefill: each equals its own unpadded prefill."""
    model, inputs, ref = loaded
    ids = jnp.asarray(inputs["ids"])
    n = jnp.asarray([PROMPT, PROMPT - 3], jnp.int32)
    logits, cache = prefill_j(model, ids[:, :PROMPT], fresh_cache(model), n)
    assert rel_err(logits[1], ref["logits"][1, PROMPT - 4]) < 1e-4
    assert rel_err(logits[0], ref["logits"][0, PROMPT - 1]) < 1e-4
    np.testing.assert_array_equal(cache.lengths, n)
    got, _ = decode_j(model, jnp.stack([ids[0, PROMPT], ids[1, PROMPT - 3]]), cache)
    assert rel_err(got[0], ref["logits"][0, PROMPT]) < 1e-4
    assert rel_err(got[1], ref["logits"][1, PROMPT - 3]) < 1e-4


def test_mtp_matches_hf_modules(loaded):
    model, inputs, ref = loaded
    ids = jnp.asarray(inputs["ids"])
    nxt = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)
    got = model.mtp_logits(model.hidden_states(ids), nxt)
    assert rel_err(got, ref["mtp_logits"]) < 1e-4
