"""Multi-device serving (``serving/parallel.py``, ``gdn_jax/sharding.py``): greedy tokens of
every parallel layout (tensor, expert and data parallel; plain and speculative: draft model,
MTP, n-gram; tree WY and snapshot verify; XLA and the Pallas arena kernels under ``shard_map``)
equal the single-device engine's; the arena is one ``[segments, words]`` slice per device laid
out for its heads; bad parallel arguments raise ``ValueError`` naming them.

The multi-device checks need 8 devices, which XLA gives the CPU only when
``--xla_force_host_platform_device_count=8`` is set before jax starts its backend: they run
once, in a subprocess running this file as a script with that flag (its results as JSON on
stdout); the pure-host checks run here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gdn_jax.models import ModelConfig
from gdn_jax.models.config import FULL, LINEAR
from gdn_jax.sharding import (
    check_tensor_parallel,
    kv_heads,
    local_config,
    param_spec,
    qkv_rows,
    tp_config,
)

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "serving" / "assets" / "tiny"
XLA_FLAGS = (
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true"
)
# one engine geometry for every layout (one batch bucket: few programs to compile)
ENGINE = dict(
    dtype="float32", max_num_seqs=4, batch_buckets=(4,), max_model_len=64, prefill_chunk=16
)
MAX_TOKENS = 8
TINY_PROMPTS = ["    def __init__(self", "import os\nimport sys\nfrom ", "class Foo:\n    def"]
MOE_PROMPTS = [[1, 5, 9, 13, 2, 7], [3, 3, 8, 60, 12], [40, 41, 42]]

# name: (model, LLM keyword arguments). "tiny": the shipped target (8 layers, dense; drafts by
# the shipped draft, whose heads split over 2 devices and are replicated over 4); "moe": a tiny
# random MoE (8 query / 2 KV heads, 2 key / 8 value GDN heads, 8 experts, top-2, an MTP layer)
LAYOUTS = {
    "tp8_ep": ("moe", dict(tensor_parallel_size=8, enable_expert_parallel=True)),
    "tp4_mtp": ("moe", dict(tensor_parallel_size=4, speculative=("mtp", "wy"))),
    "dp2_tp4_ep_ngram": (
        "moe",
        dict(
            data_parallel_size=2,
            tensor_parallel_size=4,
            enable_expert_parallel=True,
            speculative=("ngram", "wy"),
        ),
    ),
    "tp2_ep_pallas_ngram": (
        "moe",
        dict(
            tensor_parallel_size=2,
            enable_expert_parallel=True,
            kernels="pallas",
            speculative=("ngram", "wy"),
        ),
    ),
    "tp2_draft": ("tiny", dict(tensor_parallel_size=2, speculative=("draft_model", "wy"))),
    "tp4_draft_snapshot": (
        "tiny",
        dict(tensor_parallel_size=4, speculative=("draft_model", "snapshot")),
    ),
    "dp2": ("moe", dict(data_parallel_size=2)),
}


def tiny_moe_config() -> ModelConfig:
    return ModelConfig(
        model_type="qwen3_5_moe_text",
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=4,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL),
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=8,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        tie_word_embeddings=True,
        mtp_num_hidden_layers=1,
    )


# ----------------------------------------------------------------------- the subprocess side


def _subprocess_main() -> None:  # pragma: no cover (runs in the 8-device subprocess)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from gdn_jax.models import init_random
    from gdn_jax.sharding import make_mesh, shard_model
    from serving import LLM, SamplingParams, SpecConfig

    assert len(jax.devices()) == 8, jax.devices()
    moe = init_random(tiny_moe_config(), jnp.float32, seed=3)
    params = nnx.state(moe, nnx.Param)  # larger weights: varied, input-dependent greedy text
    nnx.update(moe, jax.tree.map(lambda x: x * 6.0 if x.ndim >= 2 else x, params))
    models = {"tiny": (ASSETS / "target", TINY_PROMPTS), "moe": (moe, MOE_PROMPTS)}
    sp = SamplingParams(max_tokens=MAX_TOKENS)
    out: dict = {"layouts": {}, "refs": {}}

    def engine(model_key, **kw):
        if isinstance(kw.get("speculative"), tuple):
            method, verify = kw["speculative"]
            draft = str(ASSETS / "draft") if method == "draft_model" else None
            kw["speculative"] = SpecConfig(
                method=method, draft_model=draft, tree=(2, 2), verify=verify
            )
        return LLM(models[model_key][0], **ENGINE, **kw)

    def tokens(llm, model_key):
        return [o.token_ids for o in llm.generate(models[model_key][1], sp)]

    singles = {}
    for key in models:
        singles[key] = engine(key)
        out["refs"][key] = tokens(singles[key], key)
    kept = {}
    for name, (key, kw) in LAYOUTS.items():
        t0 = time.perf_counter()
        try:
            llm = engine(key, **kw)
            out["layouts"][name] = {"tokens": tokens(llm, key)}
            out["layouts"][name]["seconds"] = round(time.perf_counter() - t0, 1)
            engines = [r.engine for r in llm.replicas] if llm.replicas else [llm.engine]
            out["layouts"][name]["device_spec_calls"] = sum(
                e.device_spec.calls for e in engines if e.device_spec is not None
            )
            if name in ("tp8_ep", "tp2_draft"):
                kept[name] = llm
        except Exception as e:  # reported per layout by the test
            out["layouts"][name] = {"error": f"{type(e).__name__}: {e}"}
    # the per-device arenas
    for name, key in (("tp8_ep", "moe"), ("tp2_draft", "tiny")):
        if name not in kept:
            continue
        llm, one = kept[name], singles[key]
        buf = llm.manager.arena.buffer
        out.setdefault("arena", {})[name] = dict(
            shape=list(buf.shape),
            spec=str(buf.sharding.spec),
            shard_shape=list(buf.addressable_shards[0].data.shape),
            segment_words=llm.manager.arena.segment_words,
            state_bytes=llm.layout.unit_bytes("state"),
            kv_bytes=llm.layout.unit_bytes("kv"),
            single_state_bytes=one.layout.unit_bytes("state"),
            single_kv_bytes=one.layout.unit_bytes("kv"),
            table_spec=str(llm.manager.device_table().sharding.spec),
        )
    # bad arguments
    errors = {}
    for label, kw in (
        ("heads", dict(tensor_parallel_size=8)),
        ("pools", dict(tensor_parallel_size=2, cache="pools")),
        ("devices", dict(tensor_parallel_size=4, data_parallel_size=4)),
        ("dense_ep", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    ):
        try:
            engine("tiny", **kw)
            errors[label] = None
        except ValueError as e:
            errors[label] = str(e)
    out["errors"] = errors
    # the model view alone: the same logits over 8 devices
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)))
    ref = moe(ids)
    view = shard_model(moe, make_mesh(8), expert_parallel=True)
    got = nnx.jit(lambda m, x: m(x))(view, ids)
    out["view_logits"] = dict(
        max_abs_err=float(jnp.max(jnp.abs(got - ref))), scale=float(jnp.max(jnp.abs(ref)))
    )
    print("RESULT " + json.dumps(out))


# ------------------------------------------------------------------------ the pytest side


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, XLA_FLAGS=XLA_FLAGS, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, __file__],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_matches_single_device(results, name):
    got = results["layouts"][name]
    assert "error" not in got, got.get("error")
    ref = results["refs"][LAYOUTS[name][0]]
    assert got["tokens"] == ref
    if "speculative" in LAYOUTS[name][1]:  # speculation ran as one device program per step
        assert got["device_spec_calls"] > 0
    assert all(len(t) == MAX_TOKENS for t in ref)
    assert len({tuple(t) for t in ref}) == len(ref)  # varied output, not one repeated token


def test_references_vary(results):
    for toks in results["refs"].values():
        assert all(len(set(t)) > 2 for t in toks)


def test_arena_is_per_device(results):
    a = results["arena"]["tp8_ep"]
    assert a["shape"][0] == 8 and a["spec"] in ("P('tensor',)", "PartitionSpec('tensor',)")
    assert a["shard_shape"] == [1, *a["shape"][1:]]
    assert a["table_spec"] in ("P()", "PartitionSpec()")
    # each device's state slot holds its share of the GDN states (8 of 8 value heads split,
    # the repeated key heads' conv channels with them); its KV page one virtual KV head of 2
    assert a["state_bytes"] < a["single_state_bytes"] / 4
    assert a["kv_bytes"] == a["single_kv_bytes"] // 2
    b = results["arena"]["tp2_draft"]
    assert b["shape"][0] == 2 and b["state_bytes"] < b["single_state_bytes"]


def test_parallel_errors(results):
    e = results["errors"]
    assert "tensor_parallel_size=8" in e["heads"] and "num_attention_heads" in e["heads"]
    assert e["pools"].startswith("cache")
    assert "exceeds the 8 devices" in e["devices"]
    assert e["dense_ep"].startswith("enable_expert_parallel")


def test_sharded_view_logits(results):
    v = results["view_logits"]
    assert v["max_abs_err"] <= 1e-4 * max(v["scale"], 1.0)


# -------------------------------------------------------------------- host-side geometry


def qwen397b() -> ModelConfig:
    return ModelConfig.from_json(ROOT / "benchmarks" / "configs" / "qwen3_5_397b_a17b.json")


def test_one_device_config_errors():
    from serving import LLM
    from serving.parallel import ParallelConfig

    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size must be a positive int"):
        ParallelConfig(data_parallel_size=True)
    with pytest.raises(ValueError, match="enable_expert_parallel must be a bool"):
        ParallelConfig(enable_expert_parallel="yes")
    with pytest.raises(ValueError, match="exceeds the 1 devices"):
        ParallelConfig(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(ASSETS / "target", tensor_parallel_size=2, **ENGINE)


def test_head_and_expert_rules():
    cfg = qwen397b()
    check_tensor_parallel(cfg, 8, True)
    check_tensor_parallel(cfg, 16, True)
    check_tensor_parallel(cfg, 8, False)  # moe_intermediate_size 1024 splits by 8
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        check_tensor_parallel(cfg, 3, True)
    with pytest.raises(ValueError, match="num_experts=512 is not a multiple of 24"):
        check_tensor_parallel(
            dataclasses.replace(
                cfg, num_attention_heads=48, linear_num_value_heads=48, linear_num_key_heads=24
            ),
            24,
            True,
        )
    dense = dataclasses.replace(cfg, num_experts=0)
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        check_tensor_parallel(dense, 2, True)


def test_local_geometry_397b():
    cfg = qwen397b()
    loc = local_config(cfg, 8, expert_parallel=True)
    assert (loc.num_attention_heads, loc.num_key_value_heads) == (4, 1)
    assert (loc.linear_num_key_heads, loc.linear_num_value_heads) == (2, 8)
    assert (loc.num_experts, loc.moe_intermediate_size) == (64, 1024)
    assert loc.shared_expert_intermediate_size == 128 and loc.vocab_size == 31040
    tp = local_config(cfg, 8, expert_parallel=False)
    assert (tp.num_experts, tp.moe_intermediate_size) == (512, 128)
    assert tp_config(cfg, 8).num_key_value_heads == 8  # 2 KV heads repeated to 8


def test_qkv_rows_and_kv_heads():
    cfg = qwen397b()
    rows = qkv_rows(cfg, 8)  # 16 key heads: a permutation of the channels
    assert sorted(rows) == list(range(cfg.conv_dim))
    block = rows.reshape(8, -1)[1]  # device 1: key heads 2, 3 (q, then k), value heads 8..15
    kd, hk = cfg.linear_key_head_dim, cfg.linear_num_key_heads
    assert block[0] == 2 * kd and block[2 * kd] == hk * kd + 2 * kd
    assert block[4 * kd] == 2 * hk * kd + 8 * cfg.linear_value_head_dim
    small = dataclasses.replace(cfg, linear_num_key_heads=2, linear_num_value_heads=8)
    rows = qkv_rows(small, 8)  # 2 key heads over 8 devices: each repeated 4 times
    q_of = rows.reshape(8, -1)[:, 0] // kd
    assert list(q_of) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert list(kv_heads(cfg, 8)) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_sharded_cache_implements_the_step_cache_protocol():
    import inspect

    from gdn_jax.models.cache_protocol import StepCache
    from serving.arena_cache import ArenaCache
    from serving.parallel import ShardedArenaCache

    def params(fn):
        return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]

    have = set(dir(ShardedArenaCache)) | {f.name for f in dataclasses.fields(ShardedArenaCache)}
    for name in sorted(StepCache.__protocol_attrs__):
        assert name in have, name
        proto = getattr(StepCache, name, None)
        if callable(proto):
            assert params(getattr(ShardedArenaCache, name)) == params(proto), name
    # and what the engine's programs call beyond the protocol
    for name in ("write_tree_state", "read_tree_state", "flush"):
        assert params(getattr(ShardedArenaCache, name)) == params(getattr(ArenaCache, name))


def test_param_specs():
    from jax.sharding import PartitionSpec as P

    t = "tensor"
    assert param_spec("layers.0.linear_attn.in_proj_qkv.weight", (16, 4), 2) == P(t, None)
    assert param_spec("layers.0.linear_attn.out_proj.weight", (4, 16), 2) == P(None, t)
    assert param_spec("layers.0.linear_attn.A_log", (8,), 2) == P(t)
    assert param_spec("layers.3.self_attn.o_proj.weight", (4, 16), 2) == P(None, t)
    assert param_spec("layers.3.self_attn.q_norm.weight", (16,), 2) == P()
    assert param_spec("layers.0.mlp.gate_proj", (8, 4, 6), 2, expert_parallel=True) == P(
        t, None, None
    )
    assert param_spec("layers.0.mlp.down_proj", (8, 6, 4), 2) == P(None, t, None)
    assert param_spec("layers.0.mlp.shared_expert.down_proj.weight", (4, 6), 2) == P(None, t)
    assert param_spec("layers.0.mlp.gate.weight", (8, 4), 2) == P()
    assert param_spec("embed_tokens", (260, 4), 8) == P()  # 260 does not split by 8
    assert param_spec("embed_tokens", (260, 4), 4) == P(t, None)


if __name__ == "__main__":
    _subprocess_main()
