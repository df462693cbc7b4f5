"""The kernels each engine step program launches on an H200, compiled without a GPU.

    python -m benchmarks.step_kernels [--config qwen3_5_35b_a3b] [--layers 4] [--batch 1,16]
                                      [--tree-sizes 29] [--chunk 64] [--json out.json]

The engine's arena programs (decode at each ``--batch``, the target's tree verify of each
``--tree-sizes`` at the first batch, prefill of ``--chunk`` tokens per row, commit) are traced
for abstract arguments (no weights are made: ``nnx.eval_shape``) with the GPU routes of
``--kernels auto`` (the arena kernels, the model's Pallas routes), then compiled by XLA:GPU for
an H200 target on this machine (a deviceless compile, as ``benchmarks/compile_report.py
--xla``) and counted: the kernel launches of the program's entry computation (fusions, custom
calls, sorts and copies), how many of them are Pallas (Triton) kernels and GEMM library calls,
the launches per layer, and the copies of the whole arena (each should be 0: every program
updates the donated arena in place). ``--spec-batch B`` adds the one-program speculative step
of the shipped tiny target (:mod:`serving.spec_device`: drafting of ``--spec-tree`` by the tiny
draft model or, ``--spec-method mtp``, the target's MTP head; verify, acceptance, commit, the
draft's catch-up) at batch ``B``, its arguments captured from a short CPU run of the engine
and its kernels re-chosen as on a GPU. A step's cost at small batch follows its launch count
(``benchmarks/README.md#model_step``), so this is how a change to the model's structure is
checked before it reaches the GPU. XLA cannot autotune without a GPU, so its GEMM choices (and
a few fusions) may differ from a build on the device; the counts track the device's to within a
few percent.

It needs the CUDA plugin of the pinned jax, in a venv aside (no GPU, CUDA or Triton needed)::

    python -m venv /tmp/cv && /tmp/cv/bin/pip install jax==0.11.2 jaxlib==0.11.2 \\
        jax-cuda12-plugin==0.11.2 jax-cuda12-pjrt==0.11.2 flax chex optax jaxtyping \\
        safetensors tokenizers jinja2 tqdm
    /tmp/cv/bin/python -m benchmarks.step_kernels --layers 4
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import sys
import time
from unittest import mock

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA runtime here
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import (  # noqa: E402
    CallCapture,
    add_decode_kernel_switches,
    apply_decode_kernel_switches,
    ints,
    load_config,
    markdown_table,
    write_json,
)


def entry_launches(hlo: str) -> dict:
    """Kernel launches of an optimized HLO module's entry computation, by kind."""
    entry = hlo[hlo.index("\nENTRY") :]
    entry = entry[: entry.index("\n}\n")] if "\n}\n" in entry else entry
    kinds: collections.Counter = collections.Counter()
    for line in entry.splitlines():
        if " custom-call(" in line:
            target = re.search(r'custom_call_target="([^"]+)"', line)
            target = target.group(1) if target else "?"
            kinds["pallas" if "triton" in target else "gemm" if "blas" in target else "other"] += 1
        elif " fusion(" in line:
            # a GEMM fusion by its own name or kind, not by an operand's name
            name = line.split("=", 1)[0].split()[-1]
            gemm = name.startswith("%gemm_fusion") or re.search(r'"kind":"__triton\w*gemm', line)
            kinds["gemm" if gemm else "fusion"] += 1
        elif " sort(" in line or " copy(" in line:
            kinds["other"] += 1
    return dict(launches=sum(kinds.values()), **{k: kinds.get(k, 0) for k in KINDS})


KINDS = ("pallas", "gemm", "fusion", "other")
H200_SHARED_MEMORY = 232448  # bytes of shared memory a block may opt in to on the H200


@contextlib.contextmanager
def _as_gpu():
    """The model's ``impl="auto"`` routes and the Pallas routes as on a GPU (no interpret mode),
    the Pallas lowering for an H200 (a Hopper GPU for the Mosaic GPU kernels)."""
    from benchmarks.compile_report import _force_h200

    _force_h200()
    with (
        mock.patch("gdn_jax.dispatch.jax.default_backend", return_value="gpu"),
        mock.patch("gdn_jax.pallas_routes._interpret", return_value=False),
        mock.patch("pallas_kernels.moe.mgpu.mgpu_available", return_value=True),
    ):
        yield


def arena_copies(hlo: str) -> int:
    """Copies of the whole arena (the entry computation's ``buf`` parameter's shape)."""
    m = re.search(r"%buf[.\w]* = (u32\[[\d,]+\])\{[\d,]+\} parameter", hlo)
    if m is None:
        return 0
    return sum(1 for line in hlo.splitlines() if f"= {m.group(1)}" in line and " copy(" in line)


def spec_step_program(batch: int, tree: tuple[int, ...], sharding, method: str = "draft_model"):
    """``(program, abstract args)`` of the shipped tiny target's one-program speculative step
    at ``batch`` rows (drafted by the tiny draft model or, ``method="mtp"``, the target's MTP
    head; static ``tree``, greedy), with the arena kernels and model routes an H200 takes
    under ``kernels="auto"``."""
    import dataclasses

    import numpy as np

    from benchmarks.common import frees_deferred
    from gdn_jax.models.model import set_kernel_impl
    from serving import runner as R
    from serving import spec_device
    from serving.bench import ASSETS, stdlib_prompts
    from serving.kernels import select_kernels
    from serving.llm import LLM, load_model
    from serving.params import SamplingParams, SpecConfig

    model, draft = (
        load_model(ASSETS / "target", jnp.float32),
        load_model(ASSETS / "draft", jnp.float32),
    )
    drafter = dict(draft_model=draft) if method == "draft_model" else {}
    spec = SpecConfig(method=method, tree=tree, verify="wy", **drafter)
    llm = LLM(
        model, speculative=spec, max_num_seqs=batch, batch_buckets=(batch,), max_model_len=176,
        prefill_chunk=64, dtype="float32", kernels="xla",
    )  # fmt: skip
    engine, runner = llm.engine, llm.engine.runner
    ds = engine.device_spec
    capture = CallCapture(ds)
    engine.device_spec = capture
    with frees_deferred(engine.sched.manager):
        llm.generate(stdlib_prompts(batch, 96), SamplingParams(max_tokens=4))
    engine.device_spec = ds

    def on_gpu(graphdef, state):  # the model's own routes as under kernels="auto" on a GPU
        m = nnx.merge(graphdef, state)
        set_kernel_impl(m, "auto")
        return nnx.split(m)[0]

    key = dataclasses.replace(
        ds.key,
        target=on_gpu(ds.key.target, runner._state.state()),
        target_kernels=select_kernels("auto", ds.key.target_spec, runner.config, "gpu")[0],
        commit_impl="auto",
        sampling=False,
    )
    if ds.draft_runner is not None:
        key = dataclasses.replace(
            key,
            draft=on_gpu(ds.key.draft, ds._dstate.state()),
            draft_kernels=select_kernels("auto", ds.key.draft_spec, ds.draft_runner.config, "gpu")[
                0
            ],
        )

    def sds(x):
        if x is None:
            return None
        if isinstance(x, R.FlatState):
            return R.FlatState(x.treedef, [sds(leaf) for leaf in x.leaves])
        x = x if hasattr(x, "dtype") else np.asarray(x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    handles, pages, lengths, root, scratch, seeds, temp, top_k, top_p = capture.args
    nodes = np.zeros((batch, ds.num_nodes), np.int32)
    ints, floats = spec_device.pack_inputs(
        handles, pages, lengths, root, nodes, nodes, scratch, seeds, temp, top_k, top_p
    )
    none = np.zeros((ds.key.table_rows, 3), np.int32)  # no table changes
    none[:, 0] = runner.manager._handles.capacity
    ints = R.with_table_delta(ints, none)
    hidden = np.zeros((batch, runner.config.hidden_size), np.float32) if method == "mtp" else None
    args = (runner._state, ds._dstate, runner._buf, runner.table(), ints, floats, hidden)
    return spec_device._program(key).graphs, [sds(x) for x in args]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.step_kernels",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", default="qwen3_5_35b_a3b", help="config name or path")
    ap.add_argument("--layers", type=int, default=4, help="cut the model to this many layers")
    ap.add_argument("--batch", type=ints, default=[1, 16], help="decode batch sizes")
    ap.add_argument("--tree-sizes", type=ints, default=[29], help="verify tree sizes N")
    ap.add_argument("--chunk", type=int, default=64, help="prefill tokens per row")
    ap.add_argument(
        "--spec-batch",
        type=int,
        help="also the tiny target's one-program speculative step at this batch (default: none)",
    )
    ap.add_argument("--spec-tree", type=ints, default=[4, 2, 2], help="its tree (default: 4,2,2)")
    ap.add_argument(
        "--spec-method",
        default="draft_model",
        help="its drafters, comma-separated: draft_model (the tiny draft model), mtp (the "
        "target's MTP head) (default: draft_model)",
    )
    ap.add_argument(
        "--no-fuse",
        action="store_true",
        help="each input projection its own matmul (default: fused, as the engine runs them)",
    )
    ap.add_argument(
        "--snapshot",
        action="store_true",
        help="also the snapshot method's verify (a scratch unit per node) at each tree size",
    )
    add_decode_kernel_switches(ap)
    ap.add_argument("--dump", metavar="DIR", help="also write each program's optimized HLO here")
    ap.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = ap.parse_args(argv)
    apply_decode_kernel_switches(args)
    if not set(args.spec_method.split(",")) <= {"draft_model", "mtp"}:
        ap.error(f"--spec-method: draft_model and/or mtp, got {args.spec_method!r}")
    from benchmarks.compile_report import h200_sharding
    from gdn_jax.models import ModelConfig, fuse_projections
    from gdn_jax.models.model import HybridLM, set_kernel_impl
    from serving import runner as R
    from serving.arena_spec import ArenaSpec
    from serving.kernels import select_kernels
    from serving.memory import MemoryManager, layout_for

    name, cfg = load_config(args.config)
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cfg.update(num_hidden_layers=args.layers, mtp_num_hidden_layers=0)
    cfg.pop("layer_types", None)
    config = ModelConfig.from_hf_dict(cfg)
    shd = h200_sharding(H200_SHARED_MEMORY)

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=shd)

    def make():
        m = HybridLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        if not args.no_fuse:  # as LLM(fuse_projections=True) runs it
            fuse_projections(m)
        return m

    model = nnx.eval_shape(make)
    set_kernel_impl(model, "auto")
    graphdef, state = nnx.split(model)
    flat = R.FlatState.of(state)
    flat = R.FlatState(flat.treedef, [sds(x.shape, x.dtype) for x in flat.leaves])
    depth = 4
    layout = layout_for(
        config.to_hf_dict(), 16, spec_nodes=max(args.tree_sizes, default=1), kv_dtype="bfloat16"
    )
    mm = MemoryManager(layout, 64 << 20, "avmp")  # shapes only: the programs see abstract arrays
    spec = ArenaSpec.from_layout(layout, jnp.bfloat16, config=config)
    kernels, notes = select_kernels("auto", spec, config, backend="gpu")
    prefill, decode, verify, commit, _, _ = R._arena_programs(
        graphdef, spec, kernels, "auto", R.ArenaCache, 1 << 30
    )
    buf, table = mm.arena.buffer, mm.device_table()
    arena = (sds(buf.shape, buf.dtype), sds(table.shape, table.dtype))
    i32 = jnp.int32

    def rows(b):  # handles, pages, lengths
        return sds((b,), i32), sds((b, 8), i32), sds((b,), i32)

    b0 = args.batch[0]
    progs = [
        (f"decode B {b}", decode, (flat, *arena, *rows(b), sds((b,), i32)), {}) for b in args.batch
    ]
    for n in args.tree_sizes:
        nodes = (sds((b0, n), i32), sds((b0, n), i32), sds((b0,), i32))
        progs.append(
            (
                f"verify N {n}, B {b0}",
                verify,
                (flat, *arena, *rows(b0), *nodes),
                {"snapshot": False},
            )
        )
        if args.snapshot:  # the snapshot method: one scratch unit per node
            snap = (*nodes[:2], sds((b0, n), i32))
            progs.append(
                (
                    f"snapshot verify N {n}, B {b0}",
                    verify,
                    (flat, *arena, *rows(b0), *snap),
                    {"snapshot": True},
                )
            )
    path = (sds((b0,), i32), sds((b0, depth + 1), i32), sds((b0,), i32))
    progs.append((f"commit B {b0}", commit, (*arena, *rows(b0), *path), {}))
    chunk = (sds((b0, args.chunk), i32), sds((b0,), i32))
    progs.append((f"prefill {args.chunk}, B {b0}", prefill, (flat, *arena, *rows(b0), *chunk), {}))
    progs = [(label, prog.graphs, a, kw) for label, prog, a, kw in progs]
    if args.spec_batch:
        tree = ",".join(map(str, args.spec_tree))
        for method in args.spec_method.split(","):
            prog, a = spec_step_program(args.spec_batch, tuple(args.spec_tree), shd, method)
            label = f"spec step, tiny {method}, tree {tree}, B {args.spec_batch}"
            progs.append((label, prog, a, {}))
    out = []
    with _as_gpu():
        for label, prog, a, kw in progs:
            t = time.perf_counter()
            compiled = prog.trace(*a, **kw).lower().compile()
            hlo = compiled.as_text()
            mem = compiled.memory_analysis()
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                stem = re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")
                with open(os.path.join(args.dump, f"{stem}.txt"), "w") as f:
                    f.write(hlo)
            row = dict(program=label, **entry_launches(hlo), arena_copies=arena_copies(hlo))
            row["temp_bytes"] = None if mem is None else int(mem.temp_size_in_bytes)
            if "spec step" not in label:
                row["per_layer"] = row["launches"] / args.layers
            row["compile_s"] = time.perf_counter() - t
            out.append(row)
            print(
                f"# {label}: {row['launches']} launches ({row['compile_s']:.1f} s)", file=sys.stderr
            )
    doc = dict(
        benchmark="step_kernels", config=name, layers=args.layers, kernels=kernels.name,
        fused_projections=not args.no_fuse, notes=list(notes), rows=out,
    )  # fmt: skip
    print(f"\n{name}, {args.layers} layers, H200 target, kernels {kernels.name} (deviceless)\n")
    cols = [("program", "program"), ("launches", "launches"), ("per_layer", "per layer")]
    cols += [(k, k) for k in KINDS] + [("arena_copies", "arena copies")]
    for r in out:
        r["temp_mib"] = None if r["temp_bytes"] is None else r["temp_bytes"] / 2**20
    cols += [("temp_mib", "temporaries MiB")]
    print(markdown_table(out, cols, digits=4))
    if args.json:
        write_json(args.json, doc)
    return doc


if __name__ == "__main__":
    main()
