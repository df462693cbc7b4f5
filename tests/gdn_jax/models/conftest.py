"""Tiny random HF checkpoints (created by transformers in the side venv) and their reference
logits, shared by the model tests. Missing side venv: the fixtures raise, the tests fail."""

from __future__ import annotations

import numpy as np
import pytest

from tests.hf_reference import run_hf

KINDS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
VOCAB = 101
PROMPT = 9  # prompt length P; the prefill sequence has T = PROMPT + 5 tokens
PARENTS = np.array([-1, 0, 0, 1, 1, 2, 3, -1], np.int32)  # two roots, depth up to 3


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """``kind -> (checkpoint dir, inputs, reference outputs)``, built once per session."""
    cache: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in cache:
            rng = np.random.default_rng(KINDS.index(kind))
            inputs = dict(
                kind=kind,
                seed=KINDS.index(kind) + 1,
                ids=rng.integers(0, VOCAB, (2, PROMPT + 5)),
                prompt_len=PROMPT,
                tree_tokens=rng.integers(0, VOCAB, (2, len(PARENTS))),
                parents=PARENTS,
                with_mtp=True,
                bf16=kind == "qwen3_5_text",
            )
            work = tmp_path_factory.mktemp(kind)
            ckpt = work / "ckpt"
            ckpt.mkdir()
            out = run_hf("hf_models.py", "model", inputs, work, str(ckpt))
            cache[kind] = (ckpt, inputs, out)
        return cache[kind]

    return get
