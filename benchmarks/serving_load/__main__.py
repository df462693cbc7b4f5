"""The serving engine under load: Poisson arrivals swept from light load to saturation, every
speculative method fed the same replayed drafts, and the memory policies on one engine.

    python -m benchmarks.serving_load --preset smoke --json benchmarks/results/serving_load/cpu_smoke.json
    python -m benchmarks.serving_load --preset full --workloads sharegpt --methods none,tree_wy \\
        --json OUT.json                                       # one H200 (benchmarks/device.sh)
    python -m benchmarks.serving_load plot A.json B.json --out DIR   # merge runs, plot

See benchmarks/serving_load/README.md for the workloads, the replay drafter and the clock.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import sys
import time
from pathlib import Path

# the arena takes what the weights leave (memory_budget auto): let the allocator grow on demand
# up to nearly all of the device's memory, not the client's default 75%
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")

from benchmarks.common import fmt_bytes, log, write_json
from benchmarks.serving_load import report
from benchmarks.serving_load.replay import ReplayParams, calibrate, chain_acceptance
from benchmarks.serving_load.run import (
    AUTO_HEADROOM,
    auto_budget,
    cached_oracle,
    finite,
    make_llm,
    model_for,
    oracle_pass,
    policy_study,
    run_method,
    warm_up,
)
from benchmarks.serving_load.workload import PRESETS, make_workload, methods
from serving.cli import compile_cache
from serving.scheduler import ADMISSIONS


def _rates(spec: str | None, default: dict) -> dict:
    """``'sharegpt=1,2,inf;longctx=0.1,inf'`` over the preset's rates."""
    out = dict(default)
    for part in filter(None, (spec or "").split(";")):
        name, vals = part.split("=")
        out[name] = tuple(float(v) for v in vals.split(","))
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.serving_load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    ap.add_argument("--workloads", help="comma list of sharegpt,longctx (default: the preset's)")
    ap.add_argument("--methods", help=f"comma list (default: the preset's) of {list(methods())}")
    ap.add_argument("--rates", help="per workload, e.g. 'sharegpt=1,4,inf;longctx=0.1,inf'")
    ap.add_argument("--requests", type=int, help="requests per workload (default: the preset's)")
    ap.add_argument(
        "--serve-requests",
        type=int,
        help="serve at most the first N requests of each workload at each rate (the workload "
        "and its cached oracle stay those of --requests)",
    )
    ap.add_argument("--num-layers", type=int, help="cut the config to this many layers")
    ap.add_argument("--max-num-seqs", type=int, help="running requests at most")
    ap.add_argument(
        "--batch-buckets", help="comma list of batch sizes compiled (default: the preset's)"
    )
    ap.add_argument("--memory-budget", help="arena bytes, or 'auto' (what the device has left)")
    ap.add_argument(
        "--headroom-gib",
        type=float,
        default=AUTO_HEADROOM / 2**30,
        help="memory_budget auto: GiB left to the programs' activations (default %(default)s)",
    )
    ap.add_argument(
        "--policies",
        choices=("yes", "no", "only"),
        default="yes",
        help="run the memory-policy comparison (on the shift workload)",
    )
    ap.add_argument(
        "--policy-method",
        help="the method the memory-policy comparison serves with (default: the preset's)",
    )
    ap.add_argument(
        "--policy-rate",
        type=float,
        help="requests / s of the memory-policy comparison's shifting workload, 'inf' for "
        "all at once (default: the preset's)",
    )
    ap.add_argument(
        "--policy-repeats",
        type=int,
        default=1,
        help="run the memory-policy comparison this many times, the policies' order rotated "
        "each time (medians and per-request means over the repeats)",
    )
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        help="tokens per request per prefill step (default: the preset's; the H200 model_step "
        "figures take 2048 for a 35B-class model)",
    )
    ap.add_argument(
        "--admission",
        choices=ADMISSIONS,
        default="chunk",
        help="what admitting a request reserves: its first prefill chunk's pages (chunk) or "
        "its whole prompt's (prompt); LLM(admission=...)",
    )
    ap.add_argument(
        "--target-accept",
        type=float,
        default=3.0,
        help="mean tokens per step of the chain that calibrates p_1",
    )
    ap.add_argument("--decay", type=float, default=0.9, help="p_d = p_1 * decay^(d-1)")
    ap.add_argument(
        "--sibling-hit",
        type=float,
        default=0.25,
        help="geometric rank offset of a true token not ranked first (0: absent)",
    )
    ap.add_argument(
        "--force-replay",
        action=argparse.BooleanOptionalAction,
        help="the target follows the oracle: acceptance takes the replayed continuation as "
        "the target's choice (its logits are computed all the same), for random weights whose "
        "near-tied logits round differently in a verify than in a decode (default: the "
        "preset's; on for full)",
    )
    ap.add_argument(
        "--compile-cache",
        default="",
        metavar="DIR",
        help="XLA's persistent compilation cache here ('' = off): a later run on the same "
        "machine whose programs match loads them from disk instead of compiling again",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--oracle-dir", help="cache of the oracle continuations (JSON per workload)")
    ap.add_argument("--json", help="write the results here (plots beside it)")
    ap.add_argument("--no-plots", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "plot":
        return _plot_main(argv[1:])
    args = _parser().parse_args(argv)
    t_start = time.perf_counter()
    if args.compile_cache:
        compile_cache(args.compile_cache)
    preset = dict(PRESETS[args.preset])
    if args.workloads:
        preset["workloads"] = tuple(args.workloads.split(","))
    if args.methods:
        preset["methods"] = tuple(args.methods.split(","))
    if args.requests:
        preset["requests"] = {k: args.requests for k in preset["requests"]}
    if args.serve_requests:
        preset["serve_requests"] = args.serve_requests
    if args.num_layers:
        preset["num_layers"] = args.num_layers
    if args.max_num_seqs:
        preset["max_num_seqs"] = args.max_num_seqs
    if args.batch_buckets:
        preset["batch_buckets"] = tuple(int(b) for b in args.batch_buckets.split(","))
    if max(preset["batch_buckets"]) > preset["max_num_seqs"]:
        raise SystemExit(
            f"--batch-buckets: {preset['batch_buckets']} exceeds max_num_seqs "
            f"{preset['max_num_seqs']}"
        )
    if args.memory_budget:
        mb = args.memory_budget
        preset["memory_budget"] = mb if mb == "auto" else int(float(mb))
    preset["admission"] = args.admission
    if args.policy_repeats < 1:
        raise SystemExit(f"--policy-repeats: must be >= 1, got {args.policy_repeats}")
    if args.prefill_chunk is not None:
        if args.prefill_chunk < 1:
            raise SystemExit(f"--prefill-chunk: must be >= 1, got {args.prefill_chunk}")
        preset["prefill_chunk"] = args.prefill_chunk
    if args.policy_method:
        preset["avmp_method"] = args.policy_method
    if args.policy_rate is not None:
        if not args.policy_rate > 0:
            raise SystemExit(f"--policy-rate: must be > 0, got {args.policy_rate}")
        preset["shift_rate"] = args.policy_rate
    rates = _rates(args.rates, preset["rates"])
    table = methods(tuple(preset["tree"]), preset["chain"], tuple(preset["wide"]))
    unknown = [m for m in preset["methods"] if m not in table]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; known: {list(table)}")
    if preset["avmp_method"] not in table:
        raise SystemExit(
            f"--policy-method: unknown {preset['avmp_method']!r}; known: {list(table)}"
        )
    p1 = calibrate(args.target_accept, preset["chain"], args.decay)
    force = preset["force_replay"] if args.force_replay is None else args.force_replay
    replay = ReplayParams(p1, args.decay, args.sibling_hit, args.seed, force)
    log(f"replay drafter: p_1 = {p1:.4f}, decay {args.decay}, sibling_hit {args.sibling_hit}")

    model = model_for(preset)
    vocab = model.config.vocab_size
    budget = preset["memory_budget"]
    if budget == "auto":
        budget = auto_budget(int(args.headroom_gib * 2**30))
    log(f"model {preset['model']} loaded; arena budget {fmt_bytes(budget)}")
    names = list(preset["workloads"] if args.policies != "only" else ())
    if args.policies != "no":
        names.append("shift")
    workloads = {w: make_workload(w, preset, vocab, args.seed) for w in names}

    # the oracle pass: plain greedy decoding of every request, once per workload (the plain
    # engine is built and compiled only when some workload's continuations are not cached)
    t0 = time.perf_counter()
    tag = f"{preset['model']}/{preset.get('num_layers')}/{preset['dtype']}/{preset['kernels']}"
    caches = {
        name: Path(args.oracle_dir) / f"{args.preset}_{name}.json" if args.oracle_dir else None
        for name in workloads
    }
    oracles = {name: cached_oracle(wl, caches[name], tag) for name, wl in workloads.items()}
    if any(o is None for o in oracles.values()):
        plain = make_llm(model, preset, table["none"], budget)
        warm_up(plain, preset, vocab)
        for name, wl in workloads.items():
            oracles[name] = oracle_pass(plain, wl, caches[name], tag)
        del plain
        gc.collect()
    oracle_s = time.perf_counter() - t0
    log(f"oracle pass: {oracle_s:.1f} s")

    rows = []
    doc = {
        "benchmark": "serving_load",
        "command": _command(argv),
        "preset": args.preset,
        "clock": "step clock: measured wall time of each engine step, idle gaps skipped",
        "config": {
            k: finite(v) if isinstance(v, float) else v for k, v in preset.items() if k != "rates"
        },
        "rates": {k: [finite(x) for x in v] for k, v in rates.items()},
        "memory_budget_bytes": budget,
        "headroom_bytes": int(args.headroom_gib * 2**30),
        "replay": {
            "p1": p1,
            "decay": args.decay,
            "sibling_hit": args.sibling_hit,
            "seed": args.seed,
            "force": force,
            "chain_depth": preset["chain"],
            "expected_chain_acceptance": chain_acceptance(p1, args.decay, preset["chain"]),
        },
        "workloads": {k: w.params() for k, w in workloads.items()},
        "oracle_s": oracle_s,
        "rows": rows,
        "refused": [],  # methods the engine refused on this device (memory), with its error
        "policies": None,
    }

    def write_partial():
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            write_json(args.json, {**doc, "partial": True})

    def save_partial(row):
        """Each measured row goes to the JSON at once (``"partial": true`` until the run
        ends), so a run stopped by a time limit keeps its rows."""
        rows.append({**row, "rate": finite(row["rate"])})
        write_partial()

    def save_policy(row):
        """The memory-policy rows likewise, as each policy is measured."""
        part = doc["policies"] or {"rows": [], "rate": finite(preset["shift_rate"])}
        part["rows"].append({**row, "rate": finite(row["rate"])})
        doc["policies"] = part
        write_partial()

    served = [workloads[w] for w in preset["workloads"]] if args.policies != "only" else []
    for key in preset["methods"] if served else ():
        try:
            run_method(
                model, preset, table[key], served, oracles, replay, budget, rates, vocab,
                on_row=save_partial,
            )  # fmt: skip
        except ValueError as e:  # the engine refused a program or arena the device cannot hold
            if not str(e).startswith("memory_budget"):
                raise
            log(f"{table[key].name}: refused: {e}")
            doc["refused"].append({"method": table[key].name, "error": str(e)})
            write_partial()
            gc.collect()
    if args.policies != "no":
        m = table[preset["avmp_method"]]
        policies = policy_study(
            model,
            preset,
            m,
            workloads["shift"],
            oracles["shift"],
            replay,
            budget,
            preset["shift_rate"],
            on_row=save_policy,
            repeats=args.policy_repeats,
        )
        for r in policies["rows"]:
            r["rate"] = finite(r["rate"])
        policies["rate"] = finite(preset["shift_rate"])
        doc["policies"] = policies
    doc["wall_s"] = time.perf_counter() - t_start
    print(report.tables(doc))
    for r in doc["refused"]:
        print(f"# refused: {r['method']}: {r['error']}")
    print(f"# wall time {doc['wall_s']:.1f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.json, doc)
        if not args.no_plots:
            stem = Path(args.json).stem
            for p in report.plots(doc, Path(args.json).parent, stem):
                log(f"wrote {p}")
    return doc


def _command(argv: list[str]) -> str:
    """The command line that made a run, without where it wrote (``--json``, ``--oracle-dir``,
    ``--compile-cache``: machine paths)."""
    keep, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--json", "--oracle-dir", "--compile-cache"):
            skip = True
        elif not a.startswith(("--json=", "--oracle-dir=", "--compile-cache=")):
            keep.append(shlex.quote(a))
    return " ".join(["python -m benchmarks.serving_load", *keep])


def _sources(path: str, doc: dict) -> list[str]:
    """What a merged document came from: a merged input's own sources, a run's command, or
    (a run written without one) its path."""
    if doc.get("merged_from"):
        return list(doc["merged_from"])
    return [doc.get("command") or path]


def _plot_main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serving_load plot")
    ap.add_argument("json", nargs="+", help="results of runs to merge")
    ap.add_argument("--out", required=True, help="folder for merged.json and the plots")
    args = ap.parse_args(argv)
    docs = [json.loads(Path(p).read_text()) for p in args.json]
    doc = dict(docs[0])
    doc["rows"] = [r for d in docs for r in d.get("rows") or []]
    doc["policies"] = next((d["policies"] for d in docs if d.get("policies")), None)
    doc.pop("command", None)
    doc["merged_from"] = [c for p, d in zip(args.json, docs, strict=True) for c in _sources(p, d)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "merged.json", doc)
    print(report.tables(doc))
    report.plots(doc, out, "merged")
    return doc


if __name__ == "__main__":
    main()
