"""Multi-device layout of the hybrid models: meshes, tensor- and expert-parallel parameter
shardings keyed by parameter path, and the model view whose weights are laid out for them.

Mesh axes: ``data`` (independent engine replicas, each over one row of the mesh) and
``tensor`` (one replica's devices). Within a replica (``tp`` devices on the ``tensor`` axis):

- **attention**: query heads split over ``tensor`` (``q_proj`` rows, ``o_proj`` columns); KV
  heads split too, and where there are fewer KV heads than devices each is repeated so that
  every device holds the one its query heads read (``num_key_value_heads`` becomes ``tp``
  virtual heads, each a copy of ``head * Hkv // tp``: the same attention, exactly);
- **GDN**: value heads split over ``tensor`` together with the key heads they read (the
  ``[q | k | v]`` channels of ``in_proj_qkv`` and ``conv_weight`` reordered so that device
  ``d``'s block is ``[q_d | k_d | v_d]``; fewer key heads than devices are repeated as for
  KV); ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``dt_bias``, ``A_log`` split by value
  head, ``out_proj`` by columns. Tree WY verify and commit are per value head, so a device
  verifies and commits its own heads with no communication;
- **MLP** (dense, and the MoE's shared expert): ``gate_proj``/``up_proj`` rows and
  ``down_proj`` columns, when the intermediate size divides (replicated otherwise);
- **routed experts**: with expert parallelism the experts split over ``tensor`` (each device
  holds ``E / tp`` whole experts; every device sees every token and computes only its own
  experts' pairs, the others dropped (an id past its experts): replicated tokens, no
  all-to-all, about ``M k / tp`` pairs a device under balanced routing); without it, every
  expert's intermediate dimension splits (``gate_proj``/``up_proj`` ``[E, H, I]`` on ``I``,
  ``down_proj`` on its ``I``). Either way the block (routed plus shared expert) ends in one ``psum``
  (:class:`MoEParallel`);
- **embeddings and LM head**: split over the vocabulary when it divides, else replicated;
  norms, the router, the shared-expert gate and the MTP head's ``fc`` are replicated.

Row-parallel projections (``o_proj``, ``out_proj``, ``down_proj``) leave partial sums that
GSPMD reduces once per block; the MoE block reduces inside its ``shard_map``.
:func:`shard_model` builds the view (transformed weights placed with :class:`NamedSharding`);
:func:`local_config` gives the per-device geometry (one device's weights and caches).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gdn_jax.models.config import ModelConfig
from gdn_jax.models.linear import matmul_precision
from gdn_jax.models.model import HybridLM
from gdn_jax.moe import routed_experts

DATA, TENSOR = "data", "tensor"


# ------------------------------------------------------------------------------------ meshes


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None) -> Mesh:
    """A ``(data, tensor)`` mesh over the first ``data * tensor`` of ``devices`` (default:
    ``jax.devices()``, every process's devices after ``jax.distributed.initialize``); row
    ``r`` holds data-parallel replica ``r``'s devices."""
    for name, v in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("data_parallel_size", data_parallel_size),
    ):
        if not isinstance(v, int | np.integer) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    devices = list(jax.devices() if devices is None else devices)
    n = tensor_parallel_size * data_parallel_size
    if n > len(devices):
        raise ValueError(
            f"tensor_parallel_size * data_parallel_size = {tensor_parallel_size} * "
            f"{data_parallel_size} = {n} exceeds the {len(devices)} devices"
        )
    grid = np.array(devices[:n], dtype=object).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, (DATA, TENSOR))


# --------------------------------------------------------------------------------- geometry


def _split_or_repeat(heads: int, tp: int) -> bool:
    """Whether ``heads`` heads go over ``tp`` devices: split (``tp`` divides them) or repeated
    (they divide ``tp``)."""
    return heads % tp == 0 or tp % heads == 0


def _head_errors(config: ModelConfig, split: str, shared: str, tp: int) -> list[str]:
    """Why one layer kind's heads cannot go over ``tp`` devices: the config field ``split``
    (heads split over the devices) and ``shared`` (grouped heads, split or repeated)."""
    out = []
    heads, groups = getattr(config, split), getattr(config, shared)
    if heads % tp:
        out.append(f"{split}={heads} is not a multiple of {tp}")
    if not _split_or_repeat(groups, tp):
        out.append(f"{shared}={groups} neither divides nor is a multiple of {tp}")
    return out


def tensor_parallel_errors(
    config: ModelConfig, tp: int, expert_parallel: bool = False
) -> list[str]:
    """Why ``config`` cannot be split over ``tp`` devices (empty: it can)."""
    out = []
    if config.attn_layers or config.mtp_num_hidden_layers:
        out += _head_errors(config, "num_attention_heads", "num_key_value_heads", tp)
    if config.gdn_layers:
        out += _head_errors(config, "linear_num_value_heads", "linear_num_key_heads", tp)
    if config.num_experts > 0 and tp > 1:
        if expert_parallel and config.num_experts % tp:
            out.append(f"num_experts={config.num_experts} is not a multiple of {tp}")
        if not expert_parallel and config.moe_intermediate_size % tp:
            out.append(
                f"moe_intermediate_size={config.moe_intermediate_size} is not a multiple of "
                f"{tp} (enable_expert_parallel splits whole experts instead)"
            )
    return out


def check_tensor_parallel(config: ModelConfig, tp: int, expert_parallel: bool = False) -> None:
    """``ValueError`` naming ``tensor_parallel_size`` (or ``enable_expert_parallel``) when
    ``config`` cannot be split over ``tp`` devices."""
    if expert_parallel and config.num_experts <= 0:
        raise ValueError("enable_expert_parallel: the model has no routed experts")
    errors = tensor_parallel_errors(config, tp, expert_parallel)
    if errors:
        raise ValueError(f"tensor_parallel_size={tp}: " + "; ".join(errors))


def tp_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config of the tensor-parallel view: fewer KV heads (GDN key heads) than ``tp``
    become ``tp`` repeated virtual heads; everything else as ``config``."""
    kw = {}
    if config.num_key_value_heads < tp:
        kw["num_key_value_heads"] = tp
    if config.gdn_layers and config.linear_num_key_heads < tp:
        kw["linear_num_key_heads"] = tp
    return dataclasses.replace(config, **kw) if kw else config


def _divides(n: int, tp: int) -> bool:
    return n % tp == 0


def local_config(config: ModelConfig, tp: int, *, expert_parallel: bool = False) -> ModelConfig:
    """One device's share of the tensor-parallel view of ``config``: its heads (and so its
    caches), its intermediate sizes, its experts and its vocabulary slice. The arena layout of
    a device is ``layout_for(local_config(...))``; a :class:`HybridLM` of it has exactly one
    device's weights."""
    cfg = tp_config(config, tp)
    if tp == 1:
        return cfg
    kw = dict(
        num_attention_heads=cfg.num_attention_heads // tp,
        num_key_value_heads=cfg.num_key_value_heads // tp,
        linear_num_key_heads=max(cfg.linear_num_key_heads // tp, 1),
        linear_num_value_heads=max(cfg.linear_num_value_heads // tp, 1),
    )
    if cfg.intermediate_size and _divides(cfg.intermediate_size, tp):
        kw["intermediate_size"] = cfg.intermediate_size // tp
    if cfg.num_experts > 0:
        if _divides(cfg.shared_expert_intermediate_size, tp):
            kw["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size // tp
        if expert_parallel:
            kw["num_experts"] = cfg.num_experts // tp
            kw["num_experts_per_tok"] = min(cfg.num_experts_per_tok, kw["num_experts"])
        else:
            kw["moe_intermediate_size"] = cfg.moe_intermediate_size // tp
    if _divides(cfg.vocab_size, tp):
        kw["vocab_size"] = cfg.vocab_size // tp
    return dataclasses.replace(cfg, **kw)


def qkv_rows(config: ModelConfig, tp: int) -> np.ndarray:
    """Rows of ``in_proj_qkv`` / ``conv_weight`` (``[q | k | v]`` channels of ``config``) in
    the tensor-parallel order: device ``d``'s block ``[q_d | k_d | v_d]``, key heads repeated
    where there are fewer than ``tp``."""
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    kd, vd = config.linear_key_head_dim, config.linear_value_head_dim
    hk2 = max(hk, tp)
    rows = []
    for d in range(tp):
        heads = [j * hk // hk2 for j in range(d * hk2 // tp, (d + 1) * hk2 // tp)]
        for part in (0, 1):  # q, then k
            for j in heads:
                start = part * hk * kd + j * kd
                rows.append(np.arange(start, start + kd))
        for h in range(d * hv // tp, (d + 1) * hv // tp):
            start = 2 * hk * kd + h * vd
            rows.append(np.arange(start, start + vd))
    return np.concatenate(rows)


def kv_heads(config: ModelConfig, tp: int) -> np.ndarray:
    """The KV head each of the view's KV heads copies (the identity unless repeated)."""
    hkv = config.num_key_value_heads
    hkv2 = max(hkv, tp)
    return np.array([j * hkv // hkv2 for j in range(hkv2)])


# --------------------------------------------------------------------------- parameter rules


def param_spec(path: str, shape: tuple[int, ...], tp: int, *, expert_parallel: bool = False) -> P:
    """The :class:`PartitionSpec` of the view's parameter ``path`` (dotted, e.g.
    ``layers.0.linear_attn.in_proj_qkv.weight``) of ``shape`` over the ``tensor`` axis
    (module docstring)."""
    if tp == 1:
        return P()
    parts = ["", "", *path.split(".")]
    name = parts[-2] if parts[-1] == "weight" else parts[-1]
    owner = parts[-3] if parts[-1] == "weight" else parts[-2]

    def rows():
        return P(TENSOR, *([None] * (len(shape) - 1))) if shape[0] % tp == 0 else P()

    def cols():
        return P(None, TENSOR) if shape[1] % tp == 0 else P()

    if path in ("embed_tokens", "lm_head.weight"):
        return rows()
    if owner == "linear_attn":
        if name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv_weight"):
            return rows()
        if name in ("dt_bias", "A_log"):
            return rows()
        if name == "out_proj":
            return cols()
        return P()
    if owner == "self_attn":
        if name in ("q_proj", "k_proj", "v_proj"):
            return rows()
        if name == "o_proj":
            return cols()
        return P()
    if len(shape) == 3 and name in ("gate_proj", "up_proj", "down_proj"):  # routed experts
        if expert_parallel:
            return P(TENSOR, None, None)
        return P(None, TENSOR, None) if name == "down_proj" else P(None, None, TENSOR)
    if name in ("gate_proj", "up_proj") and parts[-1] == "weight":  # dense MLP, shared expert
        return rows()
    if name == "down_proj" and parts[-1] == "weight":
        return cols()
    return P()


def _dotted(keypath) -> str:
    """``layers.0.linear_attn.in_proj_qkv.weight`` from a pytree key path of an NNX state (its
    variables' ``value`` dropped) or of its pure dict."""
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in keypath]
    if names and isinstance(keypath[-1], jax.tree_util.GetAttrKey) and names[-1] == "value":
        names.pop()
    return ".".join(names)


def state_shardings(state, sharding):
    """``sharding(path, shape)`` of every parameter of an (abstract) NNX ``state``: the
    ``sharding=`` argument of :func:`gdn_jax.models.init_random`."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: sharding(_dotted(kp), tuple(x.shape)), state
    )


def transform_params(pure: dict, config: ModelConfig, tp: int) -> dict:
    """The view's parameters from ``config``'s (``nnx.to_pure_dict`` form): ``in_proj_qkv``
    and ``conv_weight`` rows reordered (:func:`qkv_rows`), ``k_proj`` / ``v_proj`` heads
    repeated (:func:`kv_heads`); every other array as it is."""
    rows = qkv_rows(config, tp) if config.gdn_layers else None
    heads = kv_heads(config, tp)
    repeat_kv = len(heads) != config.num_key_value_heads
    identity_qkv = rows is None or np.array_equal(rows, np.arange(config.conv_dim))

    def convert(keypath, x):
        path = _dotted(keypath)
        if not identity_qkv and (
            path.endswith("linear_attn.in_proj_qkv.weight")
            or path.endswith("linear_attn.conv_weight")
        ):
            return jnp.take(x, jnp.asarray(rows), axis=0)
        if repeat_kv and (
            path.endswith("self_attn.k_proj.weight") or path.endswith("v_proj.weight")
        ):
            w = x.reshape(config.num_key_value_heads, config.head_dim, -1)
            return jnp.take(w, jnp.asarray(heads), axis=0).reshape(-1, x.shape[-1])
        return x

    return jax.tree_util.tree_map_with_path(convert, pure)


# ------------------------------------------------------------------------------ MoE block


def _linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """:class:`gdn_jax.models.linear.Linear` on a raw weight ``[out, in]``."""
    return jnp.einsum("...i,oi->...o", x.astype(w.dtype), w, precision=matmul_precision(w.dtype))


@dataclasses.dataclass(frozen=True)
class MoEParallel:
    """How a :class:`gdn_jax.models.moe.SparseMoE` runs over the ``axis`` of ``mesh``: its
    routed experts split by expert (``expert_parallel``) or by intermediate dimension, its
    shared expert by intermediate dimension (when it divides), the block ending in one
    ``psum`` (a static module attribute, set by :func:`shard_model`)."""

    mesh: Mesh
    axis: str = TENSOR
    expert_parallel: bool = False

    def __call__(self, moe, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """``routed + sigmoid(gate) * shared`` of ``x [M, H]`` (replicated), in the experts'
        dtype."""
        ax, ep = self.axis, self.expert_parallel
        tp = self.mesh.shape[ax]
        local_experts = moe.num_experts // tp
        se = moe.shared_expert
        shared_w = (se.gate_proj.weight[...], se.up_proj.weight[...], se.down_proj.weight[...])
        split_shared = shared_w[0].shape[0] % tp == 0
        gate = jax.nn.sigmoid(moe.shared_expert_gate(x))
        if ep:
            expert_specs = (P(ax, None, None),) * 3
        else:
            expert_specs = (P(None, None, ax), P(None, None, ax), P(None, ax, None))
        shared_specs = (P(ax, None), P(ax, None), P(None, ax)) if split_shared else (P(),) * 3
        impl = moe.impl

        def local(x, w, e, gate, gw, uw, dw, sg, su, sd):
            if ep:  # this device's experts; the other pairs get an id past them: dropped
                le = e - jax.lax.axis_index(ax) * local_experts
                e = jnp.where((le >= 0) & (le < local_experts), le, local_experts)
            k = e.shape[1]
            if k > gw.shape[0]:  # fewer local experts than picks: one pair per row
                rows = routed_experts(
                    jnp.repeat(x, k, axis=0),
                    w.reshape(-1, 1),
                    e.reshape(-1, 1),
                    gw,
                    uw,
                    dw,
                    impl=impl,
                )
                out = rows.reshape(x.shape[0], k, -1).sum(axis=1)
            else:
                out = routed_experts(x, w, e, gw, uw, dw, impl=impl)
            if split_shared:
                shared = _linear(jax.nn.silu(_linear(x, sg)) * _linear(x, su), sd)
                out = out + gate * shared
            return jax.lax.psum(out, ax)

        out = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(P(), P(), P(), P(), *expert_specs, *shared_specs),
            out_specs=P(),
            check_vma=False,
        )(
            x,
            weights,
            experts,
            gate,
            moe.gate_proj[...],
            moe.up_proj[...],
            moe.down_proj[...],
            *shared_w,
        )
        if not split_shared:
            out = out + gate * se(x)
        return out


# ----------------------------------------------------------------------------- the view


def param_shardings(
    model_or_state, mesh: Mesh, *, expert_parallel: bool = False, axis: str = TENSOR
):
    """A pytree of :class:`NamedSharding` for ``nnx.to_pure_dict`` of a view's state (by
    :func:`param_spec`)."""
    state = model_or_state
    if isinstance(state, nnx.Module):
        state = nnx.state(state)
    pure = nnx.to_pure_dict(state) if not isinstance(state, dict) else state
    tp = mesh.shape[axis]
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: NamedSharding(
            mesh, param_spec(_dotted(kp), tuple(x.shape), tp, expert_parallel=expert_parallel)
        ),
        pure,
    )


def shard_model(model: HybridLM, mesh: Mesh, *, expert_parallel: bool = False) -> HybridLM:
    """The tensor- (and expert-) parallel view of ``model`` over ``mesh``'s ``tensor`` axis:
    a :class:`HybridLM` of :func:`tp_config` whose weights are ``model``'s, transformed
    (:func:`transform_params`) and placed by :func:`param_spec`; its GDN layers split
    ``[q | k | v]`` by device block, its MoE layers run :class:`MoEParallel`. ``model`` is left
    untouched. The same function of the same tokens: tests check greedy tokens against one
    device. A mesh of one device just places the weights there."""
    tp = mesh.shape[TENSOR]
    cfg = model.config
    check_tensor_parallel(cfg, tp, expert_parallel)
    view_cfg = tp_config(cfg, tp)
    dtype = model.embed_tokens[...].dtype
    pure = transform_params(nnx.to_pure_dict(nnx.state(model)), cfg, tp)
    graphdef, state = nnx.split(
        nnx.eval_shape(lambda: HybridLM(view_cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    )
    shardings = param_shardings(pure, mesh, expert_parallel=expert_parallel)
    placed = jax.device_put(pure, shardings)
    nnx.replace_by_pure_dict(state, placed)
    view = nnx.merge(graphdef, state)
    _set_layout(view, mesh, expert_parallel, _impls(model))
    return view


def _impls(model: HybridLM) -> list[str]:
    from gdn_jax.models.gdn import GatedDeltaNet
    from gdn_jax.models.moe import SparseMoE

    return [m.impl for _, m in nnx.iter_graph(model) if isinstance(m, GatedDeltaNet | SparseMoE)]


def _set_layout(view: HybridLM, mesh: Mesh, expert_parallel: bool, impls=None) -> None:
    """The view's static attributes: GDN ``qkv_groups``, MoE :class:`MoEParallel` (and the
    source model's kernel ``impl`` of each layer)."""
    from gdn_jax.models.gdn import GatedDeltaNet
    from gdn_jax.models.moe import SparseMoE

    tp = mesh.shape[TENSOR]
    mods = [m for _, m in nnx.iter_graph(view) if isinstance(m, GatedDeltaNet | SparseMoE)]
    for i, m in enumerate(mods):
        if impls is not None:
            m.impl = impls[i]
        if isinstance(m, GatedDeltaNet):
            m.qkv_groups = tp
        elif tp > 1:
            m.parallel = MoEParallel(mesh, TENSOR, expert_parallel)


def abstract_view(
    config: ModelConfig, mesh: Mesh, dtype=jnp.bfloat16, *, expert_parallel: bool = False
) -> HybridLM:
    """The tensor-parallel view of a ``config`` model with ``jax.ShapeDtypeStruct`` weights
    carrying their shardings: shapes only, for compiling sharded programs without memory."""
    tp = mesh.shape[TENSOR]
    check_tensor_parallel(config, tp, expert_parallel)
    view = nnx.eval_shape(lambda: HybridLM(tp_config(config, tp), dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(view)
    state = jax.tree_util.tree_map_with_path(
        lambda kp, x: jax.ShapeDtypeStruct(
            x.shape,
            x.dtype,
            sharding=NamedSharding(
                mesh, param_spec(_dotted(kp), tuple(x.shape), tp, expert_parallel=expert_parallel)
            ),
        ),
        state,
    )
    view = nnx.merge(graphdef, state)
    _set_layout(view, mesh, expert_parallel)
    return view


def replicate_model(model: HybridLM, mesh: Mesh) -> HybridLM:
    """A view of ``model`` with every weight replicated over ``mesh`` (a model whose heads do
    not split, e.g. a small draft model)."""
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, NamedSharding(mesh, P()))
    return nnx.merge(graphdef, state)
