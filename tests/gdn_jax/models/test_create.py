"""Config parsing of the real model configs, abstract shapes, and on-device random init."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_jax.models import ModelConfig, abstract_model, init_random, param_count, steps
from gdn_jax.models.cache import init_cache
from gdn_jax.models.config import FULL, LINEAR
from gdn_jax.models.gdn import GatedDeltaNet
from gdn_jax.models.model import set_kernel_impl
from gdn_jax.models.moe import SparseMoE

CONFIGS = Path(__file__).resolve().parents[3] / "benchmarks" / "configs"


@pytest.mark.parametrize(
    "name, billions",
    [("qwen3_5_35b_a3b", 35.5), ("qwen3_5_397b_a17b", 403), ("qwen3_next_80b_a3b", 79.7)],
)
def test_real_configs_abstract(name, billions):
    """The published sizes (text model plus MTP head), without allocating anything."""
    cfg = ModelConfig.from_json(CONFIGS / f"{name}.json")
    assert cfg.layer_types[:4] == (LINEAR, LINEAR, LINEAR, FULL)
    model = abstract_model(cfg)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(model)))
    assert param_count(model) / 1e9 == pytest.approx(billions, rel=0.01)


TINY_MOE = ModelConfig(
    model_type="qwen3_5_moe_text",
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=4,
    layer_types=(LINEAR, LINEAR, LINEAR, FULL),
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    mtp_num_hidden_layers=1,
)


def test_init_random_tiny():
    cfg = TINY_MOE
    model = init_random(cfg, jnp.bfloat16, seed=3)
    assert model.embed_tokens[...].dtype == jnp.bfloat16
    assert isinstance(model.embed_tokens[...], jax.Array)
    logits = jax.jit(lambda ids: model(ids))(jnp.arange(10)[None] % 64)
    assert logits.shape == (1, 10, 64)
    assert np.isfinite(np.asarray(logits, np.float32)).all()


@settings(max_examples=30, deadline=None)
@given(
    base=st.sampled_from(["qwen3_5_35b_a3b", "qwen3_5_397b_a17b", "qwen3_next_80b_a3b"]),
    dense=st.booleans(),
    layers=st.integers(1, 12),
    interval=st.integers(1, 4),
    tie=st.booleans(),
    mtp=st.integers(0, 2),
)
def test_to_hf_dict_round_trips(base, dense, layers, interval, tie, mtp):
    """``from_hf_dict(cfg.to_hf_dict()) == cfg`` for dense and MoE variants of the real configs
    (so the checkpoint writer and the memory layout read every field back)."""
    cfg = ModelConfig.from_json(CONFIGS / f"{base}.json")
    types = tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers))
    cfg = dataclasses.replace(
        cfg,
        num_hidden_layers=layers,
        layer_types=types,
        tie_word_embeddings=tie,
        mtp_num_hidden_layers=mtp,
        **(dict(num_experts=0, num_experts_per_tok=0, intermediate_size=512) if dense else {}),
    )
    hf = cfg.to_hf_dict()
    assert json.loads(json.dumps(hf)) == hf  # plain JSON values
    assert ModelConfig.from_hf_dict(hf) == dataclasses.replace(cfg, weight_prefix="model.")


def test_init_random_layerwise(monkeypatch):
    """Layer-by-layer creation (large models) gives the model's exact structure, shapes and
    dtypes, distinct random layers, and places parameters by the given shardings."""
    import gdn_jax.models.create as create

    monkeypatch.setattr(create, "LAYERWISE_PARAMS", 0)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    seen = []

    def sharding(abstract_state):
        seen.append(abstract_state)
        return jax.tree.map(lambda _: replicated, abstract_state)

    model = create.init_random(TINY_MOE, jnp.bfloat16, seed=5, sharding=sharding)
    want = nnx.state(abstract_model(TINY_MOE, jnp.bfloat16))
    got = nnx.state(model)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert (g.shape, g.dtype) == (w.shape, w.dtype)
        assert g.sharding == replicated
    assert len(seen) == 1
    a0, a1 = (model.layers[i].linear_attn.in_proj_qkv.weight[...] for i in (0, 1))
    assert not np.array_equal(np.asarray(a0, np.float32), np.asarray(a1, np.float32))
    logits = jax.jit(lambda ids: model(ids))(jnp.arange(10)[None] % 64)
    assert np.isfinite(np.asarray(logits, np.float32)).all()


def test_set_kernel_impl():
    """``set_kernel_impl`` reaches every GDN and MoE layer; bad names raise."""
    model = init_random(TINY_MOE, jnp.float32, seed=0)
    set_kernel_impl(model, "xla")
    layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, GatedDeltaNet | SparseMoE)]
    kinds = {type(m) for m in layers}
    assert kinds == {GatedDeltaNet, SparseMoE} and {m.impl for m in layers} == {"xla"}
    with pytest.raises(ValueError, match="impl"):
        set_kernel_impl(model, "triton")


# jitted, as the TPU interpret mode's callbacks expect (eager op-by-op steps can deadlock them)
PREFILL = nnx.jit(steps.prefill, static_argnames="all_logits")
DECODE = nnx.jit(steps.decode)


def test_model_on_tpu_kernels_matches_xla():
    """``set_kernel_impl(model, "pallas_tpu")``: the chunked prefill, the token loop and the
    routed experts run the TPU kernels (TPU interpret mode here) and give the XLA path's logits
    to bf16 rounding, for a prompt and for one more token after it."""
    model = init_random(TINY_MOE, jnp.bfloat16, seed=5)
    ids = jnp.asarray(np.random.default_rng(5).integers(0, 64, (2, 12)), jnp.int32)

    def run(impl):
        set_kernel_impl(model, impl)
        cache = init_cache(model.config, 2, max_len=16, page_size=4, dtype=jnp.bfloat16)
        prompt, cache = PREFILL(model, ids[:, :11], cache, all_logits=True)
        step, _ = DECODE(model, ids[:, 11], cache)
        return np.asarray(prompt, np.float32), np.asarray(step, np.float32)

    for got, want in zip(run("pallas_tpu"), run("xla"), strict=True):
        assert np.isfinite(got).all()
        assert np.abs(got - want).max() / np.abs(want).max() < 3e-2
        assert not np.array_equal(got, want)  # another path ran: not XLA's bits


def test_fuse_projections():
    """Fusing gives the unfused model's logits (f32, random weights: one matmul per block
    instead of several), one ``[sum of outputs, in]`` weight per block in place of its
    projections, and leaves the blocks split over devices alone; checkpoints refuse it."""
    from gdn_jax.models import fuse_projections
    from gdn_jax.models.fused import FusedLinear, is_fused
    from serving.checkpoint import save_pretrained

    cfg = dataclasses.replace(TINY_MOE, shared_expert_intermediate_size=24)
    model = init_random(cfg, jnp.float32, seed=7)
    ids = jnp.asarray(np.random.default_rng(7).integers(0, 64, (2, 9)), jnp.int32)
    forward = nnx.jit(lambda m, ids: m(ids))
    want = np.asarray(forward(model, ids))
    fused = nnx.merge(*nnx.split(model))  # a view: the same arrays
    fused.layers[3].mlp.parallel = "split over devices"  # stays unfused
    assert fuse_projections(fused) == 2 * 5 - 1  # 4 layers and the MTP layer, less that MoE
    assert fuse_projections(fused) == 0 and is_fused(fused) and not is_fused(model)
    gdn, moe = fused.layers[0].linear_attn, fused.layers[0].mlp
    assert isinstance(gdn.fused_in, FusedLinear) and gdn.in_proj_qkv is None
    assert gdn.fused_in.sizes == (cfg.conv_dim, cfg.linear_value_dim, 4, 4)
    assert gdn.fused_in.weight[...].shape == (cfg.conv_dim + cfg.linear_value_dim + 8, 32)
    assert moe.fused_in.sizes == (4, 24, 24, 1) and moe.gate is None
    assert fused.layers[3].mlp.fused_in is None and fused.layers[3].mlp.gate is not None
    assert fused.layers[3].self_attn.fused_in.sizes == (2 * 4 * 16, 2 * 16, 2 * 16)
    fused.layers[3].mlp.parallel = None  # (run it unsplit)
    got = np.asarray(forward(fused, ids))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    with pytest.raises(ValueError, match="fused"):
        save_pretrained(fused, "/nonexistent")
    with pytest.raises(ValueError, match="weights"):
        FusedLinear([jnp.zeros((3, 4)), jnp.zeros((3, 5))])
