"""The command line: errors are one ``error:`` line (no traceback), --prompt and --prompt-ids
exclude each other, the program names itself as invoked, train-tiny does not overwrite the
shipped models by default, generate prints the API's metrics, serve's defaults."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from serving import cli
from serving.bench import ASSETS


def _fail(capsys, argv, code):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: " in err and "Traceback" not in err, err
    return err


def test_prompt_and_prompt_ids_are_exclusive(capsys):
    err = _fail(capsys, ["generate", "--prompt", "x", "--prompt-ids", "1,2"], 2)
    assert "--prompt-ids: not allowed with argument --prompt" in err
    err = _fail(capsys, ["generate", "--prompt-ids", "1,a"], 2)
    assert "expected comma-separated ints" in err


def test_runtime_errors_are_one_line(capsys):
    err = _fail(capsys, ["generate", "--model", "Qwen/Qwen3-Next-80B-A3B-Instruct"], 1)
    assert "generate: error: model: 'Qwen/Qwen3-Next-80B-A3B-Instruct' is not a local" in err
    err = _fail(
        capsys,
        ["generate", "--method", "none", "--max-model-len", "64", "--prompt", "x" * 2000],
        1,
    )
    assert "prompts[0]: 2001 prompt tokens + max_tokens 64 = 2065 tokens" in err
    err = _fail(capsys, ["generate", "--method", "mtp", "--tree", "1,1,1,1", "--budget", "9999"], 1)
    assert "budget must be an int in" in err
    err = _fail(capsys, ["generate", "--method", "none", "--max-prefill-tokens", "0"], 1)
    assert "max_prefill_tokens must be a positive int, got 0" in err
    err = _fail(capsys, ["bench", "--repeats", "0", "--compile-cache", ""], 1)
    assert "bench: error: repeats must be >= 1, got 0" in err


def test_generate_prints_text_and_the_api_metrics(capsys):
    argv = ["generate", "--method", "none", "--max-tokens", "4", "--compile-cache", ""]
    cli.main([*argv, "--max-model-len", "256", "--prompt", "def f(x):\n"])
    out, err = capsys.readouterr()
    assert out.startswith("def f(x):\n")
    metrics = json.loads(err.strip().splitlines()[-1])
    assert metrics["num_tokens"] == 4 and metrics["acceptance_lengths"] == []
    assert metrics["finish_reason"] == "length"


def test_program_name_follows_invocation(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/gdn-serve", "--help"])
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: gdn-serve ")
    monkeypatch.setattr(sys, "argv", ["/x/serving/__main__.py"])
    assert cli.parser().prog == "python -m serving"


def test_installed_script_names_itself():
    # the README's install (pip install -e .) puts the script next to the interpreter
    script = shutil.which("gdn-serve") or str(Path(sys.executable).parent / "gdn-serve")
    assert Path(script).exists(), "gdn-serve is not installed (pip install -e .)"
    out = subprocess.run([script, "serve", "--help"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("usage: gdn-serve serve ")
    for flag in ("--api-key", "--host", "--port", "--served-model-name", "--load-format"):
        assert flag in out.stdout


def test_defaults():
    p = cli.parser()
    train = p.parse_args(["train-tiny"])
    assert Path(train.out).resolve() != ASSETS.resolve()
    serve = p.parse_args(["serve"])
    assert serve.host == "127.0.0.1" and serve.api_key is None and serve.method == "none"
    assert serve.prefill_chunk == 64 and serve.max_prefill_tokens is None
    assert p.parse_args(["generate"]).method == "draft_model"
    assert serve.admission == "chunk"
    assert p.parse_args(["generate", "--admission", "prompt"]).admission == "prompt"
