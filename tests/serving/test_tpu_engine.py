"""The engine on the TPU kernels (``LLM(kernels="pallas_tpu")``, TPU interpret mode on CPU): the
arena's units on 128-word lane rows, tree verify, commit, the decode step, prefill's GDN layers
(the chunked arena prefill), decode's and prefill's paged attention and the tree verify's
attention by the Mosaic TPU kernels reading the arena in place, the same greedy tokens as the
XLA path."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax.models import init_random
from pallas_kernels import tpu as pallas_tpu
from serving import LLM, SamplingParams, SpecConfig
from serving.memory import MemoryManager, layout_for
from tests.serving.conftest import ENGINE, VOCAB, sharpened, tiny_config

GEOM = dict(ENGINE, page_size=16, memory_budget=4 << 20)


@pytest.fixture(scope="module")
def model():
    # value head dim 128: a state row per TPU lane row; attention head dim 128 (f32): a KV
    # head row per lane row
    config = tiny_config(linear_value_head_dim=128, head_dim=128)
    return sharpened(init_random(config, jnp.float32, seed=3))


def test_units_on_lane_rows(model):
    """With ``unit_align_words=128`` every unit and segment starts on a 128-word row."""
    layout = layout_for(model.config.to_hf_dict(), 16, spec_nodes=7)
    mm = MemoryManager(layout, 4 << 20, unit_align_words=128)
    assert mm.arena.segment_words % 128 == 0
    mm.alloc("a", "state")
    mm.alloc("a", "kv", 3)
    mm.alloc("b", "stash")
    words = [w for *_, w, _ in mm.live()]
    assert words and all(w % 128 == 0 for w in words), words
    with pytest.raises(ValueError, match="unit_align_words"):
        MemoryManager(layout, 4 << 20, unit_align_words=0)


def test_pallas_tpu_misfit_names_the_dim(target):
    """A value head dim other than 128 is refused before anything compiles."""
    with pytest.raises(ValueError, match="linear_value_head_dim 16"):
        LLM(target, kernels="pallas_tpu", **GEOM)


@pytest.mark.parametrize(
    "spec, traced",
    [
        (None, {"chunk_prefill_arena", "recurrent_step_arena", "paged_attention_arena"}),
        (
            SpecConfig(method="ngram", tree=(2, 2)),
            {
                "chunk_prefill_arena",
                "tree_verify_arena",
                "tree_commit_arena",
                "paged_attention_arena",
                "tree_attention_arena",
            },
        ),
    ],
)
def test_pallas_tpu_engine_matches_xla(model, spec, traced, monkeypatch):
    """Plain decoding (the decode step's kernel) and tree WY speculation (verify and commit)
    give the XLA path's greedy tokens, and the engine's programs took the TPU kernels (the
    chunked arena prefill for prefill's GDN layers, the paged attention in prefill and decode,
    the tree attention in the tree verify)."""
    calls = set()
    for name in traced:
        fn = getattr(pallas_tpu, name)

        def counted(*a, _fn=fn, _name=name, **k):
            calls.add(_name)
            return _fn(*a, **k)

        monkeypatch.setattr(pallas_tpu, name, counted)
    rng = np.random.default_rng(0)
    base = rng.integers(1, VOCAB, 6).tolist()
    prompts = [base * 3, rng.integers(1, VOCAB, 9).tolist()]  # a repeat for the n-gram drafter
    params = SamplingParams(max_tokens=6)
    out = {}
    for kernels in ("xla", "pallas_tpu"):
        llm = LLM(model, speculative=spec, kernels=kernels, **GEOM)
        choice = llm.runner.kernel_choice
        assert choice.tpu == choice.tpu_attention == (kernels == "pallas_tpu")
        out[kernels] = [o.token_ids for o in llm.generate(prompts, params)]
    assert out["pallas_tpu"] == out["xla"]
    assert calls == traced


def test_pallas_tpu_attention_misfit_stays_on_xla():
    """Attention head rows that are not one lane row keep decode's and prefill's attention on
    XLA, with the reason; the GDN layers still take the TPU kernels."""
    from serving.arena_spec import ArenaSpec
    from serving.kernels import select_kernels

    config = tiny_config(linear_value_head_dim=128)  # attention head dim 16: 16 words a row
    spec = ArenaSpec.from_layout(layout_for(config.to_hf_dict(), 16), jnp.float32, config)
    choice, notes = select_kernels("pallas_tpu", spec, config, unit_align_words=128)
    assert choice.tpu and not choice.tpu_attention
    assert any("head_dim 16" in n for n in notes), notes
