"""HF checkpoint loading: layouts (multimodal prefix, sharded, bf16, MTP) and clear errors."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.models import CheckpointError, ModelConfig, from_pretrained
from gdn_jax.models.safetensors_io import Checkpoint, write_safetensors

forward_j = nnx.jit(lambda model, ids: model(ids))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def dense(hf_models):
    return hf_models("qwen3_5_text")


def rewrite(src, dst, *, rename=lambda k: k, drop=(), reshape=None, config=None, shards=1):
    """A copy of checkpoint ``src`` with tensors renamed / dropped / reshaped, optionally split
    into ``shards`` files with an index."""
    dst.mkdir()
    ckpt = Checkpoint(src)
    tensors = {rename(k): np.array(ckpt.get(k)) for k in ckpt.names() if k not in drop}
    for name, shape in (reshape or {}).items():
        tensors[name] = np.zeros(shape, tensors[name].dtype)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        write_safetensors(dst / fname, {k: tensors[k] for k in part})
        weight_map.update({k: fname for k in part})
    if shards > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    conf = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(conf) if config else conf))
    return dst


def test_multimodal_prefix_and_sharded_index(dense, tmp_path):
    ckpt, inputs, ref = dense

    def rename(k):
        return k if k.startswith(("lm_head", "mtp.")) else "model.language_model." + k[6:]

    def nest(conf):
        return {
            "model_type": "qwen3_5",
            "tie_word_embeddings": False,
            "text_config": conf,
            "vision_config": {"depth": 1},
        }

    d = rewrite(ckpt, tmp_path / "mm", rename=rename, config=nest, shards=3)
    write_safetensors(
        d / "visual.safetensors", {"model.visual.patch.weight": np.ones(3, np.float32)}
    )
    model = from_pretrained(d, dtype=jnp.float32)
    assert model.config.weight_prefix == "model.language_model."
    assert rel_err(forward_j(model, jnp.asarray(inputs["ids"])), ref["logits"]) < 1e-4


def test_bf16_checkpoint(dense):
    ckpt, inputs, ref = dense
    model = from_pretrained(ckpt / "bf16", dtype=jnp.bfloat16)
    assert model.embed_tokens[...].dtype == jnp.bfloat16
    assert model.layers[0].linear_attn.A_log[...].dtype == jnp.float32
    f32 = Checkpoint(ckpt).get("model.layers.0.linear_attn.in_proj_qkv.weight")
    np.testing.assert_array_equal(  # bf16 bits read exactly
        np.asarray(model.layers[0].linear_attn.in_proj_qkv.weight[...], np.float32),
        np.asarray(jnp.asarray(f32).astype(jnp.bfloat16), np.float32),
    )
    logits = forward_j(model, jnp.asarray(inputs["ids"])).astype(jnp.float32)
    assert rel_err(logits, ref["logits"]) < 0.15  # bf16 weights and compute


def test_mtp_optional(dense):
    ckpt, _, _ = dense
    assert from_pretrained(ckpt, dtype=jnp.float32).mtp is not None
    model = from_pretrained(ckpt, dtype=jnp.float32, mtp=False)
    assert model.mtp is None and model.config.mtp_num_hidden_layers == 0


def test_missing_tensor(dense, tmp_path):
    ckpt, _, _ = dense
    name = "model.layers.1.self_attn.k_norm.weight"
    d = rewrite(ckpt, tmp_path / "missing", drop=(name,))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.self_attn.k_norm"):
        from_pretrained(d, dtype=jnp.float32)


def test_misshapen_tensor(dense, tmp_path):
    ckpt, _, _ = dense
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    d = rewrite(ckpt, tmp_path / "bad", reshape={name: (7, 32)})
    with pytest.raises(CheckpointError, match=r"in_proj_qkv.weight.*shape \(7, 32\), expected"):
        from_pretrained(d, dtype=jnp.float32)


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ValueError, match="model_type: unsupported 'llama'"):
        from_pretrained(tmp_path)


def test_missing_files(tmp_path, dense):
    shutil.copy(dense[0] / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        from_pretrained(tmp_path)


def test_qwen3_next_grouped_layout_is_split(hf_models):
    """The loaded in_proj_qkv / z / b / a reproduce HF's fix_query_key_value_ordering."""
    ckpt, _, _ = hf_models("qwen3_next")
    cfg = ModelConfig.from_json(ckpt)
    raw = Checkpoint(ckpt)
    model = from_pretrained(ckpt, dtype=jnp.float32, mtp=False)
    gdn = model.layers[0].linear_attn
    x = np.random.default_rng(0).standard_normal((3, cfg.hidden_size)).astype(np.float32)
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // hk
    qkvz = (x @ raw.get("model.layers.0.linear_attn.in_proj_qkvz.weight").T).reshape(3, hk, -1)
    q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
    v, z = qkvz[..., 2 * dk : 2 * dk + r * dv], qkvz[..., 2 * dk + r * dv :]
    want = np.concatenate([q.reshape(3, -1), k.reshape(3, -1), v.reshape(3, -1)], -1)
    np.testing.assert_allclose(gdn.in_proj_qkv(x), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gdn.in_proj_z(x), z.reshape(3, -1), rtol=1e-5, atol=1e-5)
    ba = (x @ raw.get("model.layers.0.linear_attn.in_proj_ba.weight").T).reshape(3, hk, 2 * r)
    np.testing.assert_allclose(gdn.in_proj_b(x), ba[..., :r].reshape(3, -1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gdn.in_proj_a(x), ba[..., r:].reshape(3, -1), rtol=1e-5, atol=1e-5)
