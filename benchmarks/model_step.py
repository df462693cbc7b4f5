"""The whole model's serving steps at real scale, each against its floor, in one run.

    python -m benchmarks.model_step [--config qwen3_5_35b_a3b] [--layers 40]
                                    [--batch 1,16,64,256] [--context 512]
                                    [--tree-sizes 29,64] [--verify-batch 16]
                                    [--prefill-len 4096] [--prefill-prompts 4]
                                    [--kernels auto] [--routing balanced|model]
                                    [--reps 20] [--json out.json]
    python -m benchmarks.model_step --smoke          # tiny dims, CPU, seconds

The model (random weights, built on the device in ``--dtype``) is served by the engine
(:class:`serving.LLM`, arena cache, ``--kernels``) and its step programs are timed on rows that
the engine itself prefilled:

- ``decode``: the plain decode step (``ArenaRunner.decode``: every layer, the LM head and the
  argmax in one program) on ``B`` rows of ``--context`` tokens, for each ``B`` in ``--batch``;
- ``verify N``: the target's tree verify of ``N`` nodes (random trees, tree WY, the arena only
  read) on ``--verify-batch`` rows, for each ``N`` in ``--tree-sizes``, and its ratio to the
  decode step at the same batch;
- ``prefill``: ``--prefill-prompts`` prompts of ``--prefill-len`` tokens through
  ``LLM.generate`` (one token each, the prompts' rows a batch bucket of their own), in tokens
  per second; and ``prefill step``: the engine's prefill program alone on the step of that run
  with the most rows (its live tokens over its time).

The MoE layers route by ``--routing``: ``balanced`` by default (:func:`gdn_jax.moe.balanced_route`:
each row's experts drawn as under uniform routing, the router's matmul and weights kept),
because random weights route most rows to a few experts once the context averages dominate the
residual stream, so the expert kernels would read fewer bytes than a served model's do (and a
step could run under its floor); ``model`` takes the random router's own top-k.

Every row has its floor: the bytes the step must move (every dense weight, the LM head, the
expected distinct experts under uniform routing, the embedding rows (the MTP head, unused by
these steps, is not counted), the GDN states read and
written, the KV read) over the HBM bandwidth measured in the same run, or its FLOPs (2 per
active weight per token) over the measured bf16 matmul rate where that is larger. Times are
medians of ``--reps`` calls, each blocked on its outputs and the arena, the previous call's
outputs released first as the engine releases them (decode rows also time the calls with them
held: ``held_ms``, the CUDA graph then re-recorded before each run; and ``pipelined_ms``: steps
run back to back, each fed the previous one's argmax on the device and dispatched before it
ends, the host's work overlapping the device's as an engine with asynchronous scheduling
would). Each decode row records whether the step's logits are all ``finite``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import (  # noqa: E402
    add_decode_kernel_switches,
    apply_decode_kernel_switches,
    fmt_bytes,
    frees_deferred,
    ints,
    load_config,
    log,
    markdown_table,
    write_json,
)
from benchmarks.kernel_profile import profile as profile_kernels  # noqa: E402
from benchmarks.layers import SMOKE, random_parents  # noqa: E402
from benchmarks.timing import measure_bandwidth, measure_matmul  # noqa: E402
from gdn_jax.models.config import FULL  # noqa: E402
from gdn_jax.models.model import set_moe_routing  # noqa: E402
from serving.llm import LLM, load_model  # noqa: E402
from serving.params import SamplingParams  # noqa: E402

AUTO_HEADROOM = 12 << 30  # bytes of device memory left to activations


@dataclasses.dataclass(frozen=True)
class Weights:
    """Bytes of the model's parameters by how a step reads them."""

    dense: int  # read whole by every step (projections, norms, router, shared expert, LM head)
    expert: int  # one routed expert's three projections, all MoE layers
    embed_row: int  # one row of the input embedding
    num_experts: int
    top_k: int
    active_params: int  # parameters one token multiplies with (dense + top_k experts, no embed)


def weight_bytes(model, cfg) -> Weights:
    dense = expert_all = embed = 0
    for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = [str(p) for p in path]
        size = leaf.get_value().size * leaf.get_value().dtype.itemsize
        if "mtp" in names:  # the MTP head: not part of a plain or verify step
            continue
        if names[-1] in ("gate_proj", "up_proj", "down_proj") and leaf.get_value().ndim == 3:
            expert_all += size
        elif "embed" in "/".join(names):
            embed += size
        else:
            dense += size
    e = max(cfg.num_experts, 1)
    itemsize = jnp.dtype(model_dtype(model)).itemsize
    active = (dense + expert_all * cfg.num_experts_per_tok // e) // itemsize
    return Weights(
        dense=dense,
        expert=expert_all // e,
        embed_row=embed // cfg.vocab_size,
        num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_tok,
        active_params=active,
    )


def model_dtype(model):
    return nnx.to_flat_state(nnx.state(model, nnx.Param))[0][1].get_value().dtype


def touched(w: Weights, tokens: int) -> float:
    """Expected distinct experts per MoE layer for ``tokens`` tokens under uniform routing."""
    if w.num_experts == 0:
        return 0.0
    return w.num_experts * (1 - (1 - w.top_k / w.num_experts) ** tokens)


def cache_bytes(cfg, rows: int, context: int, new_tokens: int, write_state: bool) -> int:
    """GDN states (f32, read, and written when ``write_state``) and conv windows, and the KV
    of ``context`` tokens read plus ``new_tokens`` written, for ``rows`` rows."""
    n_full = sum(t == FULL for t in cfg.layer_types)
    n_gdn = cfg.num_hidden_layers - n_full
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + (
        cfg.linear_num_value_heads * cfg.linear_value_head_dim
    )
    conv = conv_dim * (cfg.linear_conv_kernel_dim - 1) * 2
    gdn = n_gdn * (state + conv) * (2 if write_state else 1)
    kv = n_full * 2 * cfg.num_key_value_heads * cfg.head_dim * 2 * (context + new_tokens)
    return rows * (gdn + kv)


def floor_s(w: Weights, cfg, rows, context, tokens_per_row, write_state, bw, flops) -> dict:
    tokens = rows * tokens_per_row
    weights = w.dense + touched(w, tokens) * w.expert
    weights += tokens * w.embed_row
    nbytes = weights + cache_bytes(cfg, rows, context, tokens_per_row, write_state)
    f = 2.0 * w.active_params * tokens
    mem_s, compute_s = nbytes / bw, f / flops
    return dict(
        floor_bytes=nbytes,
        floor_flops=f,
        floor_ms=1e3 * max(mem_s, compute_s),
        bound="compute" if compute_s > mem_s else "memory",
    )


class _Capture:
    """Wraps a runner method and keeps the arguments of its call with the most rows."""

    def __init__(self, inner):
        self.inner, self.args, self.rows = inner, None, -1

    def __call__(self, *a, **k):
        rows = int((np.asarray(a[0]) >= 0).sum())
        if rows >= self.rows:
            self.args, self.rows = (a, k), rows
        return self.inner(*a, **k)


def median_ms(fn, reps: int, block, release: bool = True) -> tuple[float, float]:
    """Median ms of ``fn()`` blocked on its outputs, and median ms until ``fn`` returned (the
    host's dispatch of the program). The previous call's outputs are released before the next
    call (as the engine does: it reads a step's tokens, then drops its outputs), or kept alive
    while it is dispatched when ``not release``: then the step's output buffers land elsewhere
    each call and XLA re-records the CUDA graph's commands that touch them, on the host."""
    block(fn())
    block(fn())
    ts, ds = [], []
    out = None
    for _ in range(reps):
        if release:
            out = None
        t = time.perf_counter()
        out = fn()
        ds.append(1e3 * (time.perf_counter() - t))
        block(out)
        ts.append(1e3 * (time.perf_counter() - t))
    return float(np.median(ts)), float(np.median(ds))


def pipelined_ms(runner, handles, pages, lengths, last, steps: int, block) -> float:
    """Milliseconds per decode step when ``steps`` steps run back to back, each fed the previous
    step's argmax tokens on the device and dispatched without waiting for it (the host's work
    for step t+1 overlapping step t on the device), blocked once at the end. Every step rewrites
    the same positions of the same rows, as the timed calls above do."""
    tok = jnp.asarray(last)
    for _ in range(2):
        tok = runner.decode(handles, pages, lengths, tok)[1]
    block(tok)
    t = time.perf_counter()
    for _ in range(steps):
        tok = runner.decode(handles, pages, lengths, tok)[1]
    block(tok)
    return 1e3 * (time.perf_counter() - t) / steps


def finite_logits(out) -> bool:
    """Whether a decode step's logits (its first output) are all finite: a step whose
    hidden state went NaN times arithmetic on garbage (and its routing is no model's)."""
    return bool(jnp.isfinite(out[0]).all())


def decode_rows(llm: LLM, batch: int, context: int, rng) -> tuple:
    """``(handles, pages, lengths, release)`` of ``batch`` rows the engine prefilled with
    ``context`` random tokens (captured from its decode call with the most rows). The rows'
    arena memory stays held after ``generate`` finishes them, so that their handles still map
    their states and KV pages, until ``release()`` frees it."""
    runner = llm.engine.runner
    manager = llm.engine.sched.manager
    capture = _Capture(runner.decode)
    runner.decode = capture
    try:
        with frees_deferred(manager) as release:  # the finished rows stay mapped
            prompts = [
                rng.integers(1, llm.config.vocab_size, context).tolist() for _ in range(batch)
            ]
            eng = llm.engine  # enough tokens that the first rows still decode when the last join
            steps = -(-batch // eng.max_prefill_rows) * -(-context // eng.chunk)
            llm.generate(prompts, SamplingParams(max_tokens=steps + 2))
    finally:
        del runner.decode

    if capture.rows != batch:
        release()
        raise RuntimeError(f"no decode step ran all {batch} rows (at most {capture.rows})")
    handles, pages, lengths = capture.args[0][:3]
    return handles, pages, lengths, release


def model_config(config: str, smoke: bool) -> tuple[str, dict]:
    """``(name, HF config dict)`` of ``config`` (a name in ``benchmarks/configs`` or a path);
    with ``smoke`` at tiny dims: 4 layers, no MTP head, a 512-token vocabulary."""
    name, cfg = load_config(config)
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    if smoke:
        cfg.update(SMOKE, vocab_size=512, num_hidden_layers=4, mtp_num_hidden_layers=0)
        cfg.pop("layer_types", None)
    return name, cfg


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.model_step",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", default="qwen3_5_35b_a3b", help="config name or path")
    ap.add_argument("--layers", type=int, help="cut the model to this many layers")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kernels", default="auto", choices=["auto", "xla", "pallas"])
    ap.add_argument("--batch", type=ints, default=[1, 16, 64, 256], help="decode batch sizes")
    ap.add_argument("--context", type=int, default=512, help="tokens per row before decode")
    ap.add_argument("--tree-sizes", type=ints, default=[29, 64], help="verify tree sizes N")
    ap.add_argument("--verify-batch", type=int, default=16, help="rows in the verify step")
    ap.add_argument("--prefill-len", type=int, default=4096, help="tokens per prefill prompt")
    ap.add_argument(
        "--prefill-prompts", type=int, default=4, help="prompts in the prefill run (0: none)"
    )
    ap.add_argument("--prefill-chunk", type=int, default=512, help="the engine's prefill chunk")
    ap.add_argument(
        "--max-prefill-tokens", type=int, default=8192, help="the engine's prefill step tokens"
    )
    ap.add_argument(
        "--cuda-graph-max-tokens",
        type=int,
        help="the engine's CUDA graph bound: steps of at most this many tokens run as graphs, "
        "larger ones kernel by kernel (default: every step a graph)",
    )
    ap.add_argument("--reps", type=int, default=20, help="timed calls per program")
    ap.add_argument(
        "--memory-budget",
        type=lambda x: int(float(x)),
        help="arena bytes (default: the device's free memory less 12 GiB)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also trace each decode and verify step's device kernels (count, busy time, "
        "the slowest by name; benchmarks.kernel_profile)",
    )
    ap.add_argument(
        "--profile-top", type=int, default=12, help="kernel names listed per profile (default 12)"
    )
    ap.add_argument(
        "--profile-sequence",
        action="store_true",
        help="with --profile, also write every kernel of one step in launch order with its "
        "time (the JSON's profiles[].sequence)",
    )
    ap.add_argument(
        "--routing",
        default="balanced",
        choices=["balanced", "model"],
        help="how the MoE layers pick experts: balanced (default; rows spread over the experts "
        "as under uniform routing, which the floors assume: gdn_jax.moe.balanced_route) or "
        "model (the random router's own top-k, which sends most rows to a few experts)",
    )
    ap.add_argument(
        "--no-fuse",
        action="store_true",
        help="run each input projection as its own matmul (LLM(fuse_projections=False)); "
        "default: the engine's fused projections",
    )
    ap.add_argument(
        "--norm-kernel-rows",
        type=int,
        help="the most rows a residual add and RMSNorm runs on its one-kernel GPU route under "
        "auto (gdn_jax.pallas_routes.AUTO_NORM_MAX_ROWS; 0: every norm on XLA; default: the "
        "route's own bound)",
    )
    ap.add_argument(
        "--moe-decode-tokens",
        type=int,
        help="the most tokens whose routed experts run as the one decode kernel under auto "
        "(gdn_jax.pallas_routes.MOE_DECODE_MAX_TOKENS; 0: the small-M kernels at every size; "
        "default: the route's own bound)",
    )
    ap.add_argument(
        "--compile-cache",
        default="",
        metavar="DIR",
        help="XLA's persistent compilation cache here ('' = off): a later run on the same "
        "machine whose programs match loads them from disk (at 40 layers the B 1 programs "
        "take most of a run to compile)",
    )
    add_decode_kernel_switches(ap)
    ap.add_argument(
        "--xla-remat",
        action="store_true",
        help="leave XLA's rematerialization pass on in the step programs (serving.launch."
        "REMAT_OFF = False; default: off, as the engine compiles them)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny dims and sizes (CPU check)")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    args = ap.parse_args(argv)
    if args.xla_remat:
        from serving import launch

        launch.REMAT_OFF = False  # read when the engine jits its step programs
    apply_decode_kernel_switches(args)
    if args.compile_cache:
        from serving.cli import compile_cache

        compile_cache(args.compile_cache)
    if min(args.batch + args.tree_sizes) < 1 or min(args.reps, args.context) < 1:
        ap.error("--batch, --tree-sizes, --reps and --context must be positive")
    if args.norm_kernel_rows is not None:
        if args.norm_kernel_rows < 0:
            ap.error(f"--norm-kernel-rows: must be >= 0, got {args.norm_kernel_rows}")
        from gdn_jax import pallas_routes

        pallas_routes.AUTO_NORM_MAX_ROWS = args.norm_kernel_rows  # read when the steps trace
    if args.moe_decode_tokens is not None:
        if args.moe_decode_tokens < 0:
            ap.error(f"--moe-decode-tokens: must be >= 0, got {args.moe_decode_tokens}")
        from gdn_jax import pallas_routes

        pallas_routes.MOE_DECODE_MAX_TOKENS = args.moe_decode_tokens

    name, cfg = model_config(args.config, args.smoke)
    if args.smoke:
        args.batch, args.context, args.prefill_len = [1, 4], 32, 64
        args.prefill_chunk, args.prefill_prompts, args.reps = 32, 2, 2
        args.tree_sizes, args.verify_batch = [5, 9], 2
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
        cfg.pop("layer_types", None)
    dtype = jnp.dtype(args.dtype)
    t0 = time.perf_counter()
    model = load_model(cfg, dtype)  # on the device; large models layer by layer
    set_moe_routing(model, args.routing)
    jax.block_until_ready(nnx.state(model))
    mc = model.config
    w = weight_bytes(model, mc)
    log(
        f"{name}: {mc.num_hidden_layers} layers, {fmt_bytes(w.dense)} dense + "
        f"{fmt_bytes(w.expert * w.num_experts)} experts, built in {time.perf_counter() - t0:.1f} s"
    )
    build_s = time.perf_counter() - t0
    bw = measure_bandwidth(5, size=(1 << 30) if not args.smoke else 1 << 22)
    flops = measure_matmul(5, n=8192 if not args.smoke else 256)
    log(f"measured: {bw / 1e12:.2f} TB/s copy, {flops / 1e12:.0f} TFLOP/s bf16 matmul")

    # the verify rows are prefilled only where a verify step is timed
    verify_batch = [args.verify_batch] if args.tree_sizes else []
    max_rows = max(args.batch + verify_batch)
    max_len = args.context + max(args.tree_sizes, default=0) + 8
    if args.prefill_prompts > 0:
        max_len = max(max_len, args.prefill_len + 8)
    budget = args.memory_budget
    stats = jax.devices()[0].memory_stats() or {}
    if budget is None and "bytes_limit" in stats:
        budget = int(stats["bytes_limit"] - stats["bytes_in_use"] - AUTO_HEADROOM)
    # the prefill prompts get a bucket of their own, so their prefill rows are all live
    buckets = sorted(set(args.batch + verify_batch + [1, max(args.prefill_prompts, 1)]))
    buckets = [b for b in buckets if b <= max_rows]
    llm = LLM(
        model,
        memory_budget=budget,
        max_num_seqs=max_rows,
        batch_buckets=buckets,
        max_model_len=max_len,
        prefill_chunk=args.prefill_chunk,
        max_prefill_tokens=args.max_prefill_tokens,
        cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        dtype=args.dtype,
        kernels=args.kernels,
        fuse_projections=not args.no_fuse,
    )
    del model  # the engine's view holds the weights (its fused projections are new arrays)
    runner = llm.engine.runner
    rng = np.random.default_rng(0)

    def block(out):
        jax.block_until_ready(out)
        jax.block_until_ready(runner.manager.arena.buffer)

    rows: list[dict] = []
    doc = dict(
        benchmark="model_step",
        config=name,
        layers=mc.num_hidden_layers,
        dtype=args.dtype,
        kernels=runner.kernels,
        fused_projections=not args.no_fuse,
        weight_arrays=len(jax.tree.leaves(nnx.state(llm.model, nnx.Param))),
        device=jax.devices()[0].device_kind,
        build_s=build_s,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        bandwidth_bytes_per_s=bw,
        matmul_flops_per_s=flops,
        args=vars(args),
        rows=rows,
    )

    def add(row: dict, call=None) -> None:
        row["over_floor"] = row["ms"] / row["floor_ms"]
        if args.profile and call is not None:
            prof = profile_kernels(
                call, block, top=args.profile_top, sequence=args.profile_sequence
            )
            row.update({k: prof.get(k) for k in ("kernels", "busy_ms", "span_ms")})
            doc.setdefault("profiles", []).append(
                dict(step=row["step"], batch=row["batch"], **prof)
            )
        rows.append(row)
        log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))
        if args.json:
            write_json(args.json, doc)

    decode_ms = {}
    verify_rows = None
    for b in sorted(set(args.batch + verify_batch)):
        t = time.perf_counter()
        handles, pages, lengths, release = decode_rows(llm, b, args.context, rng)
        log(f"B {b}: prefilled and compiled in {time.perf_counter() - t:.1f} s")
        last = rng.integers(1, mc.vocab_size, b).astype(np.int32)
        call = functools.partial(runner.decode, handles, pages, lengths, last)
        ms, dispatch = median_ms(call, args.reps, block)
        held, _ = median_ms(call, args.reps, block, release=False)
        piped = pipelined_ms(runner, handles, pages, lengths, last, args.reps, block)
        decode_ms[b] = ms
        if b in verify_batch:
            verify_rows = (handles, pages, lengths)
            release_verify = release
        if b in args.batch:
            fl = floor_s(w, mc, b, args.context, 1, True, bw, flops)
            row = dict(step="decode", batch=b, tokens=b, ms=ms, dispatch_ms=dispatch)
            row["finite"] = finite_logits(call())
            if not row["finite"]:
                log(f"B {b}: the decode step's logits are not all finite")
            add(dict(row, held_ms=held, pipelined_ms=piped, **fl), call)
        if b not in verify_batch:
            release()
    vb = args.verify_batch
    for n in args.tree_sizes:
        handles, pages, lengths = verify_rows
        tokens = rng.integers(1, mc.vocab_size, (vb, n)).astype(np.int32)
        parents = np.stack([random_parents(rng, n) for _ in range(vb)])
        t = time.perf_counter()
        runner.verify(handles, pages, lengths, tokens, parents)  # compile
        log(f"verify N {n}: compiled in {time.perf_counter() - t:.1f} s")
        call = functools.partial(runner.verify, handles, pages, lengths, tokens, parents)
        ms, dispatch = median_ms(call, args.reps, block)
        fl = floor_s(w, mc, vb, args.context, n, False, bw, flops)
        add(
            dict(
                step=f"verify N {n}",
                batch=vb,
                tokens=vb * n,
                ms=ms,
                dispatch_ms=dispatch,
                over_decode=ms / decode_ms[vb],
                **fl,
            ),
            call,
        )
    if verify_batch:
        release_verify()
    if args.prefill_prompts < 1:  # no prefill row
        return _report(args, doc, rows, name, mc, runner, bw, flops)
    prompts = [
        rng.integers(1, mc.vocab_size, args.prefill_len).tolist()
        for _ in range(args.prefill_prompts)
    ]
    one = SamplingParams(max_tokens=1)
    t = time.perf_counter()
    capture = _Capture(runner.prefill)
    runner.prefill = capture
    try:
        llm.generate(prompts, one)  # compiles the prefill buckets
    finally:
        del runner.prefill
    log(f"prefill: compiled in {time.perf_counter() - t:.1f} s")
    # one prefill program on the captured step with the most rows (the arena's states of
    # those rows are rewritten each call; nothing reads them after)
    pa, pk = capture.args
    live = int(np.asarray(pa[4]).sum())  # (handles, pages, lengths, tokens, num_tokens)
    call = functools.partial(runner.prefill, *pa, **pk)
    ms, dispatch = median_ms(call, max(2, args.reps // 5), block)
    rows_live = np.asarray(pa[0]) >= 0
    context = int(np.asarray(pa[2])[rows_live].mean())  # tokens each row had before the chunk
    fl = floor_s(w, mc, capture.rows, context, live // capture.rows, True, bw, flops)
    add(
        dict(
            step="prefill step",
            batch=capture.rows,
            tokens=live,
            ms=ms,
            dispatch_ms=dispatch,
            tokens_per_s=live / (ms / 1e3),
            **fl,
        ),
        call,
    )
    times = []
    for _ in range(max(2, args.reps // 5)):
        t = time.perf_counter()
        llm.generate(prompts, one)
        times.append(1e3 * (time.perf_counter() - t))
    ms = float(np.median(times))
    n_tok = args.prefill_len * args.prefill_prompts
    fl = floor_s(w, mc, args.prefill_prompts, 0, args.prefill_len, True, bw, flops)
    add(
        dict(
            step=f"prefill {args.prefill_len}",
            batch=args.prefill_prompts,
            tokens=n_tok,
            ms=ms,
            tokens_per_s=n_tok / (ms / 1e3),
            **fl,
        )
    )
    return _report(args, doc, rows, name, mc, runner, bw, flops)


def _report(args, doc, rows, name, mc, runner, bw, flops) -> dict:
    print(
        f"\n{name}, {mc.num_hidden_layers} layers, {args.dtype}, kernels {runner.kernels}, "
        f"{doc['device']}; context {args.context}; floors at {bw / 1e12:.2f} TB/s and "
        f"{flops / 1e12:.0f} TFLOP/s\n"
    )
    cols = [
        ("step", "step"),
        ("batch", "B"),
        ("tokens", "tokens"),
        ("ms", "ms"),
        ("floor_ms", "floor ms"),
        ("over_floor", "/ floor"),
        ("dispatch_ms", "dispatch ms"),
        ("held_ms", "ms, outputs held"),
        ("pipelined_ms", "ms, pipelined"),
        ("kernels", "kernels"),
        ("busy_ms", "GPU busy ms"),
        ("bound", "floor bound"),
        ("over_decode", "/ decode"),
        ("tokens_per_s", "tokens/s"),
    ]
    print(markdown_table(rows, cols, digits=4))
    for prof in doc.get("profiles", []):
        if prof.get("top"):
            print(f"\n{prof['step']}, B {prof['batch']}: the kernels that took the most time")
            top_cols = [("name", "kernel"), ("per_call", "per step"), ("ms", "ms per step")]
            print(markdown_table(prof["top"], top_cols, digits=4))
    if args.json:
        write_json(args.json, doc)
        print(f"wrote {args.json}", file=sys.stderr)
    return doc


if __name__ == "__main__":
    main()
