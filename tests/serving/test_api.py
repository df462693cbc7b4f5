"""API surface: bad arguments raise ValueError naming them; the CLI's help lists every
subcommand; text prompts go through the byte tokenizer or an HF tokenizer.json (with its chat
template); generate in vLLM's form (text or ids, one SamplingParams or one per prompt);
streaming gives the same tokens and text as generate; stop strings; safetensors reads bf16;
the HF writer round-trips."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from gdn_jax.models import from_pretrained
from gdn_jax.models.fused import is_fused
from gdn_jax.models.gdn import GatedDeltaNet
from gdn_jax.models.moe import SparseMoE
from gdn_jax.models.safetensors_io import Checkpoint, write_safetensors
from serving import LLM, SamplingParams, SpecConfig
from serving.bench import ASSETS
from serving.checkpoint import save_pretrained
from serving.spec_trees import TreeBuilder
from serving.tokenizer import ByteTokenizer, HFTokenizer, encode_chat
from tests.serving.conftest import ENGINE

# The shipped tiny target at one geometry (the same in test_server / test_bad_input / test_cli,
# so the jitted programs compile once per session).
TINY = dict(dtype="float32", max_num_seqs=4, batch_buckets=(4,), max_model_len=256)
CODE = "def parse(self, text):\n"


@pytest.fixture(scope="module")
def tiny():
    return LLM(ASSETS / "target", **TINY)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
    ],
)
def test_sampling_params_validate(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(method="medusa"), "method"),
        (dict(verify="replay"), "verify"),
        (dict(tree=(4, 0)), "tree"),
        (dict(budget=1), "budget"),
        (dict(method="draft_model"), "draft_model"),
    ],
)
def test_spec_config_validates(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SpecConfig(**kwargs)


def test_spec_config_node_counts():
    assert SpecConfig(tree=(4, 2, 2)).num_nodes == 29
    assert SpecConfig(tree=(1, 1, 1, 1)).num_nodes == 5
    assert SpecConfig(budget=64).num_nodes == 64


def test_dynamic_tree_keeps_budget_most_probable_nodes():
    spec = SpecConfig(method="ngram", budget=6, depth=3, branch=3)
    tb = TreeBuilder(7, spec, None)
    q = np.array([0.6, 0.3, 0.1])
    level = 0
    while nodes := tb.frontier(level):
        for n in nodes:
            tb.expand(n, q)
        level += 1
    tb.finish()
    assert len(tb) == 6
    # cumulative probabilities: root 1, then .6 .36 .3 .216 .18 ... kept in that order
    np.testing.assert_allclose(sorted(np.exp(tb.logp))[::-1], [1, 0.6, 0.36, 0.3, 0.216, 0.18])
    for n, p in enumerate(tb.parents):
        assert p < n


def test_llm_validates(target):
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(target, max_num_seqs=0)
    with pytest.raises(ValueError, match="speculative"):
        LLM(target, speculative="ngram")
    llm = LLM(target, **ENGINE)
    with pytest.raises(ValueError, match=r"prompts\[0\] has ids outside"):
        llm.generate([[1, 2, 10_000]])
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="text prompts"):
        llm.generate(["hello"])


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("déjà vu")
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == "déjà vu"


def test_save_pretrained_round_trips(target, tmp_path):
    save_pretrained(target, tmp_path / "m")
    back = from_pretrained(tmp_path / "m", jnp.float32)
    ids = jnp.arange(12)[None] % target.config.vocab_size
    np.testing.assert_allclose(np.asarray(back(ids)), np.asarray(target(ids)), rtol=0.1, atol=0.1)


def test_cli_help_lists_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "serving", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("usage: python -m serving ")
    for cmd in ("generate", "serve", "bench", "train-tiny"):
        assert cmd in out


def test_llm_model_impl_follows_kernels(target):
    """The engine runs a view of the caller's model (the same weight arrays) whose own
    kernel-routed ops follow ``kernels``: XLA under ``"xla"`` (and off a GPU); the caller's
    model keeps its settings."""
    llm = LLM(target, kernels="xla", **ENGINE)
    impls = lambda model: {
        m.impl for _, m in nnx.iter_graph(model) if isinstance(m, GatedDeltaNet | SparseMoE)
    }
    assert impls(llm.model) == {"xla"} and impls(target) == {"auto"}
    assert llm.model.embed_tokens[...] is target.embed_tokens[...]


def test_llm_fuses_its_view(target):
    """The engine fuses the input projections of its own view (new arrays for those weights;
    the caller's model keeps its own), or not with ``fuse_projections=False``, and both give
    the same greedy tokens."""
    prompts = [[5, 17, 9, 3, 42, 7], [20, 1, 33]]
    params = SamplingParams(max_tokens=12)
    outs = []
    for fuse in (True, False):
        llm = LLM(target, kernels="xla", fuse_projections=fuse, **ENGINE)
        assert is_fused(llm.model) == fuse and not is_fused(target)
        assert target.layers[0].linear_attn.in_proj_qkv is not None
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]


def test_generate_takes_text_ids_and_dicts(tiny):
    """vLLM's prompt forms give the same tokens: text through the byte tokenizer, its ids, a
    dict of either; a flat list of ints is one prompt."""
    ids = ByteTokenizer().encode(CODE)
    params = SamplingParams(max_tokens=6)
    outs = tiny.generate([CODE, ids, {"prompt": CODE}, {"prompt_token_ids": ids}], params)
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert all(o.prompt_token_ids == ids and o.finish_reason == "length" for o in outs)
    (one,) = tiny.generate(ids, params)
    assert one.token_ids == outs[0].token_ids and one.text == outs[0].text


def test_sampling_params_one_per_prompt(tiny):
    outs = tiny.generate([CODE, CODE], [SamplingParams(max_tokens=3), SamplingParams(max_tokens=7)])
    assert [len(o.token_ids) for o in outs] == [3, 7]
    assert outs[1].token_ids[:3] == outs[0].token_ids
    with pytest.raises(ValueError, match="sampling_params: 1 given for 2 prompts"):
        tiny.generate([CODE, CODE], [SamplingParams()])
    with pytest.raises(ValueError, match=r"sampling_params\[1\]"):
        tiny.generate([CODE, CODE], [SamplingParams(), {"max_tokens": 3}])


def test_stream_matches_generate(tiny):
    """The stream's new tokens and text deltas add up to generate's output, request by request
    (two prompts in one batch); each request's last item carries its whole output."""
    params = SamplingParams(max_tokens=12)
    prompts = [CODE, "import os\n"]
    want = tiny.generate(prompts, params)
    toks, text, last = {0: [], 1: []}, {0: "", 1: ""}, {}
    for item in tiny.stream(prompts, params):
        toks[item.index] += item.token_ids
        text[item.index] += item.text
        if item.finished:
            last[item.index] = item
    for i, w in enumerate(want):
        assert toks[i] == w.token_ids and text[i] == w.text
        assert last[i].finish_reason == "length" and last[i].output.token_ids == w.token_ids
    # closing a stream early aborts its requests and frees their memory
    stream = tiny.stream(prompts, params)
    next(stream)
    stream.close()
    assert not tiny.has_unfinished_requests() and tiny.manager.stats()["requests"] == 0


def test_stop_strings(tiny):
    (full,) = tiny.generate([CODE], SamplingParams(max_tokens=24))
    stop = full.text.strip()[:4]
    cut = full.text.index(stop)
    (out,) = tiny.generate([CODE], SamplingParams(max_tokens=24, stop=[stop]))
    assert out.text == full.text[:cut] and out.finish_reason == "stop"
    streamed = "".join(
        x.text for x in tiny.stream([CODE], SamplingParams(max_tokens=24, stop=stop))
    )
    assert streamed == out.text
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])


def test_hf_tokenizer_and_chat_template(tmp_path):
    """A model directory with an HF tokenizer.json loads it through ``tokenizers``; chat
    messages go through its tokenizer_config.json chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=260,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CODE + "    return text\n"] * 10, trainer)
    d = tmp_path / "model"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    conf = json.loads((ASSETS / "target" / "config.json").read_text())
    del conf["tokenizer"]
    (d / "config.json").write_text(json.dumps(conf))
    shutil.copy(ASSETS / "target" / "model.safetensors", d / "model.safetensors")
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (d / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "eos_token": "<|im_end|>"})
    )
    llm = LLM(d, **TINY)
    assert isinstance(llm.tokenizer, HFTokenizer) and llm.tokenizer.eos_token_id == 1
    (out,) = llm.generate([CODE], SamplingParams(max_tokens=4))
    assert out.prompt_token_ids == tok.encode(CODE).ids and isinstance(out.text, str)
    ids = encode_chat(llm.tokenizer, [{"role": "user", "content": "hi"}])
    rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tok.encode(rendered, add_special_tokens=False).ids
    assert ids[0] == 0  # <|im_start|> is one special token
    # no template: "role: content" lines and "assistant:"
    ids = encode_chat(
        ByteTokenizer(), [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    )
    assert ByteTokenizer().decode(ids) == "user: hi\nassistant:"


def test_safetensors_reads_bf16_exactly(tmp_path):
    ckpt = Checkpoint(ASSETS / "target")
    emb = ckpt.get("model.embed_tokens.weight")
    assert emb.dtype == ml_dtypes.bfloat16 and ckpt.shape("model.embed_tokens.weight") == (260, 256)
    bits = np.arange(-300, 300, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(20, 30)
    write_safetensors(tmp_path / "x.safetensors", {"w": bits, "f": np.ones(3, np.float32)})
    back = Checkpoint(tmp_path).get("w")
    assert back.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back.view(np.uint16), bits.view(np.uint16))


def test_max_prefill_tokens_bounds_the_prefill_step(tiny):
    """``max_prefill_tokens`` caps the requests one prefill step takes (the oldest first);
    the tokens are those of an uncapped engine."""
    ps = [list(range(1 + i, 40 + 3 * i)) for i in range(4)]
    params = SamplingParams(max_tokens=5)
    want = [o.token_ids for o in tiny.generate(ps, params)]
    capped = LLM(ASSETS / "target", **TINY, max_prefill_tokens=64)  # one 64-token chunk
    runner = capped.engine.runner
    rows, inner = [], runner.prefill

    def prefill(handles, *a):
        rows.append(int((np.asarray(handles) >= 0).sum()))
        return inner(handles, *a)

    runner.prefill = prefill
    assert [o.token_ids for o in capped.generate(ps, params)] == want
    assert rows and max(rows) == 1
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        LLM(ASSETS / "target", **TINY, max_prefill_tokens=0)
