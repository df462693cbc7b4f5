"""Qwen3.5-397B-A17B over several devices: the collectives of one sharded step, one device's
shard run for real, and the predicted TPOT and throughput on 8 x H200 and a TPU v5p slice.

Three modes (``python -m benchmarks.parallel_397b MODE --help``):

- ``hlo`` (CPU, simulated devices; sets ``--xla_force_host_platform_device_count`` itself):
  compiles the serving engine's decode, verify and commit programs
  (:mod:`serving.runner` over :class:`serving.parallel.ShardedArenaCache`) for 397B cut to one
  layer group (GDN, GDN, GDN, attention) and to two, at TP 8 / EP 8 and TP 16 / EP 16, from
  abstract weights and arenas (no memory), and reads every collective from the compiled HLO:
  kind, payload, group size. One layer group's collectives are the difference of the two
  programs, the rest (embedding, LM head, argmax) is the one-group program's remainder;
- ``shard`` (a GPU): one device's shard at TP 8 / EP 8 run for real: a model of
  :func:`gdn_jax.sharding.local_config` (its heads, its 64 experts, its vocabulary slice, all
  60 layers; random bf16 weights made on the device), served by the engine on one device with
  its arena; plain decoding and a 29-node tree WY step timed at several batch sizes;
- ``table``: the prediction (every assumption printed with it) from the ``hlo`` JSON and,
  where present, the ``shard`` JSON.

With no mode: ``hlo`` then ``table``. JSON goes to ``benchmarks/results/parallel_397b/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import sys
import time
from pathlib import Path

from benchmarks.common import fmt_bytes, load_config, log, markdown_table, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "parallel_397b"
CONFIG = "qwen3_5_397b_a17b"

# ------------------------------------------------------------------------------- assumptions

# Per-device rates. H200: the copy rate and bf16 matmul rate measured on this project's H200
# (benchmarks/README.md: 4.13-4.17 TB/s, 682-714 TFLOP/s); NVLink 4: 900 GB/s per GPU both
# directions together, 450 GB/s each way; NCCL's small-message all-reduce latency on an
# NVSwitch node taken as 10 us. TPU v5p: the spec sheet's 2765 GB/s HBM and 459 TFLOP/s bf16,
# scaled by the fractions the H200 reached (0.86, 0.71); ICI 4800 Gb/s = 600 GB/s per chip over
# its links, of which an all-reduce is taken to use a third (200 GB/s); 5 us per collective.
SYSTEMS = {
    "8 x H200 (TP 8, EP 8)": dict(
        devices=8, hbm=141e9, hbm_bw=4.15e12, flops=700e12, link_bw=450e9, latency=10e-6
    ),
    "TPU v5p, 16 chips (TP 16, EP 16)": dict(
        devices=16,
        hbm=95e9,
        hbm_bw=2.765e12 * 0.86,
        flops=459e12 * 0.71,
        link_bw=200e9,
        latency=5e-6,
    ),
}
CONTEXT = 4096  # tokens each request holds (prompt and output so far)
BATCHES = (1, 16, 64)
TREE = (4, 2, 2)  # the spec step: 29 nodes, depth 3
ACCEPT = 3.0  # mean tokens per tree-WY step taken for the speculative rows
# collectives whose reduction XLA:CPU promoted from bf16 to f32 ("_promoted" reducers) carry
# bf16 on a GPU / TPU: their wire bytes are half the HLO's
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def tree_nodes(tree=TREE) -> int:
    return 1 + sum(math.prod(tree[: i + 1]) for i in range(len(tree)))


# ------------------------------------------------------------------------------ HLO parsing

_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[([0-9,]*)\]")
_BYTES = dict(pred=1, s8=1, u8=1, s16=2, u16=2, bf16=2, f16=2, s32=4, u32=4, f32=4, s64=8,
              u64=8, f64=8)  # fmt: skip


def _group_size(line: str, devices: int) -> int:
    m = re.search(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = {k.strip("' "): int(v) for k, v in (x.split("=") for x in m.group(1).split(","))}
        axes = [a.strip("' ") for a in m.group(2).split(",") if a.strip()]
        return math.prod(sizes[a] for a in axes)
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if m:
        return int(m.group(2))
    return devices


def collectives(hlo: str, devices: int) -> list[dict]:
    """Every collective of a compiled HLO module: kind, HLO bytes (its result), wire bytes
    (bf16 where XLA:CPU promoted a bf16 reduction to f32), group size."""
    out = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(", line)
        if not m or "-done" in line.split("=")[0]:
            continue
        shapes = _SHAPE.findall(m.group(1))
        nbytes = sum(
            _BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in shapes
        )
        promoted = "_promoted" in line and all(t == "f32" for t, _ in shapes)
        out.append(
            dict(
                kind=m.group(2),
                hlo_bytes=nbytes,
                wire_bytes=nbytes // 2 if promoted else nbytes,
                group=_group_size(line, devices),
                shape=m.group(1).split("{")[0],
            )
        )
    return out


def wire_time(c: dict, link_bw: float, latency: float) -> float:
    """Seconds of one collective per device: ring all-reduce ``2 (P-1)/P`` of the payload,
    all-gather / all-to-all / reduce-scatter ``(P-1)/P`` of the larger side, a permute all of
    it, over ``link_bw``, plus ``latency``."""
    p, b = c["group"], c["wire_bytes"]
    if p <= 1:
        return 0.0
    factor = {"all-reduce": 2 * (p - 1) / p, "collective-permute": 1.0}.get(c["kind"], (p - 1) / p)
    if c["kind"] == "reduce-scatter":
        b *= p
    return factor * b / link_bw + latency


def summarize(cs: list[dict]) -> dict:
    kinds: dict = {}
    for c in cs:
        k = kinds.setdefault(c["kind"], dict(count=0, hlo_bytes=0, wire_bytes=0))
        k["count"] += 1
        k["hlo_bytes"] += c["hlo_bytes"]
        k["wire_bytes"] += c["wire_bytes"]
    return kinds


def _minus(a: list[dict], b: list[dict]) -> list[dict]:
    """The collectives of ``a`` not matched (by kind and shape) in ``b``."""
    left = list(b)
    out = []
    for c in a:
        hit = next((x for x in left if x["kind"] == c["kind"] and x["shape"] == c["shape"]), None)
        if hit is None:
            out.append(c)
        else:
            left.remove(hit)
    return out


# ---------------------------------------------------------------------------------- hlo mode


def _cut(cfg, layers: int):
    return dataclasses.replace(
        cfg,
        num_hidden_layers=layers,
        layer_types=cfg.layer_types[:layers],
        mtp_num_hidden_layers=0,
    )


def compile_step(cfg, tp: int, step: str, batch: int, nodes: int, *, ep: bool = True) -> str:
    """The compiled HLO text of one engine program (``decode``, ``verify`` with scratch, or
    ``commit``) of ``cfg`` over ``tp`` devices, from abstract weights and arena."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from gdn_jax.sharding import abstract_view, make_mesh
    from serving.arena_spec import ArenaSpec
    from serving.kernels import XLA_KERNELS
    from serving.memory import layout_for
    from serving.parallel import Placement
    from serving.runner import _arena_decode_program, _arena_programs

    mesh = make_mesh(tp)
    placement = Placement(mesh, expert_parallel=ep, impl="xla")
    graphdef, state = nnx.split(abstract_view(cfg, mesh, jnp.bfloat16, expert_parallel=ep))
    local = placement.local_config(tp_cfg := nnx.merge(graphdef, state).config)
    del tp_cfg
    layout = layout_for(local.to_hf_dict(), 16, spec_nodes=nodes, kv_dtype="bfloat16")
    layout = dataclasses.replace(layout, conv_dtype="bfloat16")
    spec = ArenaSpec.from_layout(layout, jnp.bfloat16, config=local)
    words = max(layout.unit_words(k) for k in ("kv", "state", "stash"))
    rep = NamedSharding(mesh, P())

    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)

    buf = jax.ShapeDtypeStruct(
        (tp, 4 * batch + 8, words), jnp.uint32, sharding=NamedSharding(mesh, P("tensor"))
    )
    pages = 8
    args = (buf, i32(8 * batch * pages + 64, 2), i32(batch), i32(batch, pages), i32(batch))
    if step == "decode":
        prog = _arena_decode_program(graphdef, spec, XLA_KERNELS, placement)
        lowered = prog.lower(state, *args, i32(batch))
    else:
        _, _, verify, commit, _, _ = _arena_programs(graphdef, spec, XLA_KERNELS, "xla", placement)
        if step == "verify":
            lowered = verify.lower(
                state, *args, i32(batch, nodes), i32(batch, nodes), i32(batch), snapshot=False
            )
        else:
            lowered = commit.lower(*args, i32(batch), i32(batch, 4), i32(batch))
    return lowered.compile().as_text()


def hlo_mode(args) -> dict:
    from gdn_jax.models import ModelConfig

    _, raw = load_config(CONFIG)
    cfg = ModelConfig.from_hf_dict(raw)
    nodes = tree_nodes()
    rows = []
    for tp in args.tp:
        for step, batch in (
            [("decode", b) for b in args.batch]
            + [("verify", b) for b in args.spec_batch]
            + [("commit", b) for b in args.spec_batch]
        ):
            t0 = time.perf_counter()
            one = collectives(compile_step(_cut(cfg, 4), tp, step, batch, nodes), tp)
            two = collectives(compile_step(_cut(cfg, 8), tp, step, batch, nodes), tp)
            group = _minus(two, one)
            rest = _minus(one, group)
            log(f"TP {tp} {step} B {batch}: {len(group)} collectives per layer group, "
                f"{len(rest)} outside ({time.perf_counter() - t0:.0f} s)")  # fmt: skip
            rows.append(dict(tp=tp, step=step, batch=batch, nodes=nodes if step != "decode" else 1,
                             per_group=group, outside=rest))  # fmt: skip
    doc = dict(config=CONFIG, layer_groups=cfg.num_hidden_layers // 4, rows=rows)
    print(markdown_table(
        [dict(tp=r["tp"], step=r["step"], batch=r["batch"],
              per_group=", ".join(f"{v['count']} {k} ({fmt_bytes(v['wire_bytes'])})"
                                  for k, v in summarize(r["per_group"]).items()),
              outside=", ".join(f"{v['count']} {k} ({fmt_bytes(v['wire_bytes'])})"
                                for k, v in summarize(r["outside"]).items()))
         for r in rows],
        [("tp", "TP = EP"), "step", ("batch", "B"), ("per_group", "per layer group (wire bytes)"),
         ("outside", "embedding, head, argmax")],
    ))  # fmt: skip
    write_json(args.json or RESULTS / "hlo.json", doc)
    return doc


# -------------------------------------------------------------------------------- shard mode


def random_model(cfg, dtype, seed: int = 0):
    """A model of ``cfg`` with random weights, each made on the device by its own small
    program (no full-model temporaries)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from gdn_jax.models import abstract_model

    graphdef, state = nnx.split(abstract_model(cfg, dtype))
    pure = nnx.to_pure_dict(state)
    keys = iter(jax.random.split(jax.random.key(seed), 100_000))

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def normal(key, shape, dtype):
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    def make(kp, leaf):
        name = str(getattr(kp[-1], "key", kp[-1]))
        if name == "A_log":
            return jnp.log(jnp.linspace(1.0, 16.0, leaf.shape[0], dtype=jnp.float32))
        if name in ("dt_bias",) or (name == "weight" and len(leaf.shape) == 1):
            return jnp.zeros(leaf.shape, leaf.dtype)
        return normal(next(keys), tuple(leaf.shape), leaf.dtype)

    loaded = jax.tree_util.tree_map_with_path(make, pure)
    nnx.replace_by_pure_dict(state, loaded)
    return nnx.merge(graphdef, state)


def shard_config(tp: int = 8, layers: int | None = None, experts: int | None = None):
    """One device's TP ``tp`` / EP ``tp`` shard of 397B (``local_config``), its routed experts
    taking ``ceil(k * E_local / E)`` pairs per token (a device's share of the ``k = 10`` picks
    when routing is balanced)."""
    from gdn_jax.models import ModelConfig
    from gdn_jax.sharding import local_config

    _, raw = load_config(CONFIG)
    cfg = ModelConfig.from_hf_dict(raw)
    loc = local_config(cfg, tp, expert_parallel=True)
    k = math.ceil(cfg.num_experts_per_tok * loc.num_experts / cfg.num_experts)
    loc = dataclasses.replace(loc, num_experts_per_tok=k, mtp_num_hidden_layers=0)
    if experts:
        loc = dataclasses.replace(loc, num_experts=experts, num_experts_per_tok=min(k, experts))
    if layers:
        loc = _cut(loc, layers)
    return cfg, loc


def shard_mode(args) -> dict:
    import gc

    import jax
    import jax.numpy as jnp
    import numpy as np

    from gdn_jax.models import param_count
    from serving import LLM, SamplingParams, SpecConfig

    rows, depths, models, locs = [], {}, {}, {}
    cfg = None
    for layers in args.layers:
        cfg, locs[layers] = shard_config(8, layers, args.experts)
        loc = locs[layers]
        log(f"one device's shard: {loc.num_hidden_layers} layers, {loc.num_experts} experts "
            f"(top-{loc.num_experts_per_tok}), vocab {loc.vocab_size}, {jax.devices()[0]}")  # fmt: skip
        t0 = time.perf_counter()
        models[layers] = random_model(loc, jnp.bfloat16)
        jax.block_until_ready(jax.tree.leaves(models[layers]))
        depths[layers] = param_count(models[layers])
        log(f"{depths[layers] / 1e9:.2f} B parameters ({fmt_bytes(2 * depths[layers])}) in "
            f"{time.perf_counter() - t0:.0f} s")  # fmt: skip

    def doc():
        return dict(
            config=CONFIG,
            device=str(jax.devices()[0]),
            local_config=locs[args.layers[-1]].to_hf_dict(),
            params_by_layers=depths,
            full_layers=cfg.num_hidden_layers,
            context=args.context,
            nodes=tree_nodes(),
            rows=rows,
        )

    rng = np.random.default_rng(0)
    for b in args.batch:  # every depth of a batch before the next batch: a cut run keeps pairs
        for layers in args.layers:
            for method in ("plain", "tree_wy"):
                spec = SpecConfig(method="ngram", tree=TREE) if method == "tree_wy" else None
                llm = LLM(
                    models[layers],
                    args.memory_budget,
                    speculative=spec,
                    max_num_seqs=b,
                    batch_buckets=(b,),
                    max_model_len=args.context + args.tokens + 8,
                    prefill_chunk=args.prefill_chunk,
                    dtype="bfloat16",
                    kernels=args.kernels,
                )
                prompts = [rng.integers(0, 256, args.context).tolist() for _ in range(b)]
                llm.generate(prompts, SamplingParams(max_tokens=4))  # compile, warm
                outs = llm.generate(prompts, SamplingParams(max_tokens=args.tokens))
                tpot = float(np.median([o.metrics["tpot_s"] for o in outs]))
                acc = float(np.mean([o.metrics["mean_acceptance_length"] for o in outs]))
                step = tpot * acc if method == "tree_wy" else tpot
                row = dict(layers=layers, batch=b, method=method, step_s=step, tpot_s=tpot,
                           accept=acc, kernels=getattr(llm.runner, "kernels", "?"))  # fmt: skip
                rows.append(row)
                log(f"{layers} layers, B {b} {method}: step {step * 1e3:.2f} ms")
                write_json(args.json or RESULTS / "shard_h200.json", doc())  # each row kept
                del llm
                gc.collect()
    print(markdown_table(rows, ["layers", "batch", "method", "step_s", "accept", "kernels"]))
    return doc()


def shard_step(shard: dict, batch: int, method: str) -> float | None:
    """The measured step of the whole model from the shard runs: linear in the layer count
    through the two deepest cuts (the engine's fixed per-step cost, embedding and head in the
    intercept); ``None`` without two depths."""
    pts = sorted(
        (r["layers"], r["step_s"])
        for r in shard["rows"]
        if r["batch"] == batch and r["method"] == method
    )
    if len(pts) < 2:
        return None
    (la, ta), (lb, tb) = pts[-2], pts[-1]
    return tb + (tb - ta) / (lb - la) * (shard["full_layers"] - lb)


# -------------------------------------------------------------------------------- the table


def _param_split(cfg, tp: int) -> dict:
    """Bytes per device (bf16) of: the expert weights, the LM head, the rest (by
    ``local_config``; the router is replicated, so counted whole)."""
    from gdn_jax.sharding import local_config

    loc = local_config(cfg, tp, expert_parallel=True)
    h, v = cfg.hidden_size, loc.vocab_size
    la, lg = len(cfg.attn_layers), len(cfg.gdn_layers)
    layers = cfg.num_hidden_layers
    expert = 3 * h * cfg.moe_intermediate_size * 2  # one expert's bytes
    attn = (
        h * loc.num_attention_heads * cfg.head_dim * 2
        + 2 * h * loc.num_key_value_heads * cfg.head_dim
        + loc.num_attention_heads * cfg.head_dim * h
    )
    conv = 2 * loc.linear_num_key_heads * cfg.linear_key_head_dim + (
        loc.linear_num_value_heads * cfg.linear_value_head_dim
    )
    gdn = h * (conv + loc.linear_num_value_heads * (cfg.linear_value_head_dim + 2)) + (
        loc.linear_num_value_heads * cfg.linear_value_head_dim * h
    )
    shared = 3 * h * loc.shared_expert_intermediate_size
    router = cfg.num_experts * h
    rest = (la * attn + lg * gdn + layers * (shared + router + 2 * h)) * 2
    return dict(
        expert_bytes=expert,
        local_experts=loc.num_experts * layers,
        experts_per_layer=loc.num_experts,
        head=v * h * 2,
        embed=v * h * 2,
        rest=rest,
        total=loc.num_experts * layers * expert + 2 * v * h * 2 + rest,
        local=loc,
    )


def _cache_bytes(cfg, loc, batch: int, context: int) -> dict:
    state = (
        len(cfg.gdn_layers)
        * loc.linear_num_value_heads
        * (cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4)
    )
    kv = len(cfg.attn_layers) * context * loc.num_key_value_heads * cfg.head_dim * 2 * 2
    return dict(state=batch * state, kv=batch * kv)


def predict(cfg, system: dict, hlo_rows: list[dict], groups: int, batch: int, step: str,
            shard: dict | None) -> dict:  # fmt: skip
    """One row of the table: per-device bytes and FLOPs of one step, its floor, the
    collectives' time, the predicted TPOT and throughput."""
    tp = system["devices"]
    p = _param_split(cfg, tp)
    loc = p["local"]
    n = tree_nodes() if step == "tree_wy" else 1
    tokens = batch * n
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    touched = p["experts_per_layer"] * (1 - (1 - k / e) ** tokens)  # uniform routing
    weights = p["rest"] + p["head"] + cfg.num_hidden_layers * touched * p["expert_bytes"]
    cache = _cache_bytes(cfg, loc, batch, CONTEXT)
    # decode: states read and written, KV read; tree WY: verify reads the states and the KV,
    # commit reads and writes the states (the scratch's U, keys, decays are small)
    state_passes = 3 if step == "tree_wy" else 2
    moved = weights + state_passes * cache["state"] + cache["kv"]
    active = 17e9  # parameters per token (A17B)
    attn_flops = len(cfg.attn_layers) * 4 * CONTEXT * cfg.num_attention_heads * cfg.head_dim
    flops = 2 * tokens * (active + attn_flops / 2) / tp
    floor = max(moved / system["hbm_bw"], flops / system["flops"])
    rows = [r for r in hlo_rows if r["tp"] == tp]
    wire = 0.0
    wire_bytes = 0
    parts = ("decode",) if step == "plain" else ("verify", "commit")
    for part in parts:
        hb = batch if part == "decode" else None
        cands = [r for r in rows if r["step"] == part]
        if not cands:
            return {}
        r = (
            min(cands, key=lambda r: abs(r["batch"] - batch))
            if hb is None
            else min(cands, key=lambda r: abs(r["batch"] - batch))
        )
        scale = batch / r["batch"]  # payloads grow with the batch (checked over the HLO rows)
        for c, times in [(c, groups) for c in r["per_group"]] + [(c, 1) for c in r["outside"]]:
            c2 = dict(c, wire_bytes=c["wire_bytes"] * scale)
            wire += times * wire_time(c2, system["link_bw"], system["latency"])
            wire_bytes += times * c2["wire_bytes"]
    step_s = floor + wire
    measured = None
    if shard and tp == 8:
        local = shard_step(shard, batch, step)
        measured = None if local is None else local + wire
    tokens_per_step = ACCEPT if step == "tree_wy" else 1.0
    fits = p["total"] + cache["state"] * 2 + cache["kv"] < system["hbm"]
    out = dict(
        batch=batch,
        step=step,
        weights_gb=weights / 1e9,
        cache_gb=(state_passes * cache["state"] + cache["kv"]) / 1e9,
        floor_ms=floor * 1e3,
        wire_mb=wire_bytes / 1e6,
        wire_ms=wire * 1e3,
        tpot_ms=step_s / tokens_per_step * 1e3,
        tok_s=batch * tokens_per_step / step_s,
        fits="yes" if fits else "no",
        weights_per_device_gb=p["total"] / 1e9,
    )
    if measured is not None:
        out["tpot_measured_ms"] = measured / tokens_per_step * 1e3
        out["tok_s_measured"] = batch * tokens_per_step / measured
    return out


ASSUMPTIONS = f"""Assumptions:
- weights bf16; one device holds 1/P of every head-split weight (attention, GDN, shared
  expert, LM head and embedding by vocabulary), E/P whole experts (EP = TP), the router whole;
- a step reads the weights it touches once: all non-expert weights, the LM head, and the
  experts its tokens route to, taken uniform (top-{10} of 512 per token: a device touches
  E/P x (1 - (1 - k/E)^T) experts for T tokens); real routing is skewed (fewer distinct
  experts, more imbalance);
- caches: every request holds {CONTEXT} tokens; a decode step reads and writes each GDN
  state (f32) and reads the KV; a tree-WY step (verify + commit, {tree_nodes()} nodes, tree
  {TREE}) reads the states twice and writes them once; the MTP drafting is not counted;
- FLOPs: 2 x 17e9 active parameters per token plus attention over the context, split over P;
- floor = max(bytes / HBM rate, FLOPs / matmul rate) per device; collectives do not overlap
  compute and add their time: from the compiled HLO of the engine's programs (one layer
  group's collectives x 15 layer groups, plus the embedding / head / argmax ones), payloads
  scaled linearly with the batch from the nearest compiled batch, ring all-reduce
  2 (P-1)/P x bytes / link rate + latency each;
- tree WY rows: {ACCEPT} tokens per step (acceptance is the drafter's, not measured here);
- H200: {SYSTEMS["8 x H200 (TP 8, EP 8)"]["hbm_bw"] / 1e12:.2f} TB/s and
  {SYSTEMS["8 x H200 (TP 8, EP 8)"]["flops"] / 1e12:.0f} TFLOP/s (measured on this project's
  H200), NVLink 450 GB/s per direction, 10 us per collective; TPU v5p: 2765 GB/s x 0.86 and
  459 TFLOP/s x 0.71 (the H200's measured fractions of its peaks), 200 GB/s of ICI per
  all-reduce (a third of 4800 Gb/s), 5 us per collective; 16 chips since 8 x 95 GB do not hold
  the 794 GB of weights;
- "measured" columns: one H200 running one device's shard (``shard`` mode: the engine with
  its arena and kernels, cut to 4 and 8 layers and extrapolated linearly to 60, so the
  engine's fixed per-step cost is counted once) in place of the floor, plus the same
  collective time; its routed experts take ceil(10 x 64 / 512) = 2 pairs per token (a
  device's share when routing is balanced; under expert parallelism a device computes only
  the pairs of its own experts and drops the others).
"""


def table_mode(args) -> dict:
    import json

    from gdn_jax.models import ModelConfig

    _, raw = load_config(CONFIG)
    cfg = ModelConfig.from_hf_dict(raw)
    hlo = json.loads(Path(args.hlo or RESULTS / "hlo.json").read_text())
    shard_path = Path(args.shard or RESULTS / "shard_h200.json")
    shard = json.loads(shard_path.read_text()) if shard_path.exists() else None
    out = []
    for name, system in SYSTEMS.items():
        for step in ("plain", "tree_wy"):
            for b in BATCHES:
                row = predict(cfg, system, hlo["rows"], hlo["layer_groups"], b, step, shard)
                if row:
                    out.append(dict(system=name, **row))
    cols = [
        "system",
        ("batch", "B"),
        "step",
        ("weights_gb", "weights read / dev (GB)"),
        ("cache_gb", "cache moved / dev (GB)"),
        ("floor_ms", "HBM/FLOP floor (ms)"),
        ("wire_mb", "collective payload (MB)"),
        ("wire_ms", "collectives (ms)"),
        ("tpot_ms", "TPOT (ms)"),
        ("tok_s", "tok/s"),
    ]
    if any("tpot_measured_ms" in r for r in out):
        cols += [
            ("tpot_measured_ms", "TPOT, measured shard (ms)"),
            ("tok_s_measured", "tok/s, measured shard"),
        ]
    cols += [("fits", "fits")]
    print(markdown_table(out, cols))
    print()
    print(ASSUMPTIONS)
    if not any("tpot_measured_ms" in r for r in out):
        print(
            f"(no two-depth {shard_path.name}: run `python -m benchmarks.parallel_397b shard` "
            "on an H200 for the measured columns)"
        )
    doc = dict(config=CONFIG, systems=SYSTEMS, context=CONTEXT, tree=TREE, accept=ACCEPT,
               assumptions=ASSUMPTIONS, rows=out, shard=bool(shard))  # fmt: skip
    write_json(args.json or RESULTS / "table.json", doc)
    return doc


# -------------------------------------------------------------------------------------- main


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("mode", nargs="?", default="all", choices=("all", "hlo", "shard", "table"))
    p.add_argument("--tp", type=_ints, default=[8, 16], help="hlo: TP = EP sizes (8,16)")
    p.add_argument(
        "--batch", type=_ints, default=None, help="decode batches (hlo: 1,64; shard: 1,16,64)"
    )
    p.add_argument("--spec-batch", type=_ints, default=[16], help="hlo: tree-WY batches (16)")
    p.add_argument("--context", type=int, default=1024, help="shard: prompt tokens (1024)")
    p.add_argument("--tokens", type=int, default=32, help="shard: generated tokens (32)")
    p.add_argument("--prefill-chunk", type=int, default=256, help="shard: prefill chunk (256)")
    p.add_argument("--memory-budget", type=int, default=None, help="shard: arena bytes")
    p.add_argument("--kernels", default="auto", help="shard: LLM(kernels=) (auto)")
    p.add_argument(
        "--layers", type=_ints, default=[4, 8], help="shard: layer cuts, extrapolated to 60 (4,8)"
    )
    p.add_argument(
        "--experts", type=int, default=None, help="shard: local experts (64; a CPU smoke run)"
    )
    p.add_argument("--hlo", default=None, help="table: the hlo JSON")
    p.add_argument("--shard", default=None, help="table: the shard JSON")
    p.add_argument("--json", default=None, help="where the mode's JSON goes")
    args = p.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.mode in ("all", "hlo"):
        n = max(args.tp)
        flag = f"--xla_force_host_platform_device_count={n}"
        if "jax" in sys.modules:
            raise SystemExit("parallel_397b hlo: jax must not be imported before the flag is set")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        args.batch = args.batch or [1, 64]
        hlo_mode(args)
        args.json = None
    if args.mode == "shard":
        args.batch = args.batch or list(BATCHES)
        shard_mode(args)
    if args.mode in ("all", "table"):
        table_mode(args)


if __name__ == "__main__":
    main()
