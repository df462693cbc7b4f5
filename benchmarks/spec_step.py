"""One speculative step against one plain decode step, side by side, on the same batch.

    python -m benchmarks.spec_step [--batch 1,8] [--tree 4,2,2] [--kernels xla|auto]
                                   [--method draft_model,mtp] [--reps 20] [--profile]
                                   [--json out.json]

The shipped tiny target/draft pair (``serving/assets/tiny``), drafted by the draft model (in the
target's arena) or the target's own MTP head, as ``python -m serving bench`` builds them. For each batch size the engine
prefills real prompts (a short ``generate`` that also compiles every program), then three
programs run alternately on that batch's handles and lengths, ``--reps`` times each:

- ``decode``: the plain decode step (``ArenaRunner.decode``);
- ``spec step``: the whole speculative step as one device program
  (:class:`serving.spec_device.DeviceSpeculator`: draft levels, verify, acceptance, commit, the
  draft's catch-up), host work of the call included;
- ``verify``: the target's tree verify alone (``ArenaRunner.verify`` without scratch: the
  arena only read), the step's main model part.

Each time is a median in ms, blocked on the outputs and the arena. ``spec / decode`` is the
step's cost in decode steps (tree WY pays when the mean acceptance length exceeds it);
``verify / spec`` is the share of the target's verify in the step. ``--profile`` adds each
program's device kernels (count per call, GPU busy time, the slowest by name;
:mod:`benchmarks.kernel_profile`).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx
from jax import numpy as jnp

from benchmarks.common import (
    CallCapture,
    frees_deferred,
    ints,
    load_config,
    log,
    markdown_table,
    write_json,
)
from benchmarks.kernel_profile import profile as profile_kernels
from serving.bench import ASSETS, stdlib_prompts
from serving.llm import LLM, load_model
from serving.params import SamplingParams, SpecConfig
from serving.spec_device import StaticTree


def _ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t)


def mtp_levels(model, tree: tuple[int, ...], batch: int, dtype):
    """The model part of MTP drafting as one program: per level of the static ``tree``, the
    MTP head and the LM head on the level's frontier (``batch x`` nodes, one-token sequences),
    then each node's ``width`` most likely children, as the speculative step drafts."""
    graphdef, state = nnx.split(model)
    widths = tuple(tree)

    @jax.jit
    def run(state, hidden, root):
        m = nnx.merge(graphdef, state)
        tokens, h = root[:, None], hidden[:, None]  # [B, F], [B, F, H]
        for w in widths:
            f = tokens.shape[1]
            x = m.embed(tokens.reshape(batch * f, 1))
            h = m.mtp(x, h.reshape(batch * f, 1, -1)).reshape(batch, f, -1)
            logits = m.logits(h).astype(jnp.float32)
            tokens = jax.lax.top_k(logits, w)[1].reshape(batch, f * w)
            h = jnp.repeat(h, w, axis=1)
        return tokens

    hidden = jax.random.normal(jax.random.key(1), (batch, model.config.hidden_size), dtype)
    root = jnp.ones((batch,), jnp.int32)
    return lambda: run(state, hidden, root)


def measure(
    batch: int,
    tree: tuple[int, ...],
    kernels: str,
    reps: int,
    dtype: str,
    profile: bool = False,
    method: str = "draft_model",
    model=None,
    memory_budget: int | None = None,
) -> dict:
    """One row: ``model`` the target (default: the shipped tiny one, in ``dtype``), its
    engine's arena ``memory_budget`` bytes (default: the engine's)."""
    dt = jnp.dtype(dtype)
    if model is None:
        model = load_model(ASSETS / "target", dt)
    if method == "draft_model":
        spec = SpecConfig(
            method=method, draft_model=load_model(ASSETS / "draft", dt), tree=tree, verify="wy"
        )
    else:
        spec = SpecConfig(method=method, tree=tree, verify="wy")
    llm = LLM(
        model,
        speculative=spec,
        max_num_seqs=batch,
        batch_buckets=(batch,),
        max_model_len=176,
        prefill_chunk=64,
        dtype=dtype,
        kernels=kernels,
        memory_budget=memory_budget,
    )
    log(f"batch {batch}, {method}: engine built; prefilling and compiling")
    engine, runner = llm.engine, llm.engine.runner
    device_spec = engine.device_spec
    capture = CallCapture(device_spec)
    engine.device_spec = capture  # keeps the last step's inputs: this batch's rows
    try:  # the finished rows keep their memory until the timings are done
        with frees_deferred(engine.sched.manager) as release:
            llm.generate(stdlib_prompts(batch, 96), SamplingParams(max_tokens=4))
    finally:
        engine.device_spec = device_spec
    a, k = capture.args, capture.kwargs
    handles, pages, lengths = a[0], a[1], a[2]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.config.vocab_size, (batch, spec.num_nodes), np.int32)
    parents = np.broadcast_to(StaticTree(tuple(tree)).parents, tokens.shape).copy()
    last = np.zeros(batch, np.int32)

    def block(out):
        jax.block_until_ready(out)
        jax.block_until_ready(runner.manager.arena.buffer)

    programs = {
        "decode": lambda: block(runner.decode(handles, pages, lengths, last)),
        "spec step": lambda: block(device_spec(*a, **k)),
        "verify": lambda: block(runner.verify(handles, pages, lengths, tokens, parents)),
    }
    if method == "mtp":
        draft = mtp_levels(model, tree, batch, dt)
        programs["draft"] = lambda: block(draft())
    for name, fn in programs.items():  # compile and warm
        t0 = time.perf_counter()
        fn()
        fn()
        log(f"batch {batch}: {name} compiled and warm ({time.perf_counter() - t0:.1f} s)")
    ms = {name: [] for name in programs}
    for _ in range(reps):
        for name, fn in programs.items():
            ms[name].append(_ms(fn))
    out = {name: float(np.median(v)) for name, v in ms.items()}
    profiles = {}
    if profile:
        for name, fn in programs.items():
            prof = profile_kernels(fn, lambda _: None)
            profiles[name] = {k: prof.get(k) for k in ("kernels", "busy_ms", "span_ms", "top")}
    release()
    log(f"batch {batch}, {method}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in out.items()))
    return dict(
        batch=batch,
        method=method,
        tree=",".join(map(str, tree)),
        nodes=spec.num_nodes,
        kernels=runner.kernels,
        backend=jax.default_backend(),
        decode_ms=out["decode"],
        spec_step_ms=out["spec step"],
        verify_ms=out["verify"],
        spec_over_decode=out["spec step"] / out["decode"],
        verify_share=out["verify"] / out["spec step"],
        **(
            dict(
                draft_ms=out["draft"],
                other_share=(out["spec step"] - out["verify"] - out["draft"]) / out["spec step"],
            )
            if "draft" in out
            else {}
        ),
        **({"profiles": profiles} if profile else {}),
    )


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.spec_step", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--batch", type=ints, default=[1, 8], help="batch sizes (default: 1,8)")
    ap.add_argument("--tree", type=ints, default=[4, 2, 2], help="static tree (default: 4,2,2)")
    ap.add_argument("--kernels", default="auto", choices=["auto", "xla", "pallas"])
    ap.add_argument(
        "--method",
        default=["draft_model"],
        type=lambda s: s.split(","),
        help="drafters, comma list of draft_model, mtp (default: draft_model)",
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--config",
        help="a config name in benchmarks/configs or an HF config.json: random weights at "
        "that size, built on the device, drafted by its MTP head (default: the tiny target)",
    )
    ap.add_argument("--layers", type=int, help="with --config: cut the model to this many layers")
    ap.add_argument(
        "--memory-budget",
        type=lambda x: int(float(x)),
        help="the engine's arena bytes (default: the engine's own, sized for the batch; at "
        "35B dims batch 1 needs more, e.g. 8e9)",
    )
    ap.add_argument("--reps", type=int, default=20, help="timed calls per program (default: 20)")
    ap.add_argument("--profile", action="store_true", help="profile each program's kernels (GPU)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.reps < 1 or min(args.batch) < 1 or min(args.tree) < 1:
        ap.error("--reps, --batch and --tree must be positive")
    if bad := set(args.method) - {"draft_model", "mtp"}:
        ap.error(f"--method: unknown drafter(s) {sorted(bad)}; choose from draft_model, mtp")
    model = None
    if args.config:
        if args.method != ["mtp"]:
            ap.error("--config: random weights draft only by the MTP head (--method mtp)")
        name, cfg = load_config(args.config)
        cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
        if args.layers:
            if args.layers < 1:
                ap.error(f"--layers must be positive, got {args.layers}")
            cfg["num_hidden_layers"] = args.layers
            cfg.pop("layer_types", None)
        if not cfg.get("mtp_num_hidden_layers"):
            ap.error(f"--config: {name} has no MTP head (mtp_num_hidden_layers)")
        t0 = time.perf_counter()
        model = load_model(cfg, jnp.dtype(args.dtype))
        jax.block_until_ready(nnx.state(model))
        log(f"{name}: {cfg['num_hidden_layers']} layers built in {time.perf_counter() - t0:.1f} s")
    rows = [
        measure(
            b,
            tuple(args.tree),
            args.kernels,
            args.reps,
            args.dtype,
            args.profile,
            m,
            model,
            memory_budget=args.memory_budget,
        )  # fmt: skip
        for m in args.method
        for b in args.batch
    ]
    cols = [
        ("method", "drafter"),
        ("batch", "batch"),
        ("nodes", "nodes"),
        ("kernels", "kernels"),
        ("decode_ms", "decode ms"),
        ("spec_step_ms", "spec step ms"),
        ("verify_ms", "verify ms"),
        ("spec_over_decode", "spec / decode"),
        ("verify_share", "verify / spec"),
    ]
    if any("draft_ms" in r for r in rows):
        cols += [("draft_ms", "MTP draft ms"), ("other_share", "rest / spec")]
    print(markdown_table(rows, cols, digits=3))
    for row in rows:
        for name, prof in row.get("profiles", {}).items():
            print(
                f"\n{name}, {row['method']}, B {row['batch']}: {prof['kernels']} kernels, "
                f"GPU busy {prof['busy_ms']} ms"
            )
            if prof.get("top"):
                top_cols = [("name", "kernel"), ("per_call", "per call"), ("ms", "ms per call")]
                print(markdown_table(prof["top"], top_cols, digits=4))
    if args.json:
        write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
