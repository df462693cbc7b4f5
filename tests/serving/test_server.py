"""The OpenAI-compatible server, through the official ``openai`` client against 127.0.0.1: plain
and streamed completions and chat give the same text under greedy, concurrent requests join one
engine, bad requests get HTTP 400 (401 without the API key) with an OpenAI-style error body and
the server stays up, a dropped stream frees its request."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from serving import LLM, SamplingParams
from serving.bench import ASSETS
from serving.server import create_app

TINY = dict(dtype="float32", max_num_seqs=4, batch_buckets=(4,), max_model_len=256)
KEY = "test-key"
NAME = "gdn-tiny"
CODE = "def parse(self, text):\n"


@pytest.fixture(scope="module")
def server():
    llm = LLM(ASSETS / "target", **TINY)
    # the Python API's greedy text, computed (and compiled) before the engine thread owns the LLM
    want = llm.generate([CODE], SamplingParams(max_tokens=12))[0].text
    step = llm.engine.step

    def counting_step():  # the most requests running together after a step
        step()
        llm.peak_running = max(llm.peak_running, len(llm.scheduler.running))

    llm.peak_running, llm.engine.step = 0, counting_step
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(llm, model_name=NAME, api_key=KEY)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    yield llm, f"http://127.0.0.1:{port}", want
    srv.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    r = httpx.get(server[1] + "/health")  # no key needed
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_completion_plain_and_stream_agree(server, client):
    kw = dict(model=NAME, prompt=CODE, max_tokens=12, temperature=0)
    plain = client.completions.create(**kw)
    (choice,) = plain.choices
    assert choice.finish_reason == "length" and plain.usage.completion_tokens == 12
    assert plain.usage.prompt_tokens == len(CODE) + 1  # BOS + bytes
    assert choice.text == server[2]  # the Python API's text
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_plain_and_stream_agree(client):
    kw = dict(
        model=NAME,
        messages=[{"role": "user", "content": "def fibonacci(n):"}],
        max_tokens=10,
        temperature=0,
    )
    plain = client.chat.completions.create(**kw)
    msg = plain.choices[0].message
    assert msg.role == "assistant" and plain.usage.completion_tokens == 10
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].usage.completion_tokens == 10


def test_concurrent_requests_match_sequential(server, client):
    prompts = [CODE, "import os\n", "class Foo:\n", "for i in range(", "x = ["]

    def ask(p):
        r = client.completions.create(model=NAME, prompt=p, max_tokens=10, temperature=0)
        return r.choices[0].text

    alone = [ask(p) for p in prompts]
    server[0].peak_running = 0
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone
    assert server[0].peak_running > 1  # they shared engine steps
    # several prompts in one request: one choice each, in order
    r = client.completions.create(model=NAME, prompt=prompts[:3], max_tokens=10, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == alone[:3]


def test_stop_strings(client):
    kw = dict(model=NAME, prompt=CODE, max_tokens=24, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = full.strip()[:3]
    r = client.completions.create(**kw, stop=[stop]).choices[0]
    assert r.text == full[: full.index(stop)] and r.finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**kw, stop=stop, stream=True)
    )
    assert streamed == r.text


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=2.0), "top_p"),
        (dict(prompt="x" * 300), "prompt"),
        (dict(prompt=[[1, 2, 100_000]]), "prompt"),
        (dict(n=2), "n"),
        (dict(logprobs=2), "logprobs"),
        (dict(prompt=None), "prompt"),
    ],
)
def test_bad_requests_get_400(client, kw, param):
    args = {"model": NAME, "prompt": "abc", "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args)
    err = info.value
    assert err.status_code == 400 and err.param == param and err.type == "invalid_request_error"
    assert err.body["message"]
    # the server stays up
    assert client.completions.create(model=NAME, prompt="abc", max_tokens=2).usage


def test_bad_requests_raw(server, client):
    url, auth = server[1], {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers=auth)
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": []}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="abc", max_tokens=2)
    # the over-long prompt is refused with the right count, and the next request runs
    with pytest.raises(openai.BadRequestError, match="2001 prompt tokens"):
        client.completions.create(model=NAME, prompt="x" * 2000, max_tokens=4)
    assert client.completions.create(model=NAME, prompt="abc", max_tokens=2).choices[0].text


def test_api_key_required(server):
    url = server[1]
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "abc"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_dropped_stream_frees_its_request(server):
    llm, url, _ = server
    body = {"model": NAME, "prompt": CODE, "max_tokens": 200, "stream": True}
    with httpx.stream(
        "POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    deadline = time.monotonic() + 20
    while llm.has_unfinished_requests():
        assert time.monotonic() < deadline, "the dropped request was not aborted"
        time.sleep(0.05)
