"""Serving side: memory manager, speculative decoding, engine (see docs/design.md).

``LLM(model, memory_budget=..., memory_policy="avmp", speculative=SpecConfig(...))`` and
``llm.generate(prompt_token_ids, SamplingParams(...))``."""

from serving.llm import LLM, RequestOutput
from serving.params import SamplingParams, SpecConfig

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpecConfig"]
