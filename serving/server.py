"""An OpenAI-compatible HTTP server over one :class:`~serving.llm.LLM` (FastAPI + uvicorn):
``python -m serving serve``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the tokenizer's chat template
when it has one), ``stream: true`` on both as server-sent events, ``GET /v1/models`` and
``GET /health``. With an API key every ``/v1`` route needs ``Authorization: Bearer KEY``.

One engine thread owns the LLM: it takes new requests and aborts from a queue between engine
steps (so HTTP requests join the running batch: continuous batching), steps the engine while
any request is in flight, and hands each request's news to its HTTP handler's asyncio queue.
Handlers check a request fully before queueing it, so a bad one gets HTTP 400 with an
OpenAI-style error body (``{"error": {"message", "type", "param", "code"}}``) and never reaches
the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import random
import secrets
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from serving.llm import LLM, StreamOutput
from serving.params import SamplingParams
from serving.tokenizer import encode_chat

log = logging.getLogger("serving.server")


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with HTTP ``status``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = (
            message,
            status,
            param,
            type,
            code,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _param_of(message: str) -> str | None:
    """The argument a ``ValueError`` message names first (``"top_p must be ..."`` -> top_p)."""
    head = message.split(":", 1)[0].split(" ", 1)[0]
    return head if head.replace("_", "").replace("[", "").replace("]", "").isalnum() else None


# ------------------------------------------------------------------------- engine thread


class EngineThread:
    """Steps one :class:`LLM` on a thread of its own. ``submit`` and ``abort`` may be called
    from any thread; each request's :class:`StreamOutput` items (or an ``Exception`` when the
    engine failed) go to the ``sink`` given with it."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.failures = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gdn-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join(timeout=60)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(
        self,
        key: Hashable,
        ids: list[int],
        params: SamplingParams,
        index: int,
        sink: Callable[[Any], None],
    ) -> None:
        self._inbox.put(("add", key, ids, params, index, sink))

    def abort(self, key: Hashable) -> None:
        self._inbox.put(("abort", key))

    def _run(self) -> None:
        llm = self.llm
        rid_of: dict[Hashable, Hashable] = {}  # key -> the LLM's request id
        entry: dict[Hashable, tuple[Hashable, Callable]] = {}  # request id -> (key, sink)
        while True:
            items = []
            if not llm.has_unfinished_requests():
                items.append(self._inbox.get())  # idle: wait for work
            with contextlib.suppress(queue.Empty):
                while True:
                    items.append(self._inbox.get_nowait())
            for item in items:
                if item is None:  # shutting down
                    for rid, (_, sink) in entry.items():
                        llm.abort_request(rid)
                        sink(RuntimeError("the server is shutting down"))
                    return
                if item[0] == "add":
                    _, key, ids, params, index, sink = item
                    try:
                        rid = llm.add_request(ids, params, index=index)
                    except ValueError as e:
                        sink(e)
                        continue
                    rid_of[key] = rid
                    entry[rid] = (key, sink)
                else:
                    rid = rid_of.pop(item[1], None)
                    if rid is not None:
                        entry.pop(rid, None)
                        llm.abort_request(rid)
            if not llm.has_unfinished_requests():
                continue
            try:
                outs = llm.step()
            except Exception as e:  # an engine failure fails the requests in flight, not the server
                self.failures += 1
                log.error("engine step failed:\n%s", traceback.format_exc())
                for rid, (_, sink) in list(entry.items()):
                    with contextlib.suppress(Exception):  # its state may be half-updated
                        llm.abort_request(rid)
                    sink(RuntimeError(f"the engine failed: {type(e).__name__}: {e}"))
                rid_of.clear()
                entry.clear()
                continue
            for out in outs:
                if out.request_id not in entry:
                    continue
                key, sink = entry[out.request_id]
                sink(out)
                if out.finished:
                    del entry[out.request_id]
                    rid_of.pop(key, None)


# ---------------------------------------------------------------------------- requests


class _Common(BaseModel):
    """Fields both endpoints share (OpenAI's, plus vLLM's ``top_k`` and ``stop_token_ids``);
    unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


def _unsupported(req: _Common) -> None:
    checks = [
        ("n", req.n not in (None, 1), "only n=1 is supported"),
        ("presence_penalty", bool(req.presence_penalty), "penalties are not supported"),
        ("frequency_penalty", bool(req.frequency_penalty), "penalties are not supported"),
        ("logit_bias", bool(req.logit_bias), "logit_bias is not supported"),
    ]
    if isinstance(req, CompletionRequest):
        checks += [
            ("echo", bool(req.echo), "echo is not supported"),
            ("logprobs", req.logprobs is not None, "logprobs are not supported"),
            ("best_of", req.best_of not in (None, 1), "only best_of=1 is supported"),
            ("suffix", bool(req.suffix), "suffix is not supported"),
        ]
    else:
        checks += [
            ("logprobs", bool(req.logprobs), "logprobs are not supported"),
            ("tools", bool(req.tools), "tools are not supported"),
            (
                "response_format",
                bool(req.response_format) and req.response_format.get("type") != "text",
                "only response_format type 'text' is supported",
            ),
        ]
    for param, bad, why in checks:
        if bad:
            raise APIError(f"{param}: {why}", param=param)


def _sampling(req: _Common, max_tokens: int | None) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k in (None, -1) else req.top_k,
            seed=random.getrandbits(31) if req.seed is None else req.seed,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            stop=tuple(stop),
        )
    except ValueError as e:
        raise APIError(str(e), param=_param_of(str(e))) from None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


# -------------------------------------------------------------------------------- the app


def create_app(llm: LLM, *, model_name: str = "gdn-tiny", api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``llm`` as ``model_name``; its lifespan starts and stops the
    engine thread. ``api_key``: required as a bearer token on every ``/v1`` route."""
    engine = EngineThread(llm)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="gdn-jax", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        parts, first = [], None
        for err in exc.errors():
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            first = first or (loc[0] if loc else None)
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
        return JSONResponse(APIError("; ".join(parts), param=first).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(str(exc.detail), status=exc.status_code, type=kind)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                err = APIError(
                    "Incorrect or missing API key (send 'Authorization: Bearer KEY').",
                    status=401,
                    code="invalid_api_key",
                )
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "gdn-jax",
                    "max_model_len": llm.max_model_len,
                }
            ],
        }

    def check_model(req: _Common) -> None:
        if req.model is not None and req.model != model_name:
            raise APIError(
                f"The model `{req.model}` does not exist (this server serves `{model_name}`).",
                status=404,
                param="model",
                code="model_not_found",
            )

    def room(ids: list[int]) -> int:
        """Tokens a request of prompt ``ids`` may generate within ``max_model_len``."""
        depth = llm.speculative.max_depth if llm.speculative else 0
        return llm.max_model_len - len(ids) - depth

    def check(ids: list[int], params: SamplingParams, name: str) -> None:
        try:
            llm.check_request(ids, params, name)
        except ValueError as e:
            raise APIError(str(e), param=_param_of(str(e))) from None

    def launch(
        prompts: list[list[int]], params: SamplingParams
    ) -> tuple[list[Hashable], asyncio.Queue]:
        """Queues every prompt; their news arrives on the returned queue as ``(i, item)``."""
        loop, box = asyncio.get_running_loop(), asyncio.Queue()
        keys = []
        for i, ids in enumerate(prompts):
            key = uuid.uuid4().hex

            def sink(item, i=i):
                loop.call_soon_threadsafe(box.put_nowait, (i, item))

            engine.submit(key, ids, params, i, sink)
            keys.append(key)
        return keys, box

    async def finals(keys: list[Hashable], box: asyncio.Queue) -> list[StreamOutput]:
        done: dict[int, StreamOutput] = {}
        try:
            while len(done) < len(keys):
                i, item = await box.get()
                if isinstance(item, ValueError):
                    raise APIError(str(item), param=_param_of(str(item)))
                if isinstance(item, Exception):
                    raise APIError(str(item), status=500, type="server_error")
                if item.error is not None:
                    raise APIError(item.error, param="prompt")
                if item.finished:
                    done[i] = item
        finally:
            for i, key in enumerate(keys):
                if i not in done:
                    engine.abort(key)
        return [done[i] for i in range(len(keys))]

    async def events(
        keys: list[Hashable],
        box: asyncio.Queue,
        chunk: Callable[[int, str, str | None], dict],
        usage: Callable[[list[int]], dict] | None,
    ) -> AsyncIterator[str]:
        left = set(range(len(keys)))
        counts = [0] * len(keys)
        try:
            while left:
                i, item = await box.get()
                if isinstance(item, Exception):
                    status = 400 if isinstance(item, ValueError) else 500
                    err = APIError(str(item), status=status)
                    yield _sse(err.body())
                    return
                if item.error is not None:
                    yield _sse(APIError(item.error, param="prompt").body())
                    return
                counts[i] += len(item.token_ids)
                if item.text or item.finished:
                    yield _sse(chunk(i, item.text or "", item.finish_reason))
                if item.finished:
                    left.discard(i)
            if usage is not None:
                yield _sse(usage(counts))
            yield "data: [DONE]\n\n"
        finally:
            for i in left:
                engine.abort(keys[i])

    def include_usage(req: _Common) -> bool:
        return bool(req.stream_options and req.stream_options.get("include_usage"))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model(req)
        _unsupported(req)
        p = req.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            p = [p]
        if not p:
            raise APIError("prompt: no prompt given", param="prompt")
        prompts = []
        for i, one in enumerate(p):
            name = "prompt" if len(p) == 1 else f"prompt[{i}]"
            try:
                prompts.append(llm.prompt_ids(one, name))
            except ValueError as e:
                raise APIError(str(e), param="prompt") from None
        max_tokens = req.max_tokens
        if max_tokens is None:  # up to the context length
            max_tokens = max(1, min(room(ids) for ids in prompts))
        params = _sampling(req, max_tokens)
        for i, ids in enumerate(prompts):
            check(ids, params, "prompt" if len(p) == 1 else f"prompt[{i}]")
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        keys, box = launch(prompts, params)
        head = {"id": rid, "object": "text_completion", "created": now, "model": model_name}
        if req.stream:

            def chunk(i, text, reason):
                c = {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                return {**head, "choices": [c]}

            def usage(counts):
                n_prompt = sum(len(x) for x in prompts)
                return {**head, "choices": [], "usage": _usage(n_prompt, sum(counts))}

            gen = events(keys, box, chunk, usage if include_usage(req) else None)
            return StreamingResponse(gen, media_type="text/event-stream")
        outs = await finals(keys, box)
        choices = [
            {
                "index": i,
                "text": o.output.text or "",
                "logprobs": None,
                "finish_reason": o.finish_reason,
            }
            for i, o in enumerate(outs)
        ]
        n_out = sum(len(o.output.token_ids) for o in outs)
        return {
            **head,
            "choices": choices,
            "usage": _usage(sum(len(x) for x in prompts), n_out),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        check_model(req)
        _unsupported(req)
        if llm.tokenizer is None:
            raise APIError("messages: this model has no tokenizer for chat", param="messages")
        try:
            ids = llm.prompt_ids(encode_chat(llm.tokenizer, req.messages), "messages")
        except ValueError as e:
            raise APIError(str(e), param="messages") from None
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens is None:  # up to the context length
            max_tokens = max(1, room(ids))
        params = _sampling(req, max_tokens)
        check(ids, params, "messages")
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        keys, box = launch([ids], params)
        head = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name}
        if req.stream:

            def chunk(i, text, reason):
                delta = {"content": text} if text else {}
                c = {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}
                return {**head, "choices": [c]}

            def usage(counts):
                return {**head, "choices": [], "usage": _usage(len(ids), sum(counts))}

            async def gen():
                first = {"role": "assistant", "content": ""}
                c = {"index": 0, "delta": first, "logprobs": None, "finish_reason": None}
                yield _sse({**head, "choices": [c]})
                inner = events(keys, box, chunk, usage if include_usage(req) else None)
                async with contextlib.aclosing(inner):
                    async for event in inner:
                        yield event

            return StreamingResponse(gen(), media_type="text/event-stream")
        (out,) = await finals(keys, box)
        message = {"role": "assistant", "content": out.output.text or ""}
        return {
            **head,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": out.finish_reason,
                }
            ],
            "usage": _usage(len(ids), len(out.output.token_ids)),
        }

    return app


def serve(
    llm: LLM,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str = "gdn-tiny",
    api_key: str | None = None,
    log_level: str = "info",
) -> None:
    """Serves ``llm`` until interrupted (uvicorn)."""
    import uvicorn

    uvicorn.run(
        create_app(llm, model_name=model_name, api_key=api_key),
        host=host,
        port=port,
        log_level=log_level,
    )
