"""Parity with HF transformers' own GDN reference functions (Qwen3-Next), run in the side venv.

The HF outputs are regenerated on every run by ``tests/hf_reference/run_hf.py`` from the same
random inputs; nothing is typed in.
"""

from __future__ import annotations

import numpy as np
import pytest

from gdn_jax import chunk_gated_delta_rule, recurrent_gated_delta_rule, tree_commit, tree_verify
from tests.gdn_jax.reference import rel_err
from tests.gdn_jax.strategies import make_inputs
from tests.hf_reference import run_hf

CASES = [
    # (B, T, Hk, Hv, K, V, l2norm, with_state, chunk)
    (2, 37, 2, 4, 16, 8, True, True, 16),  # grouped value heads (GVA), K != V, ragged T
    (1, 64, 2, 2, 8, 8, False, False, 64),
    (2, 130, 1, 3, 8, 12, True, False, 64),
]


@pytest.mark.parametrize("case", CASES)
def test_chunk_and_recurrent_match_transformers(case, tmp_path):
    b, t, hk, hv, dk, dv, l2, with_state, chunk = case
    rng = np.random.default_rng(sum(case[:6]))
    q, k, v, g, beta, s0 = make_inputs(rng, b, t, hk, hv, dk, dv, decay="mixed")
    if not l2:  # keep the raw recurrence well conditioned without the norm
        q = q / np.sqrt(dk)
    inputs = dict(
        q=q, k=k, v=v, g=g, beta=beta, use_qk_l2norm=np.array(l2), chunk_size=np.array(chunk)
    )
    if with_state:
        inputs["state"] = s0
    state = s0 if with_state else None
    hf = run_hf("run_hf.py", "gdn", inputs, tmp_path)
    hf_chunk = {"o": hf["o_chunk"], "state": hf["state_chunk"]}
    hf_rec = {"o": hf["o_recurrent"], "state": hf["state_recurrent"]}
    assert rel_err(hf_chunk["o"], hf_rec["o"]) < 1e-4  # the two HF references agree
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, state, use_qk_l2norm=l2, chunk_size=chunk)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, state, use_qk_l2norm=l2)
    for o, s in ((o_c, s_c), (o_r, s_r)):
        assert rel_err(o, hf_chunk["o"]) < 1e-4
        assert rel_err(s, hf_chunk["state"]) < 1e-4
        assert rel_err(o, hf_rec["o"]) < 1e-4
        assert rel_err(s, hf_rec["state"]) < 1e-4
    # A chain-shaped draft tree reproduces HF's outputs too, and its commit HF's final state.
    chain = np.broadcast_to(np.arange(-1, t - 1, dtype=np.int32), (b, t))
    s_in = s0 if with_state else np.zeros_like(s0)
    o_t, cache = tree_verify(q, k, v, g, beta, chain, s_in, use_qk_l2norm=l2)
    assert rel_err(o_t, hf_rec["o"]) < 1e-4
    path = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    s_t = tree_commit(s_in, cache, path, np.full(b, t, np.int32))
    assert rel_err(s_t, hf_rec["state"]) < 1e-4
