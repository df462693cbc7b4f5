"""The serving-load benchmark: the replay drafter's acceptance against its calibration (host
only), and the CPU smoke preset end to end (every speculative method gives plain decoding's
tokens; the JSON carries every reported field)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.serving_load.replay import (
    ReplayDrafter,
    ReplayParams,
    calibrate,
    chain_acceptance,
)
from benchmarks.serving_load.workload import POLICIES, methods
from serving.acceptance import greedy_accept
from serving.spec_trees import TreeBuilder


def _accept(drafter, spec, prompt, oracle, generated):
    """Tokens one step accepts (greedy) when the target's argmax follows ``oracle``."""
    ctx = np.asarray(prompt + oracle[:generated], np.int64)
    tb = TreeBuilder(int(ctx[-1]), spec, None)
    drafter.draft([ctx], [tb])
    truth = oracle[generated:]
    argmax = np.full(len(tb), -1)
    for n in drafter._true_nodes(tb, np.asarray(truth)):
        if tb.depth[n] < len(truth):
            argmax[n] = truth[tb.depth[n]]
    path, _ = greedy_accept(tb, argmax)
    return len(path), tb


def test_calibration_and_replayed_acceptance():
    p1 = calibrate(3.0, depth=4, decay=0.9)
    assert chain_acceptance(p1, 0.9, 4) == pytest.approx(3.0, abs=1e-9)
    vocab, rng = 1000, np.random.default_rng(0)
    drafter = ReplayDrafter(vocab, ReplayParams(p1, 0.9, 0.25, seed=1))
    prompt = rng.integers(1, vocab, 12).tolist()
    oracle = rng.integers(0, vocab, 4000).tolist()
    drafter.register(0, prompt, oracle)
    table = methods(tree=(4, 2, 2), chain=4, wide=(32,))
    got = {}
    for key in ("chain_snapshot", "tree_wy", "wide_wy_32"):
        spec = table[key].spec
        acc = [_accept(drafter, spec, prompt, oracle, g)[0] for g in range(1, 3000, 3)]
        got[key] = float(np.mean(acc))
    assert got["chain_snapshot"] == pytest.approx(3.0, abs=0.1)  # the calibrated chain
    assert got["tree_wy"] > got["chain_snapshot"] - 0.3  # shallower (3 levels) but wider
    assert got["wide_wy_32"] > got["chain_snapshot"]  # deeper and wider
    # the same request and position give the same tree, and an off-path context is random
    a = _accept(drafter, table["tree_wy"].spec, prompt, oracle, 7)[1]
    b = _accept(drafter, table["tree_wy"].spec, prompt, oracle, 7)[1]
    assert (a.tokens, a.parents) == (b.tokens, b.parents)
    before = drafter.off_path_steps
    wrong = [*oracle[:5], (oracle[5] + 1) % vocab]
    _accept(drafter, table["chain_snapshot"].spec, prompt, wrong + oracle[6:], 6)
    assert drafter.off_path_steps == before + 1


def test_smoke_preset(tmp_path):
    from benchmarks.serving_load.__main__ import main

    out = tmp_path / "smoke.json"
    main(["--preset", "smoke", "--json", str(out)])
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert {r["method"] for r in rows} == {
        "no speculation",
        "chain snapshot (4)",
        "tree snapshot",
        "tree WY",
    }
    assert {r["rate"] for r in rows} == {8.0, "inf"}
    keys = (
        "request_throughput",
        "token_throughput",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "tpot_p99_ms",
        "peak_concurrency",
        "preemptions",
        "spec_bytes_per_request",
        "peak_spec_bytes",
        "peak_kv_bytes",
        "mean_acceptance_length",
    )
    for r in rows:
        assert all(r[k] is not None for k in keys), r
        assert r["completed"] == r["requests"] and r["rejected"] == 0
        # greedy speculation is lossless: every method gives the oracle's (plain) tokens
        assert r["same_tokens_as_plain"] == 1.0, r["method"]
        assert r["compiled_during_run"] == 0
        if r["nodes"] > 1:
            assert r["mean_acceptance_length"] > 1.5 and r["spec_bytes_per_request"] > 0
    pol = doc["policies"]
    assert [r["policy"] for r in pol["rows"]] == [
        "avmp",
        "unified_padded",
        "static_dual",
        "multi_ended",
    ]
    for r in pol["rows"]:
        assert r["same_tokens_as_plain"] == 1.0
        assert {"migrations", "preemptions", "rejected"} <= set(r)
    assert set(pol["avmp_gain_ci95"]) == {"unified_padded", "static_dual", "multi_ended"}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "smoke_throughput.png").exists()
    assert (tmp_path / "smoke_ttft_cdf.png").exists()


def test_policy_method_and_rate(tmp_path):
    """``--policy-method`` and ``--policy-rate`` pick what the memory-policy comparison serves
    (here with whole-prompt admission, chunks of 16 and two repeats); a binding budget still gives every policy the plain
    tokens."""
    from benchmarks.serving_load.__main__ import main

    for bad in (
        ["--policy-method", "beam"],
        ["--policy-rate", "0"],
        ["--prefill-chunk", "0"],
        ["--policy-repeats", "0"],
    ):
        with pytest.raises(SystemExit, match=bad[0]):
            main(["--preset", "smoke", "--policies", "only", *bad])
    out = tmp_path / "pol.json"
    argv = ["--preset", "smoke", "--policies", "only", "--policy-method", "tree_wy"]
    argv += ["--admission", "prompt", "--prefill-chunk", "16", "--policy-repeats", "2"]
    main([*argv, "--policy-rate", "inf", "--memory-budget", "700000", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["rows"] == [] and "partial" not in doc
    pol = doc["policies"]
    assert pol["rate"] == "inf" and pol["repeats"] == 2 and len(pol["rows"]) == 8
    # the second repeat rotates the order, so AVMP does not always run first
    order = [(r["repeat"], r["policy"]) for r in pol["rows"]]
    assert order[3:5] == [(0, "multi_ended"), (1, "unified_padded")] and order[-1] == (1, "avmp")
    assert set(pol["median_request_throughput"]) == set(POLICIES)
    assert set(pol["avmp_gain_ci95"]) == set(POLICIES[1:])
    assert doc["config"]["prefill_chunk"] == 16 and doc["config"]["admission"] == "prompt"
    for r in pol["rows"]:
        assert r["method"] == "tree WY" and r["rate"] == "inf"
        assert r["completed"] == r["requests"] and r["same_tokens_as_plain"] == 1.0
        assert r["mean_acceptance_length"] > 1.5
    # the run records its command (not where it wrote); merges keep their runs' commands
    command = "python -m benchmarks.serving_load " + " ".join(
        [*argv, "--policy-rate", "inf", "--memory-budget", "700000"]
    )
    assert doc["command"] == command
    main(["plot", str(out), "--out", str(tmp_path / "m1")])
    (tmp_path / "bare.json").write_text(json.dumps({**doc, "command": None}))
    inputs = [str(tmp_path / "m1" / "merged.json"), str(tmp_path / "bare.json")]
    merged = main(["plot", *inputs, "--out", str(tmp_path / "m2")])
    assert merged["merged_from"] == [command, str(tmp_path / "bare.json")]
    assert "command" not in merged


@pytest.mark.parametrize("key", ["tree_wy", "chain_snapshot"])
def test_forced_replay_follows_any_oracle(key):
    """With ``force`` the engine emits the replayed continuation even where the model would
    not (a random oracle, not the tiny model's greedy text): every token after the first, at
    the replay's acceptance, so that random-weight models can be benchmarked."""
    from benchmarks.serving_load.run import install_replay, serve
    from benchmarks.serving_load.workload import Workload
    from serving import LLM
    from serving.bench import ASSETS

    table = methods(tree=(2, 1, 1), chain=3, wide=())
    llm = LLM(
        str(ASSETS / "target"),
        speculative=table[key].spec,
        dtype="float32",
        max_num_seqs=2,
        batch_buckets=(2,),
        prefill_chunk=32,
        max_model_len=96,
        kernels="xla",
    )
    vocab = llm.config.vocab_size
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, vocab, 12).tolist() for _ in range(2)]
    out_len = np.array([20, 14])
    oracle = [rng.integers(0, vocab, n).tolist() for n in out_len]
    wl = Workload("t", np.array([12, 12]), out_len, prompts, np.zeros(2))
    p1 = calibrate(2.5, depth=3, decay=0.9)
    install_replay(llm, wl, oracle, ReplayParams(p1, 0.9, 0.25, seed=0, force=True))
    row = serve(llm, wl, float("inf"), 2, oracle, skip_first=True)
    assert row["completed"] == 2
    assert row["same_tokens_as_plain"] == 1.0  # every token after the first is the oracle's
    assert row["mean_acceptance_length"] > 1.3
    # without force the random oracle is left at once: the drafts are random, nothing accepted
    install_replay(llm, wl, oracle, ReplayParams(p1, 0.9, 0.25, seed=0, force=False))
    row = serve(llm, wl, float("inf"), 2, oracle, skip_first=True)
    assert row["same_tokens_as_plain"] == 0.0


def test_a_method_the_device_cannot_hold_is_recorded_and_the_rest_run(tmp_path, monkeypatch):
    """A method whose engine refuses a program for memory (the ValueError naming
    memory_budget) is listed under ``refused`` with its error, and the other methods run;
    any other error still stops the run."""
    import benchmarks.serving_load.__main__ as cli

    real = cli.run_method

    def refuse_tree_wy(model, preset, method, *a, **k):
        if method.name == "tree WY":
            raise ValueError("memory_budget / max_num_seqs: a step program needs 9 GiB")
        return real(model, preset, method, *a, **k)

    monkeypatch.setattr(cli, "run_method", refuse_tree_wy)
    out = tmp_path / "r.json"
    argv = ["--preset", "smoke", "--policies", "no", "--methods", "none,tree_wy"]
    cli.main([*argv, "--rates", "sharegpt=inf", "--no-plots", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert [r["method"] for r in doc["rows"]] == ["no speculation"]
    assert doc["refused"] == [
        {"method": "tree WY", "error": "memory_budget / max_num_seqs: a step program needs 9 GiB"}
    ]
    monkeypatch.setattr(cli, "run_method", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cli.main([*argv, "--rates", "sharegpt=inf", "--no-plots"])
