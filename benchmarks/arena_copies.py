"""Whole-arena copies and scratch memory of the engine's arena programs (compile only).

    python -m benchmarks.arena_copies [--kernels auto] [--dump DIR] [--json out.json]

Every arena program donates the arena and must update it in place: a program whose compiled
form copies the whole arena moves the arena's bytes per copy and needs that much more device
memory. A small model (Qwen3.5-35B-A3B's layer pattern at tiny dims) with a 64 MiB arena is
served for a few tokens (plain decoding and tree WY speculation) to capture each program's
arguments; each program is then compiled again and its optimized HLO searched for copies of
the arena's shape, with XLA's memory analysis (scratch bytes against the arena's) and the
number of kernels the program launches (fusions and custom calls of its entry computation).
The programs: the runner's prefill, decode, verify and commit, and the one-program
speculative step (``spec_step``: draft levels, verify, acceptance, commit and the draft
model's catch-up prefill, with a 4-layer draft model in the same arena).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import numpy as np

from benchmarks.common import load_config, markdown_table, write_json
from benchmarks.layers import SMOKE
from serving.llm import LLM, load_model
from serving.params import SamplingParams, SpecConfig

ARENA = 64 << 20
PROGRAMS = ("_prefill", "_decode_packed", "_verify", "_commit")  # the engine's programs


def capture(runner) -> dict:
    """Wraps the runner's jitted programs; returns the dict their last arguments land in."""
    seen: dict = {}
    for name in PROGRAMS:
        fn = getattr(runner, name)

        def wrap(*a, _fn=fn, _name=name, **k):
            seen[_name] = (_fn, a, k)
            return _fn(*a, **k)

        setattr(runner, name, wrap)
    return seen


def capture_spec(speculator) -> dict:
    """Wraps the speculator's step programs; returns the dict the last step's arguments land
    in (as ``_spec_step``)."""
    seen: dict = {}
    for key, fn in list(speculator._programs.items()):

        def wrap(*a, _fn=fn, **k):
            seen["_spec_step"] = (_fn, a, k)
            return _fn(*a, **k)

        speculator._programs[key] = wrap
    return seen


def launches(hlo: str) -> int:
    """Kernel launches of the entry computation: its fusions and custom calls (Pallas kernels,
    GEMMs); the loops' bodies (none on the GPU's arena programs) are not counted."""
    entry = hlo[hlo.index("\nENTRY") :]
    entry = entry[: entry.index("\n}\n") if "\n}\n" in entry else len(entry)]
    return sum(1 for line in entry.splitlines() if " fusion(" in line or " custom-call(" in line)


def arena_copies(hlo: str, shape: tuple[int, ...]) -> int:
    dims = ",".join(map(str, shape))
    return sum(1 for line in hlo.splitlines() if " copy(" in line and f"[{dims}]" in line)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.arena_copies", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--kernels", default="auto", choices=["auto", "xla", "pallas"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dump", metavar="DIR", help="also write each program's optimized HLO here")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    _, cfg = load_config("qwen3_5_35b_a3b")
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cfg.update(SMOKE, vocab_size=512, num_hidden_layers=args.layers, mtp_num_hidden_layers=0)
    cfg.pop("layer_types", None)
    model = load_model(cfg, "bfloat16")
    draft = load_model({**cfg, "num_hidden_layers": 4}, "bfloat16")
    rows = []
    specs = (
        None,
        SpecConfig(method="ngram", tree=(2, 2), verify="wy"),
        SpecConfig(method="draft_model", draft_model=draft, tree=(2, 2), verify="wy"),
    )
    for spec in specs:
        llm = LLM(
            model,
            speculative=spec,
            max_num_seqs=4,
            batch_buckets=(4,),
            max_model_len=128,
            prefill_chunk=32,
            kernels=args.kernels,
            memory_budget=ARENA,
        )
        runner = llm.engine.runner
        if spec is not None and spec.method == "ngram":
            llm.engine.device_spec = None  # the runner's verify and commit programs
        seen = capture(runner)
        if spec is not None and spec.method == "draft_model":
            seen = capture_spec(llm.engine.device_spec)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(1, 500, 20).tolist() for _ in range(4)]
        llm.generate(prompts, SamplingParams(max_tokens=4))
        shape = tuple(runner.manager.arena.buffer.shape)
        arena_bytes = runner.manager.arena.buffer.nbytes
        for name, (fn, a, k) in seen.items():
            if spec is not None and spec.method == "ngram" and name in PROGRAMS[:2]:
                continue
            label = name[1:].removesuffix("_packed")
            compiled = fn.lower(*a, **k).compile()
            hlo = compiled.as_text()
            mem = compiled.memory_analysis()
            if args.dump:
                Path(args.dump).mkdir(parents=True, exist_ok=True)
                (Path(args.dump) / f"{label}_{args.kernels}.hlo.txt").write_text(hlo)
            rows.append(
                dict(
                    program=label,
                    kernels=runner.kernels,
                    arena_copies=arena_copies(hlo, shape),
                    launches=launches(hlo),
                    layers=args.layers,
                    temp_over_arena=mem.temp_size_in_bytes / arena_bytes,
                    backend=jax.default_backend(),
                )
            )
    cols = ["program", "kernels", "arena_copies", "temp_over_arena", "launches"]
    print(markdown_table(rows, cols))
    if args.json:
        write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
