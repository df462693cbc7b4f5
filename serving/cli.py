"""The command line: ``python -m serving generate | bench | train-tiny``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from serving.bench import ASSETS

CACHE = str(Path.home() / ".cache" / "gdn_jax_xla")
EPILOG = "Shipped models: serving/assets/tiny/{target,draft} (byte-level, see serving/README.md)."


def _tree(text: str) -> tuple[int, ...]:
    try:
        tree = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tree: expected e.g. 4,2,2, got {text!r}") from None
    if not tree or min(tree) < 1:
        raise argparse.ArgumentTypeError(f"--tree: positive children per depth, got {text!r}")
    return tree


def _spec_args(p: argparse.ArgumentParser, *, bench: bool = False) -> None:
    p.add_argument(
        "--method",
        choices=("none", "ngram", "draft_model", "mtp"),
        default="draft_model",
        help="drafter: n-gram prompt lookup, the small draft model, the target's MTP head, or "
        "no speculation (default: %(default)s)",
    )
    p.add_argument(
        "--draft-model",
        default=str(ASSETS / "draft"),
        help="HF directory of the draft model for --method draft_model (default: shipped)",
    )
    p.add_argument(
        "--tree",
        type=_tree,
        default=(4, 2, 2),
        help="static draft tree, children per depth: 4,2,2 = 29 nodes; 1,1,1,1 = a chain "
        "(default: 4,2,2; bench: the tree rows, the chain row has as many levels)",
    )
    if bench:
        return
    p.add_argument(
        "--budget",
        type=int,
        default=None,
        help="dynamic tree of at most this many nodes (top cumulative draft probability) "
        "instead of --tree",
    )
    p.add_argument(
        "--verify",
        choices=("wy", "snapshot"),
        default="wy",
        help="tree WY (one solve, no per-node state) or per-node state snapshots "
        "(vLLM/SGLang) (default: %(default)s)",
    )


def _generate(args) -> None:
    from serving import LLM, SamplingParams, SpecConfig

    spec = None
    if args.method != "none":
        spec = SpecConfig(
            method=args.method,
            draft_model=args.draft_model if args.method == "draft_model" else None,
            tree=args.tree,
            budget=args.budget,
            verify=args.verify,
        )
    llm = LLM(
        args.model,
        memory_budget=args.memory_budget,
        memory_policy=args.memory_policy,
        speculative=spec,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
    )
    if args.prompt_ids:
        prompt = [int(x) for x in args.prompt_ids.split(",")]
    else:
        prompt = args.prompt
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    (out,) = llm.generate([prompt], params)
    if out.text is not None:
        print(out.text if isinstance(prompt, list) else prompt + out.text)
    else:
        print(" ".join(map(str, out.token_ids)))
    m = dict(out.metrics)
    m["acceptance_lengths"] = len(m["acceptance_lengths"])
    print(json.dumps(m), file=sys.stderr)


def _bench(args) -> None:
    from serving import bench

    model = None
    method = args.method if args.method != "none" else "ngram"
    if args.config:
        model = args.config
        if method == "draft_model":
            method = "ngram"  # a random-weight target has no trained drafter
    bench.run(
        model=model,
        draft=args.draft_model if method == "draft_model" else None,
        method=method,
        tree=args.tree,
        chain=len(args.tree),
        num_prompts=args.num_prompts,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        max_num_seqs=args.max_num_seqs,
        dtype=args.dtype,
        kernels=args.kernels,
        json_path=args.json,
    )


def _train(args) -> None:
    from serving.train_tiny import main

    main(
        args.out,
        target_steps=args.target_steps,
        draft_steps=args.draft_steps,
        batch=args.batch,
        seq=args.seq,
        seed=args.seed,
        only=args.only,
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m serving",
        description="Serve hybrid GDN models with continuous batching and tree speculative "
        "decoding (tree WY or per-node snapshot verification).",
        epilog=EPILOG,
    )
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate from one prompt", epilog=EPILOG)
    g.add_argument(
        "--model",
        default=str(ASSETS / "target"),
        help="HF directory (weights) or config.json (random weights) (default: shipped tiny)",
    )
    g.add_argument("--prompt", default="def fibonacci(n):\n", help="text prompt")
    g.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass")
    g.add_argument("--top-k", type=int, default=0, help="0 = no top-k")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--memory-budget", type=int, default=None, help="arena bytes (default: auto)")
    g.add_argument(
        "--memory-policy",
        default="avmp",
        choices=("avmp", "unified_padded", "static_dual", "multi_ended"),
        help="memory manager policy (default: %(default)s)",
    )
    g.add_argument("--max-model-len", type=int, default=1024, help="most tokens per request")
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    g.add_argument("--compile-cache", default=CACHE, help="XLA compilation cache ('' = off)")
    _spec_args(g)
    g.set_defaults(func=_generate)

    b = sub.add_parser(
        "bench",
        help="benchmark: no speculation, chain snapshot, tree snapshot, tree WY",
        description="Runs the same prompts (byte windows of standard library sources) "
        "through four engines and prints throughput, TTFT, TPOT, mean acceptance length and "
        "speculative memory. On the shipped tiny models it takes about two minutes on CPU.",
        epilog=EPILOG,
    )
    b.add_argument(
        "--config",
        default=None,
        help="HF config.json of a real model: random weights at that size, n-gram or MTP "
        "drafting (for GPU runs; too big for a CPU)",
    )
    b.add_argument("--num-prompts", type=int, default=8, help="requests (default: 8)")
    b.add_argument("--prompt-len", type=int, default=96, help="prompt bytes (default: 96)")
    b.add_argument("--max-tokens", type=int, default=48, help="tokens per request (default: 48)")
    b.add_argument("--max-num-seqs", type=int, default=8, help="batch rows (default: 8)")
    b.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    b.add_argument("--json", default=None, help="also write the rows as JSON here")
    b.add_argument(
        "--kernels",
        default="auto",
        choices=("auto", "pallas", "xla"),
        help="the engines' kernels (LLM(kernels=...)): 'auto' takes the arena Pallas kernels "
        "on GPU, 'pallas' everywhere (interpret mode off GPU: slow), 'xla' none "
        "(default: %(default)s)",
    )
    b.add_argument(
        "--compile-cache",
        default=CACHE,
        help="XLA persistent compilation cache directory, so later runs skip compiling "
        "('' = off; default: %(default)s)",
    )
    _spec_args(b, bench=True)
    b.set_defaults(func=_bench)

    t = sub.add_parser(
        "train-tiny",
        help="train the shipped tiny target and draft models",
        description="Trains the tiny Qwen3.5-layout target (with an MTP head) and the tiny "
        "draft model on the standard library's sources, byte-level, with optax, and saves "
        "both in HF format.",
        epilog=EPILOG,
    )
    t.add_argument("--out", default=str(ASSETS), help="output directory (default: shipped)")
    t.add_argument("--target-steps", type=int, default=320, help="optimizer steps, target")
    t.add_argument("--draft-steps", type=int, default=200, help="optimizer steps, draft")
    t.add_argument("--batch", type=int, default=16, help="sequences per step")
    t.add_argument("--seq", type=int, default=128, help="bytes per sequence")
    t.add_argument("--seed", type=int, default=0, help="data and init seed")
    t.add_argument(
        "--only", choices=("target", "draft"), default=None, help="train one of the two only"
    )
    t.set_defaults(func=_train)
    return p


def _compile_cache(directory: str) -> None:
    """XLA's persistent compilation cache: a second run loads the step programs from disk."""
    import jax

    if directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    _compile_cache(getattr(args, "compile_cache", ""))
    if getattr(args, "out", None):
        Path(args.out).mkdir(parents=True, exist_ok=True)
    args.func(args)
