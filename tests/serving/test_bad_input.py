"""Bad input is refused at once with a ValueError naming the argument (and the file), never by
spinning, running out of host memory or a traceback from deep inside: impossible trees, memory
that can never fit, over-long prompts (the LLM stays usable), requests the scheduler finds can
never fit (rejected while the others go on), missing weights, malformed configs, corrupt weight
files, hub ids, prompts of the wrong type."""

from __future__ import annotations

import json
import shutil

import pytest

from gdn_jax.models import CheckpointError, from_pretrained
from serving import LLM, SamplingParams, SpecConfig
from serving.bench import ASSETS
from serving.llm import RequestTooLargeError
from serving.memory import OutOfMemoryError
from serving.scheduler import Request
from tests.serving.conftest import ENGINE

HUB_ID = "Qwen/Qwen3-Next-80B-A3B-Instruct"


@pytest.fixture(scope="module")
def llm(target):
    return LLM(target, **ENGINE)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tree=(100000,)), r"tree: \(100000,\) has 100001 nodes"),
        (dict(tree=(2,) * 12), "8191 nodes"),
        (dict(tree=(1,) * 5000), "tree: 5000 levels"),
        (dict(budget=100000), "budget must be an int in"),
        (dict(budget=10, depth=100000), "depth must be"),
        (dict(tree="4,2,2"), "tree must be"),
    ],
)
def test_impossible_trees_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpecConfig(**kwargs)


def test_chain_deeper_than_max_model_len_refused(target):
    spec = SpecConfig(tree=(1,) * 200)  # fits the node bound, not ENGINE's 96 tokens
    with pytest.raises(ValueError, match="speculative: a draft depth of 200"):
        LLM(target, speculative=spec, **ENGINE)


def test_memory_that_can_never_fit_refused(target):
    # 585 per-node snapshots do not fit a 1 MiB arena even for one request
    spec = SpecConfig(tree=(8, 8, 8), verify="snapshot")
    with pytest.raises(ValueError, match="memory_budget"):
        LLM(target, memory_budget=1 << 20, speculative=spec, **ENGINE)


def test_over_long_prompt_leaves_llm_usable(llm):
    with pytest.raises(
        ValueError,
        match=r"prompts\[0\]: 200 prompt tokens \+ max_tokens 64 = 264 tokens, more than "
        r"max_model_len=96",
    ):
        llm.generate([[1] * 200])
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        llm.generate([[1, 2, 3], [1] * 200])  # one bad prompt: nothing is queued
    assert not llm.scheduler.waiting and not llm.scheduler.running
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    assert len(out.token_ids) == 4


def _run(llm, max_steps: int = 200) -> int:
    steps = 0
    while llm.has_unfinished_requests():
        llm.step()
        steps += 1
        assert steps < max_steps, "a request is retried forever"
    return steps


def test_never_fitting_request_rejected_others_go_on(llm, target):
    """Requests that slip past the checks (queued on the scheduler directly) and can never fit
    are rejected at once, their memory freed, while the others finish."""
    params = SamplingParams(max_tokens=4)
    big = Request(index=0, rid="too-long", prompt=[1] * 200, params=params, arrival=0.0)
    llm.scheduler.add(big)
    rid = llm.add_request([1, 2, 3], params)
    outs = []
    while llm.has_unfinished_requests() or not big.finished:
        outs += [o for o in llm.step() if o.request_id == rid]
        assert len(outs) < 100
    assert big.finished and big.error.startswith("max_model_len: request 0 needs")
    assert outs[-1].finished and len(outs[-1].output.token_ids) == 4
    assert llm.manager.stats()["requests"] == 0

    # an arena of one state slot and one KV segment: the check refuses what cannot fit alone,
    # and a request queued past it is rejected when it outgrows the arena
    layout = llm.layout
    seg = max(layout.unit_bytes(k) for k in ("kv", "state", "snapshot", "stash"))
    small = LLM(target, memory_budget=2 * seg, segment_bytes=seg, **ENGINE)
    with pytest.raises(RequestTooLargeError, match="memory_budget holds at most") as info:
        small.generate([[1] * 80], params)
    assert isinstance(info.value, OutOfMemoryError)
    big = Request(index=0, rid="too-big", prompt=[1] * 80, params=params, arrival=0.0)
    small.scheduler.add(big)
    rid = small.add_request([1, 2, 3], params)
    _run(small)
    assert big.error.startswith("memory_budget: request 0")
    assert small.manager.stats()["requests"] == 0
    (out,) = small.generate([[4, 5, 6]], params)
    assert len(out.token_ids) == 4


@pytest.fixture()
def config_only(tmp_path):
    d = tmp_path / "config_only"
    d.mkdir()
    shutil.copy(ASSETS / "target" / "config.json", d / "config.json")
    return d


def test_weights_required_unless_dummy(config_only):
    with pytest.raises(
        ValueError, match=r"model: no \*.safetensors weights in .*load_format='dummy'"
    ):
        LLM(config_only)
    with pytest.raises(ValueError, match="model: .*config.json is a config file without weights"):
        LLM(config_only / "config.json")
    spec = SpecConfig(method="draft_model", draft_model=str(config_only), tree=(1,))
    with pytest.raises(ValueError, match="draft_model: no .*safetensors"):
        LLM(ASSETS / "target", speculative=spec, **ENGINE)
    llm = LLM(config_only, load_format="dummy", **ENGINE)  # random weights, asked for
    assert llm.config.vocab_size == 260 and llm.tokenizer is not None
    with pytest.raises(ValueError, match="load_format must be one of"):
        LLM(config_only, load_format="pt")


def test_malformed_config_names_the_file(config_only):
    path = config_only / "config.json"
    path.write_text('{"model_type": "qwen3_5_text",')
    for load in (
        lambda: LLM(config_only, load_format="dummy"),
        lambda: from_pretrained(config_only),
    ):
        with pytest.raises(ValueError, match=f"{path}: not valid JSON"):
            load()
    path.write_text(json.dumps({"model_type": "qwen3_5_text"}))
    with pytest.raises(ValueError, match=f"{path}: missing key 'hidden_size'"):
        LLM(config_only, load_format="dummy")


def test_corrupt_weights_name_the_file(config_only):
    weights = config_only / "model.safetensors"
    weights.write_bytes(b"\xff" * 64)  # a header length far beyond the file
    with pytest.raises(CheckpointError, match=f"{weights}: not a readable safetensors file"):
        LLM(config_only)
    weights.write_bytes((ASSETS / "target" / "model.safetensors").read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=f"{weights}: not a readable safetensors file"):
        from_pretrained(config_only)
    (config_only / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: not a safetensors"):
        from_pretrained(config_only)


def test_hub_ids_say_only_local_directories_load():
    with pytest.raises(ValueError, match=f"model: '{HUB_ID}' is not a local directory. Only local"):
        LLM(HUB_ID)
    with pytest.raises(FileNotFoundError, match="only local directories load"):
        from_pretrained(HUB_ID)
    with pytest.raises(ValueError, match="model: .*does not exist"):
        LLM("/no/such/model/dir")


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([None], r"prompts\[0\]: expected a string, a list of token ids or a dict, got NoneType"),
        (None, "prompts must be a string, token ids, a dict or a list"),
        ([], "prompts: no prompts"),
        ([[1, 2.5]], r"prompts\[0\]: .*non-int"),
        ([[1], {"text": "x"}], r"prompts\[1\]: a dict prompt needs"),
        (["abc"], r"prompts\[0\]: text prompts need a model tokenizer"),
    ],
)
def test_bad_prompts(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts)


def test_bad_sampling_params(llm):
    with pytest.raises(ValueError, match="sampling_params must be SamplingParams"):
        llm.generate([[1, 2]], "greedy")
    with pytest.raises(ValueError, match="stop: stop strings need a model tokenizer"):
        llm.generate([[1, 2]], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1])
