"""HF checkpoint -> :class:`HybridLM`: name mapping, layout conversion, shape checks.

Every NNX parameter has one source: HF tensor names, the HF shapes expected for them, and a
conversion to our layout. Conversions: Qwen3-Next's per-key-head grouped ``in_proj_qkvz`` /
``in_proj_ba`` are split into ``in_proj_qkv | in_proj_z`` / ``in_proj_b | in_proj_a`` (the
Qwen3.5 layout); ``conv1d.weight [C, 1, W] -> [C, W]``; routed experts (per-expert
``experts.{e}.{gate,up,down}_proj.weight`` or fused ``experts.gate_up_proj`` /
``experts.down_proj``) are stacked input-major for ``ragged_dot``. The model is built abstractly
(``nnx.eval_shape``) and each tensor is copied to the device once, in the requested dtype.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax.models.config import ModelConfig
from gdn_jax.models.model import HybridLM
from gdn_jax.models.safetensors_io import Checkpoint, CheckpointError

F32_PARAMS = ("A_log", "dt_bias")  # kept in f32 whatever the model dtype (HF computes g in f32)


def load_config(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of a ``config.json`` (a file, or a directory holding one).

    Raises ``FileNotFoundError`` when there is no such file and ``ValueError`` naming the file
    when it is not a JSON object or not a supported config."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such file")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    try:
        return ModelConfig.from_hf_dict(raw)
    except KeyError as e:
        raise ValueError(f"{file}: missing key {e}") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"{file}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Source:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    convert: Callable[..., np.ndarray]


def _direct(name: str, shape: tuple[int, ...]) -> Source:
    return Source((name,), (tuple(shape),), lambda x: x)


def _gdn_split(cfg: ModelConfig, lp: str, part: str) -> Source:
    """Qwen3-Next grouped projections: rows ``[Hk, (q K | k K | v rV | z rV)]`` and
    ``[Hk, (b r | a r)]`` with ``r = Hv / Hk``."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // hk
    h = cfg.hidden_size
    if part in ("qkv", "z"):
        name = lp + "linear_attn.in_proj_qkvz.weight"
        shape = (hk * (2 * dk + 2 * r * dv), h)

        def convert(w):
            w = w.reshape(hk, 2 * dk + 2 * r * dv, h)
            q, k = w[:, :dk], w[:, dk : 2 * dk]
            v, z = w[:, 2 * dk : 2 * dk + r * dv], w[:, 2 * dk + r * dv :]
            if part == "z":
                return z.reshape(-1, h)
            return np.concatenate([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)])
    else:
        name = lp + "linear_attn.in_proj_ba.weight"
        shape = (2 * hk * r, h)
        sl = slice(0, r) if part == "b" else slice(r, 2 * r)

        def convert(w):
            return w.reshape(hk, 2 * r, h)[:, sl].reshape(-1, h)

    return Source((name,), (shape,), convert)


def _experts(cfg: ModelConfig, ckpt: Checkpoint, lp: str, which: str) -> Source:
    e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    fused = lp + "mlp.experts.gate_up_proj"
    if fused in ckpt:
        if which == "down_proj":
            return Source(
                (lp + "mlp.experts.down_proj",), ((e, h, i),), lambda w: np.swapaxes(w, 1, 2)
            )
        sl = slice(0, i) if which == "gate_proj" else slice(i, 2 * i)
        return Source((fused,), ((e, 2 * i, h),), lambda w: np.swapaxes(w[:, sl], 1, 2))
    names = tuple(f"{lp}mlp.experts.{j}.{which}.weight" for j in range(e))
    shape = (h, i) if which == "down_proj" else (i, h)
    return Source(names, (shape,) * e, lambda *ws: np.swapaxes(np.stack(ws), 1, 2))


def source_for(cfg: ModelConfig, ckpt: Checkpoint, path: str, shape: tuple[int, ...]) -> Source:
    """The checkpoint source of our parameter ``path`` (dotted) of shape ``shape``."""
    pre = cfg.weight_prefix
    if path == "embed_tokens":
        return _direct(pre + "embed_tokens.weight", shape)
    if path == "norm.weight":
        return _direct(pre + "norm.weight", shape)
    if path == "lm_head.weight":
        return _direct("lm_head.weight", shape)
    m = re.fullmatch(r"(mtp\.)?layers\.(\d+)\.(.+)", path)
    if m is None:
        return _direct(path, shape)  # mtp.fc.weight, mtp.norm.weight, mtp.pre_fc_norm_*
    lp = f"mtp.layers.{m[2]}." if m[1] else f"{pre}layers.{m[2]}."
    rest = m[3]
    if rest == "linear_attn.conv_weight":
        return Source(
            (lp + "linear_attn.conv1d.weight",), ((shape[0], 1, shape[1]),), lambda w: w[:, 0, :]
        )
    if cfg.model_type == "qwen3_next":
        part = re.fullmatch(r"linear_attn\.in_proj_(qkv|z|b|a)\.weight", rest)
        if part:
            return _gdn_split(cfg, lp, part[1])
    if rest in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        return _experts(cfg, ckpt, lp, rest.split(".")[1])
    return _direct(lp + rest, shape)


def _fetch(ckpt: Checkpoint, src: Source) -> np.ndarray:
    for name, shape in zip(src.names, src.shapes, strict=True):
        if name not in ckpt:
            raise CheckpointError(f"missing tensor {name!r} in {ckpt.directory}")
        if ckpt.shape(name) != shape:
            raise CheckpointError(
                f"tensor {name!r} in {ckpt.directory} has shape {ckpt.shape(name)}, "
                f"expected {shape}"
            )
    return src.convert(*(ckpt.get(n) for n in src.names))


def _dotted(keypath) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)


def from_pretrained(
    path_or_dir: str | Path,
    dtype=jnp.bfloat16,
    *,
    mtp: bool | None = None,
    sharding: Callable[[str, jax.ShapeDtypeStruct], jax.sharding.Sharding | None] | None = None,
) -> HybridLM:
    """Loads an HF directory (``config.json`` + safetensors) into a :class:`HybridLM`.

    ``mtp``: load the MTP head (``True``), skip it (``False``), or load it when the checkpoint
    has ``mtp.*`` tensors (``None``). ``sharding(path, abstract)`` may give each parameter's
    sharding. Only local directories load (a hub id must be downloaded first). Raises
    ``FileNotFoundError`` for a missing directory, ``config.json`` or weights,
    :class:`CheckpointError` for an unreadable weight file or a missing or misshapen tensor,
    and ``ValueError`` naming the file for a malformed config or an unsupported ``model_type``.
    """
    directory = Path(path_or_dir)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{directory}: no such directory; only local directories load (download a hub "
            "checkpoint first and pass its directory)"
        )
    cfg = load_config(directory)
    ckpt = Checkpoint(directory)
    has_mtp = "mtp.fc.weight" in ckpt
    if mtp is None:
        mtp = has_mtp and cfg.mtp_num_hidden_layers > 0
    cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=cfg.mtp_num_hidden_layers if mtp else 0)
    if mtp and cfg.mtp_num_hidden_layers == 0:
        raise ValueError("mtp: True, but the config has no mtp_num_hidden_layers")

    abstract = nnx.eval_shape(lambda: HybridLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)

    def load(keypath, leaf: jax.ShapeDtypeStruct) -> jax.Array:
        path = _dotted(keypath)
        src = source_for(cfg, ckpt, path, leaf.shape)
        arr = _fetch(ckpt, src)
        if arr.shape != leaf.shape:
            raise CheckpointError(f"{path}: converted shape {arr.shape} != expected {leaf.shape}")
        target = jnp.float32 if path.rsplit(".", 1)[-1] in F32_PARAMS else leaf.dtype
        out = jax.device_put(np.asarray(arr), sharding(path, leaf) if sharding else None)
        return out.astype(target)

    loaded = jax.tree_util.tree_map_with_path(load, pure)
    nnx.replace_by_pure_dict(state, loaded)
    return nnx.merge(graphdef, state)
