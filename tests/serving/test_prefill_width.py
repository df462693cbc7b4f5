"""Prefill width buckets (``LLM(prefill_buckets=...)``, :meth:`serving.engine.Engine.prefill_width`):
a step pads its rows to the smallest bucket that holds its longest chunk, so a large
``prefill_chunk`` runs short prompts in narrow steps, with the same tokens as a small chunk;
without buckets every step is ``prefill_chunk`` wide."""

from __future__ import annotations

import numpy as np
import pytest

from serving import LLM, SamplingParams
from serving.bench import ASSETS

TINY = dict(dtype="float32", max_num_seqs=2, batch_buckets=(2,), max_model_len=400)


def _widths(llm, prompts, params):
    """The generated tokens and each prefill step's ``(tokens per row, longest chunk)``."""
    seen = []
    inner = llm.engine.runner.prefill

    def spy(*args):
        tokens, counts = args[-2], args[-1]
        seen.append((tokens.shape[1], int(np.max(counts))))
        return inner(*args)

    llm.engine.runner.prefill = spy
    try:
        out = llm.generate(prompts, params)
    finally:
        del llm.engine.runner.prefill
    return [o.token_ids for o in out], seen


def test_prefill_width_rule():
    llm = LLM(ASSETS / "target", **TINY, prefill_chunk=200, prefill_buckets=(128, 64))
    width = llm.engine.prefill_width
    assert [width(n) for n in (1, 64, 65, 128, 129, 200)] == [64, 64, 128, 128, 200, 200]
    plain = LLM(ASSETS / "target", **TINY, prefill_chunk=200)
    assert [plain.engine.prefill_width(n) for n in (1, 200)] == [200, 200]


def test_buckets_pad_short_prompts_narrowly_with_the_same_tokens():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 250, n).tolist() for n in (23, 90)]
    params = SamplingParams(max_tokens=6)
    small = LLM(ASSETS / "target", **TINY, prefill_chunk=32)
    ref, ref_steps = _widths(small, prompts, params)
    assert ref_steps == [(32, 32), (32, 32), (32, 26)]  # 90 = 32 + 32 + 26
    wide = LLM(ASSETS / "target", **TINY, prefill_chunk=256, prefill_buckets=(64, 128))
    got, steps = _widths(wide, prompts, params)
    assert got == ref
    assert steps == [(128, 90)]  # one step for both prompts, 128 tokens a row (not 256)
    long_prompt = [rng.integers(1, 250, 300).tolist()]
    ref, _ = _widths(small, long_prompt, params)
    got, steps = _widths(wide, long_prompt, params)
    assert got == ref
    assert steps == [(256, 256), (64, 44)]
    _, steps = _widths(LLM(ASSETS / "target", **TINY, prefill_chunk=256), prompts, params)
    assert steps == [(256, 90)]  # no buckets: every step prefill_chunk wide


@pytest.mark.parametrize("bad", [(0,), (300,), (64.0,), (True,)])
def test_bad_prefill_buckets_raise(bad):
    with pytest.raises(ValueError, match="^prefill_buckets"):
        LLM(ASSETS / "target", **TINY, prefill_chunk=256, prefill_buckets=bad)
