"""API surface: bad arguments raise ValueError naming them; the CLI's help lists every
subcommand; text prompts go through the byte tokenizer; the HF writer round-trips."""

from __future__ import annotations

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.models import from_pretrained
from gdn_jax.models.gdn import GatedDeltaNet
from gdn_jax.models.moe import SparseMoE
from serving import LLM, SamplingParams, SpecConfig
from serving.checkpoint import save_pretrained
from serving.spec_trees import TreeBuilder
from serving.tokenizer import ByteTokenizer
from tests.serving.conftest import ENGINE


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
    ],
)
def test_sampling_params_validate(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(method="medusa"), "method"),
        (dict(verify="replay"), "verify"),
        (dict(tree=(4, 0)), "tree"),
        (dict(budget=1), "budget"),
        (dict(method="draft_model"), "draft_model"),
    ],
)
def test_spec_config_validates(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SpecConfig(**kwargs)


def test_spec_config_node_counts():
    assert SpecConfig(tree=(4, 2, 2)).num_nodes == 29
    assert SpecConfig(tree=(1, 1, 1, 1)).num_nodes == 5
    assert SpecConfig(budget=64).num_nodes == 64


def test_dynamic_tree_keeps_budget_most_probable_nodes():
    spec = SpecConfig(method="ngram", budget=6, depth=3, branch=3)
    tb = TreeBuilder(7, spec, None)
    q = np.array([0.6, 0.3, 0.1])
    level = 0
    while nodes := tb.frontier(level):
        for n in nodes:
            tb.expand(n, q)
        level += 1
    tb.finish()
    assert len(tb) == 6
    # cumulative probabilities: root 1, then .6 .36 .3 .216 .18 ... kept in that order
    np.testing.assert_allclose(sorted(np.exp(tb.logp))[::-1], [1, 0.6, 0.36, 0.3, 0.216, 0.18])
    for n, p in enumerate(tb.parents):
        assert p < n


def test_llm_validates(target):
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(target, max_num_seqs=0)
    with pytest.raises(ValueError, match="speculative"):
        LLM(target, speculative="ngram")
    llm = LLM(target, **ENGINE)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[1, 2, 10_000]])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="text prompts"):
        llm.generate(["hello"])


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("déjà vu")
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == "déjà vu"


def test_save_pretrained_round_trips(target, tmp_path):
    save_pretrained(target, tmp_path / "m")
    back = from_pretrained(tmp_path / "m", jnp.float32)
    ids = jnp.arange(12)[None] % target.config.vocab_size
    np.testing.assert_allclose(np.asarray(back(ids)), np.asarray(target(ids)), rtol=0.1, atol=0.1)


def test_cli_help_lists_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "serving", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for cmd in ("generate", "bench", "train-tiny"):
        assert cmd in out


def test_llm_model_impl_follows_kernels(target):
    """The engine runs a view of the caller's model (the same weight arrays) whose own
    kernel-routed ops follow ``kernels``: XLA under ``"xla"`` (and off a GPU); the caller's
    model keeps its settings."""
    llm = LLM(target, kernels="xla", **ENGINE)
    impls = lambda model: {
        m.impl for _, m in nnx.iter_graph(model) if isinstance(m, GatedDeltaNet | SparseMoE)
    }
    assert impls(llm.model) == {"xla"} and impls(target) == {"auto"}
    assert llm.model.embed_tokens[...] is target.embed_tokens[...]
