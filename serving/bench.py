"""The serving benchmark: the same prompts through no speculation, chain snapshot, tree
snapshot and tree WY verification, one engine each, after a warm-up run that compiles every
program (so the timed run measures a steady state). Prints a table and writes JSON.

Metrics: throughput (generated tokens per second of the timed run; with ``repeats`` runs, the
run of median wall time, whose TTFT and TPOT are reported too) and its ratio to the
no-speculation row's (``x_plain``), mean TTFT and TPOT over
requests, mean acceptance length (tokens emitted per verify step, 1.0 without speculation),
and speculative memory: the manager's bytes of speculative scratch per request (one tree-WY
``stash`` of N nodes, or N per-node ``snapshot`` states) and for the whole batch.
"""

from __future__ import annotations

import json
import sysconfig
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from serving.llm import LLM, load_model
from serving.params import SamplingParams, SpecConfig
from serving.tokenizer import BOS

ASSETS = Path(__file__).parent / "assets" / "tiny"
# The bench's draft tree: depth 5, two candidates at the first level. The shipped draft
# model's greedy drafts are long-lived, so depth pays more than width: on the bench's prompts
# it accepts 4.67 tokens a step with these 11 nodes against 3.79 with the 29 of (4, 2, 2).
BENCH_TREE = (2, 1, 1, 1, 1)


def stdlib_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` byte-level prompts: ``BOS`` and ``length`` bytes from the middle of standard
    library modules (the tiny models' training text)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 4 * length)
    rng = np.random.default_rng(seed)
    out = []
    for path in rng.choice(files, n, replace=False):
        data = path.read_bytes()
        start = int(rng.integers(0, len(data) - length))
        out.append([BOS, *data[start : start + length]])
    return out


class Progress:
    """A tqdm bar of tokens done / total on stderr. ``phase(name)`` names what runs now, so a
    long first compile shows as ``compiling`` rather than a stall; as a callable it counts
    emitted tokens (``LLM.generate(progress=...)``)."""

    def __init__(self, total: int, label: str = ""):
        self.label = label
        self.bar = tqdm(total=total, desc=label, unit="tok", dynamic_ncols=True, leave=True)

    def phase(self, name: str) -> None:
        self.bar.set_description(f"{self.label} ({name})" if name else self.label)

    def __call__(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def run(
    *,
    model=None,
    draft=None,
    method: str = "draft_model",
    tree: tuple[int, ...] = BENCH_TREE,
    chain: int | None = None,
    num_prompts: int = 8,
    prompt_len: int = 96,
    max_tokens: int = 64,
    max_num_seqs: int = 8,
    dtype: str = "float32",
    kernels: str = "auto",
    num_scheduler_steps: int = 1,
    async_scheduling: bool = False,
    json_path: str | None = None,
    progress: bool = True,
    load_format: str = "auto",
    repeats: int = 1,
) -> list[dict]:
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    model = load_model(
        model if model is not None else ASSETS / "target", jnp.dtype(dtype), load_format=load_format
    )
    if method == "draft_model":
        draft = load_model(draft if draft is not None else ASSETS / "draft", jnp.dtype(dtype))
    chain = len(tree) if chain is None else chain  # as many levels as the tree
    prompts = stdlib_prompts(num_prompts, prompt_len)
    vocab = model.config.vocab_size
    prompts = [[t % vocab for t in p] for p in prompts]
    cases = [
        ("no speculation", None),
        ("chain snapshot", dict(tree=(1,) * chain, verify="snapshot")),
        ("tree snapshot", dict(tree=tuple(tree), verify="snapshot")),
        ("tree WY", dict(tree=tuple(tree), verify="wy")),
    ]
    engine = dict(
        max_num_seqs=max_num_seqs,
        batch_buckets=(max_num_seqs,),
        max_model_len=prompt_len + max_tokens + 16,
        prefill_chunk=64,
        dtype=dtype,
        kernels=kernels,
        num_scheduler_steps=num_scheduler_steps,
        async_scheduling=async_scheduling,
    )
    params = SamplingParams(max_tokens=max_tokens)
    rows = []
    for name, kw in cases:
        spec = None
        if kw is not None:
            spec = SpecConfig(method=method, draft_model=draft, **kw)
        llm = LLM(model, speculative=spec, **engine)
        bar = Progress(len(prompts) * (max_tokens * repeats + 8), name) if progress else None
        if bar:
            bar.phase("compiling")
        llm.generate(prompts, SamplingParams(max_tokens=8), progress=bar)  # compile
        if bar:
            bar.phase("timed")
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, progress=bar)
            runs.append((time.perf_counter() - t0, outs))
        if bar:
            bar.close()
        if any([o.token_ids for o in r[1]] != [o.token_ids for o in outs] for r in runs):
            raise SystemExit(f"{name}: the repeated runs gave different tokens")
        wall, outs = sorted(runs, key=lambda r: r[0])[(repeats - 1) // 2]
        acc = [a for o in outs for a in o.metrics["acceptance_lengths"]]
        rows.append(
            dict(
                method=name,
                kernels=getattr(llm.runner, "kernels", "xla"),
                nodes=spec.num_nodes if spec else 1,
                throughput_tok_s=sum(len(o.token_ids) for o in outs) / wall,
                repeats=repeats,
                walls_ms=[1e3 * r[0] for r in runs],
                ttft_ms=1e3 * float(np.mean([o.metrics["ttft_s"] for o in outs])),
                tpot_ms=1e3 * float(np.mean([o.metrics["tpot_s"] for o in outs])),
                mean_acceptance_length=float(np.mean(acc)) if acc else 1.0,
                spec_bytes_per_request=llm.spec_bytes_per_request,
                spec_bytes_batch=llm.spec_bytes_per_request * max_num_seqs,
                outputs=[o.token_ids for o in outs],
            )
        )
    base = rows[0]["outputs"]
    for r in rows:
        r["same_tokens_as_plain"] = r.pop("outputs") == base
        r["x_plain"] = r["throughput_tok_s"] / rows[0]["throughput_tok_s"]
    print(table(rows, method))
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2))
    differ = [r["method"] for r in rows if not r["same_tokens_as_plain"]]
    if differ:  # greedy speculation is lossless: any difference is a bug
        raise SystemExit(f"speculative greedy output differs from plain greedy for: {differ}")
    return rows


def table(rows: list[dict], method: str) -> str:
    head = (
        f"| method ({method} drafter, {rows[0]['kernels']} kernels) | nodes | tok/s | x plain "
        "| TTFT ms | TPOT ms | mean accept len | spec memory / request | spec memory / batch "
        "| same tokens |"
    )
    lines = [head, "|" + " --- |" * 10]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['nodes']} | {r['throughput_tok_s']:.1f} | {r['x_plain']:.2f} "
            f"| {r['ttft_ms']:.1f} "
            f"| {r['tpot_ms']:.2f} | {r['mean_acceptance_length']:.2f} "
            f"| {_fmt_bytes(r['spec_bytes_per_request'])} | {_fmt_bytes(r['spec_bytes_batch'])} "
            f"| {'yes' if r['same_tokens_as_plain'] else 'NO'} |"
        )
    return "\n".join(lines)
