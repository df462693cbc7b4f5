"""The command line: ``python -m serving generate | serve | bench | train-tiny`` (also
installed as ``gdn-serve``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from serving.bench import ASSETS, BENCH_TREE
from serving.scheduler import ADMISSIONS

CACHE = str(Path.home() / ".cache" / "gdn_jax_xla")
EPILOG = "Shipped models: serving/assets/tiny/{target,draft} (byte-level, see serving/README.md)."
SHIPPED_NAME = "gdn-tiny"  # the served model name of the shipped tiny target


class _Parser(argparse.ArgumentParser):
    """Usage errors as one ``PROG: error: ...`` line."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _prog() -> str:
    """How the program was invoked: ``gdn-serve`` for the script, else ``python -m serving``."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return name if name and name not in ("__main__.py", "-c", "-m") else "python -m serving"


def _ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("no token ids")
    return ids


def _tree(text: str) -> tuple[int, ...]:
    try:
        tree = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tree: expected e.g. 4,2,2, got {text!r}") from None
    if not tree or min(tree) < 1:
        raise argparse.ArgumentTypeError(f"--tree: positive children per depth, got {text!r}")
    return tree


def _spec_args(
    p: argparse.ArgumentParser, *, bench: bool = False, method: str = "draft_model"
) -> None:
    p.add_argument(
        "--method",
        choices=("none", "ngram", "draft_model", "mtp"),
        default=method,
        help="drafter: n-gram prompt lookup, the small draft model, the target's MTP head, or "
        "no speculation (default: %(default)s"
        + ("; the Python API's LLM defaults to none)" if method != "none" else ")"),
    )
    p.add_argument(
        "--draft-model",
        default=str(ASSETS / "draft"),
        help="HF directory of the draft model for --method draft_model (default: shipped)",
    )
    p.add_argument(
        "--tree",
        type=_tree,
        default=BENCH_TREE if bench else (4, 2, 2),
        help="static draft tree, children per depth: 4,2,2 = 29 nodes; 1,1,1,1 = a chain "
        + (
            "(the tree rows; the chain row has as many levels; default: 2,1,1,1,1 = 11 nodes)"
            if bench
            else "(default: 4,2,2)"
        ),
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


def _spec(args):
    from serving import SpecConfig

    if args.method == "none":
        return None
    return SpecConfig(
        method=args.method,
        draft_model=args.draft_model if args.method == "draft_model" else None,
        tree=args.tree,
        budget=args.budget,
        verify=args.verify,
    )


def _generate(args) -> None:
    from serving import LLM, SamplingParams

    llm = LLM(
        args.model,
        memory_budget=args.memory_budget,
        memory_policy=args.memory_policy,
        speculative=_spec(args),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        prefill_chunk=args.prefill_chunk,
        prefill_buckets=args.prefill_buckets,
        max_prefill_tokens=args.max_prefill_tokens,
        cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        num_scheduler_steps=args.num_scheduler_steps,
        async_scheduling=args.async_scheduling,
        admission=args.admission,
        load_format=args.load_format,
        **_parallel(args),
    )
    prompt = args.prompt_ids if args.prompt_ids is not None else args.prompt
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
    print(json.dumps({**out.metrics, "finish_reason": out.finish_reason}), file=sys.stderr)


def _serve(args) -> None:
    from serving import LLM, SamplingParams
    from serving.server import serve

    llm = LLM(
        args.model,
        memory_budget=args.memory_budget,
        memory_policy=args.memory_policy,
        speculative=_spec(args),
        max_num_seqs=args.max_num_seqs,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        prefill_chunk=args.prefill_chunk,
        prefill_buckets=args.prefill_buckets,
        max_prefill_tokens=args.max_prefill_tokens,
        cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        num_scheduler_steps=args.num_scheduler_steps,
        async_scheduling=args.async_scheduling,
        admission=args.admission,
        kernels=args.kernels,
        load_format=args.load_format,
        **_parallel(args),
    )
    name = args.served_model_name
    if name is None:
        shipped = Path(args.model).resolve() == (ASSETS / "target").resolve()
        name = SHIPPED_NAME if shipped else args.model
    if not args.no_warmup:  # compile every batch bucket before the first request
        print("compiling the engine's programs (warm-up) ...", file=sys.stderr, flush=True)
        for b in llm.engine.buckets:
            llm.generate([[0, 1]] * b, SamplingParams(max_tokens=2))
    print(
        f"serving {name!r} on http://{args.host}:{args.port}/v1"
        + (" (API key required)" if args.api_key else ""),
        file=sys.stderr,
        flush=True,
    )
    serve(
        llm,
        host=args.host,
        port=args.port,
        model_name=name,
        api_key=args.api_key,
        log_level=args.log_level,
    )


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
        num_scheduler_steps=args.num_scheduler_steps,
        async_scheduling=args.async_scheduling,
        json_path=args.json,
        load_format="dummy" if args.config else "auto",
        repeats=args.repeats,
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


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=str(ASSETS / "target"),
        help="local HF directory (config.json + safetensors weights); with --load-format "
        "dummy a directory or config.json gives random weights (default: the shipped tiny "
        "target)",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="'auto': load the weights; 'dummy': random weights from the config "
        "(default: %(default)s)",
    )


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-budget", type=int, default=None, help="arena bytes (default: auto)")
    p.add_argument(
        "--memory-policy",
        default="avmp",
        choices=("avmp", "unified_padded", "static_dual", "multi_ended"),
        help="memory manager policy (default: %(default)s)",
    )
    p.add_argument("--max-model-len", type=int, default=1024, help="most tokens per request")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=64,
        help="prompt tokens per request per prefill step (the H200 figures of "
        "benchmarks/model_step.py take 2048 for a 35B-class model)",
    )
    p.add_argument(
        "--prefill-buckets",
        type=lambda t: tuple(_ids(t)),
        default=(),
        metavar="W,W,...",
        help="smaller prefill widths: a step pads its rows to the smallest that holds its "
        "longest chunk, e.g. 128,512 with --prefill-chunk 2048 (default: none)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=None,
        help="most prompt tokens one prefill step computes (default: max(8192, prefill chunk))",
    )
    p.add_argument(
        "--cuda-graph-max-tokens",
        type=int,
        default=None,
        help="on a GPU, run only steps of at most this many tokens as CUDA graphs and launch "
        "larger ones kernel by kernel; 0: no graphs (default: every step a graph)",
    )
    p.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=1,
        help="steps per engine step, dispatched back to back with the tokens fed on the "
        "device: plain decoding, or speculation drafted on the device (draft model, "
        "MTP, n-gram static trees) (default: %(default)s)",
    )
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="overlap plain decoding's steps with the host: dispatch decode step t+1 before "
        "fetching step t's tokens (LLM(async_scheduling=True))",
    )
    p.add_argument(
        "--admission",
        default="chunk",
        choices=ADMISSIONS,
        help="what admitting a request reserves: its first prefill chunk's KV pages (chunk), "
        "or its whole prompt's (prompt: no preemption by its own prefill's growth when long "
        "prompts crowd the memory) (default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="weights and KV cache (default: float32; the Python API's LLM defaults to bfloat16)",
    )
    par = p.add_argument_group("parallelism (serving/parallel.py)")
    par.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="devices per engine: heads (and experts) split over them (default: 1)",
    )
    par.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="independent engine replicas, each over --tensor-parallel-size devices (default: 1)",
    )
    par.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="split the routed experts over the tensor-parallel devices, whole experts each",
    )
    par.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() first (multi-host: every host runs the same "
        "command; the coordinator comes from the environment, see docs/api.md)",
    )


def _parallel(args) -> dict:
    """The LLM's parallel keyword arguments (jax.distributed initialised first if asked)."""
    if args.distributed:
        import jax

        jax.distributed.initialize()
    return dict(
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
    )


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = _Parser(
        prog=prog or _prog(),
        description="Serve hybrid GDN models with continuous batching and tree speculative "
        "decoding (tree WY or per-node snapshot verification).",
        epilog=EPILOG,
    )
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate from one prompt", epilog=EPILOG)
    _model_args(g)
    text = g.add_mutually_exclusive_group()
    text.add_argument(
        "--prompt", default="def fibonacci(n):\n", help="text prompt (default: %(default)r)"
    )
    text.add_argument(
        "--prompt-ids", type=_ids, default=None, help="comma-separated token ids instead"
    )
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass")
    g.add_argument("--top-k", type=int, default=0, help="0 = no top-k")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    _engine_args(g)
    g.add_argument("--compile-cache", default=CACHE, help="XLA compilation cache ('' = off)")
    _spec_args(g, method="draft_model")
    g.set_defaults(func=_generate)

    v = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serves the model over an OpenAI-compatible HTTP API: /v1/completions, "
        "/v1/chat/completions (stream=true as server-sent events), /v1/models, /health. "
        "Requests join the running engine's continuous batching.",
        epilog=EPILOG,
    )
    _model_args(v)
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    v.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    v.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes"
    )
    v.add_argument(
        "--served-model-name",
        default=None,
        help=f"the model's name in the API (default: {SHIPPED_NAME!r} for the shipped model, "
        "else --model as given)",
    )
    v.add_argument("--max-num-seqs", type=int, default=8, help="most requests decoding at once")
    _engine_args(v)
    v.add_argument(
        "--kernels",
        default="auto",
        choices=("auto", "pallas", "xla", "pallas_tpu"),
        help="LLM(kernels=...): 'auto' the arena Pallas kernels on GPU, 'pallas' everywhere, "
        "'pallas_tpu' the TPU GDN kernels (value head dim 128), 'xla' none "
        "(default: %(default)s)",
    )
    v.add_argument("--compile-cache", default=CACHE, help="XLA compilation cache ('' = off)")
    v.add_argument(
        "--no-warmup", action="store_true", help="do not compile the programs before serving"
    )
    v.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level (default: %(default)s)",
    )
    _spec_args(v, method="none")
    v.set_defaults(func=_serve)

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
    b.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs per engine; the run of median time is reported (default: 1; a run of "
        "the tiny models takes under 0.1 s on a GPU, so use 5 or more there)",
    )
    b.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    b.add_argument("--json", default=None, help="also write the rows as JSON here")
    b.add_argument(
        "--kernels",
        default="auto",
        choices=("auto", "pallas", "xla", "pallas_tpu"),
        help="the engines' kernels (LLM(kernels=...)): 'auto' takes the arena Pallas kernels "
        "on GPU, 'pallas' everywhere (interpret mode off GPU: slow), 'pallas_tpu' the TPU GDN "
        "kernels (TPU interpret mode off a TPU: slow; value head dim 128), 'xla' none "
        "(default: %(default)s)",
    )
    b.add_argument(
        "--compile-cache",
        default=CACHE,
        help="XLA persistent compilation cache directory, so later runs skip compiling "
        "('' = off; default: %(default)s)",
    )
    b.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=1,
        help="LLM(num_scheduler_steps=...) of every engine: plain decode steps, or "
        "speculative steps drafted on the device, per engine step, back to back (default: "
        "%(default)s)",
    )
    b.add_argument(
        "--async-scheduling",
        action="store_true",
        help="LLM(async_scheduling=True) of every engine: plain decoding's steps overlapped "
        "with the host",
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
    t.add_argument(
        "--out",
        default="tiny-models",
        help="output directory (default: %(default)s in the current directory; "
        "serving/assets/tiny replaces the shipped models)",
    )
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


def compile_cache(directory: str) -> None:
    """XLA's persistent compilation cache: a second run loads the step programs from disk."""
    import jax

    if directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    compile_cache(getattr(args, "compile_cache", ""))
    if getattr(args, "out", None):
        Path(args.out).mkdir(parents=True, exist_ok=True)
    from serving.memory import OutOfMemoryError

    try:
        args.func(args)
    except (ValueError, OSError, OutOfMemoryError) as e:  # bad input: one line, no traceback
        message = " ".join(str(e).split()) or type(e).__name__
        p.exit(1, f"{p.prog} {args.command}: error: {message}\n")
    except KeyboardInterrupt:
        p.exit(130)
