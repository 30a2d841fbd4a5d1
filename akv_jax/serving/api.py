"""The HTTP API: /generate (token ids + cache ops), OpenAI chat completions, and service routes.

Every invalid request is answered with HTTP 400 and one JSON shape,
``{"error": {"message", "type": "invalid_request_error", "param"}}``, where ``param`` names the
field and index at fault (a body over the size limit: 413, same shape). Validation happens
before any response bytes are sent, so streamed requests fail the same way as plain ones.
Faults inside the server become a JSON 500 without a traceback (an SSE error event once a
stream has started), and the server keeps serving. A client that disconnects, streaming or
not, aborts its request: the engine frees its pages at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from akv_jax.cache.ops import CacheOpError
from akv_jax.serving import protocol
from akv_jax.serving.async_engine import AsyncEngine
from akv_jax.serving.detok import TextStream
from akv_jax.serving.metrics import CONTENT_TYPE, ServerMetrics
from akv_jax.serving.protocol import Limits
from akv_jax.serving.types import GenerateRequest, SamplingParams, TokenEvent

log = logging.getLogger("akv_jax.serving")

ROUTES = ("/generate", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/flush_cache")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MIN_LOGPROB = -9999.0  # OpenAI's stand-in for log(0); JSON has no -Infinity


def error_body(message: str, param: str | None = None, type_: str = "invalid_request_error"):
    return {"error": {"message": message, "type": type_, "param": param, "code": None}}


def error_response(
    status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"
) -> JSONResponse:
    return JSONResponse(error_body(message, param, type_), status_code=status)


class BodyTooLarge(CacheOpError):
    """A request body over ``Limits.max_body_bytes``: HTTP 413, not 400."""

    def __init__(self, limit: int):
        super().__init__("body", f"request body exceeds the limit of {limit} bytes")


def _invalid(e: CacheOpError) -> JSONResponse:
    return error_response(413 if isinstance(e, BodyTooLarge) else 400, str(e), e.field)


def _failure(e: Exception) -> JSONResponse:
    """The answer to a generation that failed after validation (an engine fault)."""
    if isinstance(e, CacheOpError):  # the engine refused it after all
        return _invalid(e)
    log.error("generation failed: %s: %s", type(e).__name__, e)
    return error_response(500, f"generation failed: {e}", type_="server_error")


def _failure_event(e: Exception) -> str:
    """The same, as the last SSE event of a stream whose status line is already sent."""
    if isinstance(e, CacheOpError):
        return _sse(error_body(str(e), e.field))
    log.error("generation failed: %s: %s", type(e).__name__, e)
    return _sse(error_body(f"generation failed: {e}", None, "server_error"))


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _logprob(lp: float | None) -> float | None:
    if lp is None or math.isnan(lp):
        return None
    return max(lp, MIN_LOGPROB)


def _gone() -> Response:
    """The answer to a client that disconnected: nobody reads it, but the access log and the
    request counter show 499 ("client closed request", as nginx logs it)."""
    return Response(status_code=499)


async def _wait_disconnect(request: Request) -> None:
    """Return once the client disconnects (the body has been read: the next ASGI message is
    the disconnect, which uvicorn delivers as soon as the connection drops)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, None]) -> bool:
    """Run ``work``: True once it finishes, False if the client disconnects first. Then
    ``work`` is cancelled, which closes its engine stream and so aborts the request and frees
    its pages (streamed responses get this from starlette, which cancels their generator)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False
    task.result()  # its exception, if it raised
    return True


# --------------------------------------------------------------------------- middleware


class _Gate:
    """Pure ASGI middleware: bearer-key check (all routes but /health) and request counting.

    Pure ASGI rather than ``BaseHTTPMiddleware``, which buffers and breaks streaming."""

    def __init__(self, app: Callable, api_key: str | None, metrics: ServerMetrics):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = [500]

        async def send_status(msg) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            if self.expected is not None and path != "/health" and not self._authorized(scope):
                resp = error_response(
                    401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                    type_="authentication_error",
                )
                resp.headers["WWW-Authenticate"] = "Bearer"
                await resp(scope, receive, send_status)
                return
            await self.app(scope, receive, send_status)
        finally:
            # Unknown paths share one label so scanners cannot blow up the series count.
            label = path if path in ROUTES else "other"
            self.metrics.http_requests.labels(scope["method"], label, str(status[0])).inc()

    def _authorized(self, scope) -> bool:
        got = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(got, self.expected)


# --------------------------------------------------------------------------- generation


@dataclasses.dataclass
class _Run:
    """What one generation produced; filled in as events arrive."""

    rid: str
    prompt_tokens: int
    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float | None] = dataclasses.field(default_factory=list)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    finish_reason: str | None = None

    def add(self, ev: TokenEvent) -> bool:
        """Record an event; True if it carried a new token."""
        self.meta.update(ev.meta or {})
        done = self.meta.get("completion_tokens")
        # A final event may only restate the last token (e.g. an abort): trust the count.
        new = ev.token_id >= 0 and not (ev.finished and done is not None and len(self.ids) >= done)
        if new:
            self.ids.append(int(ev.token_id))
            self.logprobs.append(_logprob(ev.logprob))
        if ev.finished:
            self.finish_reason = ev.finish_reason
        return new

    @property
    def cached_tokens(self) -> int:
        return int(self.meta.get("cached_tokens", 0))

    def usage(self) -> dict[str, Any]:
        prompt = int(self.meta.get("prompt_tokens", self.prompt_tokens))
        return {
            "prompt_tokens": prompt,
            "completion_tokens": len(self.ids),
            "total_tokens": prompt + len(self.ids),
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def meta_info(self) -> dict[str, Any]:
        return {
            "id": self.rid,
            "prompt_tokens": int(self.meta.get("prompt_tokens", self.prompt_tokens)),
            "cached_tokens": self.cached_tokens,
            "active_tokens": self.meta.get("active_tokens"),
            "completion_tokens": len(self.ids),
            "finish_reason": self.finish_reason,
        }


class _Server:
    def __init__(
        self,
        async_engine: AsyncEngine,
        model_name: str,
        tokenizer: Any,
        limits: Limits,
        vocab_size: int | None,
        max_position: int | None,
        stop_ids: Sequence[int],
    ):
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.limits = limits
        self.vocab_size = vocab_size
        self.max_position = max_position
        self.stop_ids = frozenset(stop_ids)
        self.created = int(time.time())
        # Read stats without going through the engine thread: a scrape must not wait for a
        # long prefill step, and the values are plain counters (a torn read is harmless).
        self.metrics = ServerMetrics(lambda: self.engine.stats())
        self._gen_prompt: list[int] | None = None

    # ---- shared pieces

    async def read_json(self, request: Request) -> dict[str, Any]:
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(limit)  # refused before a byte of it is read
        chunks, size = [], 0
        async for chunk in request.stream():  # also bounds bodies sent without a length
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            chunks.append(chunk)
        return protocol.parse_json_body(b"".join(chunks), self.limits)

    def make_request(self, segments, history, sampling: SamplingParams, logprob: bool):
        return GenerateRequest(uuid.uuid4().hex, segments, history, sampling, logprob)

    async def check(self, req: GenerateRequest) -> None:
        # In a worker thread: checking a very long request walks every token.
        await asyncio.to_thread(self.engine.check, req)

    async def events(self, req: GenerateRequest, run: _Run, endpoint: str):
        """The engine's events for ``req``; metrics are recorded however the stream ends
        (finished, stopped early by a stop string, or cut by a client disconnect)."""
        t0 = time.perf_counter()
        ttft = None
        gen = self.async_engine.generate(req)
        try:
            async for ev in gen:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                yield ev
        finally:
            # Closing the engine's generator aborts the request if it has not finished.
            await gen.aclose()
            self.metrics.observe_request(
                endpoint,
                latency=time.perf_counter() - t0,
                ttft=ttft,
                completion_tokens=len(run.ids),
                prompt_tokens=int(run.meta.get("prompt_tokens", run.prompt_tokens)),
                cached_tokens=run.cached_tokens,
                finish_reason=run.finish_reason,
            )

    # ---- /generate

    async def generate(self, request: Request) -> Response:
        body = await self.read_json(request)
        inp = protocol.parse_generate(body, self.limits, self.vocab_size)
        req = self.make_request(inp.segments, inp.history, inp.sampling, inp.return_logprob)
        await self.check(req)
        run = _Run(req.rid, sum(len(s) for s in inp.segments))
        if inp.stream:
            return StreamingResponse(
                self._generate_stream(req, run, inp.return_logprob),
                media_type="text/event-stream", headers=SSE_HEADERS,
            )

        async def collect() -> None:
            async for ev in self.events(req, run, "generate"):
                run.add(ev)

        try:
            if not await _unless_disconnected(request, collect()):
                return _gone()
        except Exception as e:
            return _failure(e)
        out: dict[str, Any] = {"output_ids": run.ids}
        if self.tokenizer is not None:
            out["text"] = await asyncio.to_thread(self.tokenizer.decode, run.ids)
        if inp.return_logprob:
            out["output_token_logprobs"] = run.logprobs
        out["meta_info"] = run.meta_info()
        return JSONResponse(out)

    async def _generate_stream(self, req, run: _Run, logprob: bool) -> AsyncIterator[str]:
        try:
            # aclosing: a client that goes away closes this generator at a yield; the engine
            # request is then aborted at once rather than at garbage collection.
            async with contextlib.aclosing(self.events(req, run, "generate")) as events:
                async for ev in events:
                    n = len(run.ids)
                    run.add(ev)
                    chunk: dict[str, Any] = {"output_ids": run.ids[n:]}
                    if logprob:
                        chunk["output_token_logprobs"] = run.logprobs[n:]
                    meta = {"id": run.rid, "finish_reason": run.finish_reason}
                    chunk["meta_info"] = run.meta_info() if ev.finished else meta
                    yield _sse(chunk)
        except Exception as e:
            yield _failure_event(e)
        yield "data: [DONE]\n\n"

    # ---- chat

    def gen_prompt(self) -> list[int]:
        if self._gen_prompt is None:
            self._gen_prompt = self.tokenizer.generation_prompt_segment()
        return self._gen_prompt

    async def chat(self, request: Request) -> Response:
        body = await self.read_json(request)
        inp = protocol.parse_chat(body, self.limits, self.vocab_size)
        tok = self.tokenizer
        if tok is None or getattr(tok, "chat_template", None) is None:
            raise CacheOpError("messages", "model has no chat template; use /generate")
        segments = await asyncio.to_thread(self._encode_chat, inp)
        protocol.check_prompt_size(segments, self.limits, "messages")
        history = protocol.chat_history(inp.cache, len(inp.messages), len(segments))
        max_tokens = inp.max_tokens
        if max_tokens is None:
            # OpenAI's default is "as much as fits"; cap it so a forgotten max_tokens does
            # not tie up a slot for the whole context length.
            max_tokens = self.limits.default_max_tokens
            if self.max_position is not None:
                room = self.max_position - protocol.final_position(
                    [len(s) for s in segments], history
                )
                max_tokens = min(max_tokens, room) if room >= 1 else max_tokens
        sampling = dataclasses.replace(inp.sampling, max_new_tokens=max_tokens)
        req = self.make_request(segments, history, sampling, inp.logprobs)
        await self.check(req)
        run = _Run(req.rid, sum(len(s) for s in segments))
        text = TextStream(tok, inp.stop)
        if inp.stream:
            return StreamingResponse(
                self._chat_stream(req, run, text, inp), media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        content_lp: list[dict[str, Any]] = []

        async def collect() -> None:
            async for _ in self._chat_tokens(req, run, text, content_lp):
                pass

        try:
            if not await _unless_disconnected(request, collect()):
                return _gone()
        except Exception as e:
            return _failure(e)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text.text},
            "logprobs": {"content": content_lp} if inp.logprobs else None,
            "finish_reason": run.finish_reason,
        }
        return JSONResponse({
            "id": f"chatcmpl-{run.rid}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": run.usage(),
            "meta_info": run.meta_info(),
        })

    def _encode_chat(self, inp: protocol.ChatInput) -> list[list[int]]:
        from akv_jax.model.tokenizer import TokenizerError

        try:
            gp = self.gen_prompt()
            # The generation prompt is a segment of its own after the messages (DESIGN §2),
            # so the cache indices of the messages equal their segment indices.
            return self.tokenizer.encode_messages(
                inp.messages, add_generation_prompt=bool(gp), **inp.template_kwargs
            )
        except TokenizerError as e:
            raise CacheOpError("messages", str(e)) from None

    async def _chat_tokens(
        self, req, run: _Run, text: TextStream, content_lp: list[dict[str, Any]]
    ) -> AsyncIterator[str]:
        """Text deltas of a chat generation; stops early (aborting the request) on a stop
        string. Stop tokens are not part of the content, as in OpenAI's API."""
        stops = self.stop_ids | set(req.sampling.stop_token_ids)
        # aclosing: a stop string leaves the loop early, and the engine request must be
        # aborted now, not whenever the abandoned generator is garbage-collected.
        async with contextlib.aclosing(self.events(req, run, "chat")) as events:
            async for ev in events:
                new = run.add(ev)
                delta = ""
                stop_token = ev.finished and run.finish_reason == "stop" and ev.token_id in stops
                if new and not stop_token:
                    delta = text.push(ev.token_id)
                    if req.return_logprob:
                        piece = self.tokenizer.decode([ev.token_id])
                        content_lp.append({
                            "token": piece, "logprob": run.logprobs[-1],
                            "bytes": list(piece.encode("utf-8")), "top_logprobs": [],
                        })
                if text.stopped:
                    run.finish_reason = "stop"
                    yield delta
                    return
                if ev.finished:
                    delta += text.finish()
                yield delta

    async def _chat_stream(self, req, run: _Run, text: TextStream, inp) -> AsyncIterator[str]:
        base = {
            "id": f"chatcmpl-{run.rid}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": self.model_name,
        }
        extra = {"usage": None} if inp.include_usage else {}

        def chunk(delta: dict[str, Any], finish: str | None = None, lp=None) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return _sse({**base, "choices": [choice], **extra})

        yield chunk({"role": "assistant", "content": ""})
        content_lp: list[dict[str, Any]] = []
        try:
            async for delta in self._chat_tokens(req, run, text, content_lp):
                lp = {"content": content_lp[:]} if inp.logprobs and content_lp else None
                content_lp.clear()
                if delta or lp:
                    yield chunk({"content": delta}, None, lp)
            yield chunk({}, run.finish_reason)
            if inp.include_usage:
                yield _sse({**base, "choices": [], "usage": run.usage()})
        except Exception as e:
            yield _failure_event(e)
        yield "data: [DONE]\n\n"

    # ---- service routes

    def models(self) -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "akv_jax",
        }
        if self.max_position is not None:
            card["max_model_len"] = self.max_position
        return {"object": "list", "data": [card]}

    async def flush_cache(self) -> Response:
        # On the engine thread: the tree and pool are only ever touched there.
        try:
            ok = await asyncio.to_thread(self.async_engine.flush_cache)
        except RuntimeError as e:  # the engine has stopped for good (AsyncEngine.failure)
            return error_response(503, str(e), type_="server_error")
        if not ok:
            return error_response(
                409, "cache not flushed: requests are running; retry when idle",
                type_="conflict_error",
            )
        return JSONResponse({"flushed": True})


# --------------------------------------------------------------------------- the app


def create_app(
    async_engine: AsyncEngine,
    model_name: str,
    tokenizer: Any = None,
    api_key: str | None = None,
    limits: Limits | None = None,
    *,
    vocab_size: int | None = None,
    max_position: int | None = None,
    stop_ids: Sequence[int] = (),
) -> FastAPI:
    """The FastAPI app. Its lifespan starts and stops ``async_engine``'s thread.

    ``vocab_size`` and ``max_position`` come from the model config; ``stop_ids`` are the EOS
    ids the engine stops on (left out of chat message content).
    """
    srv = _Server(
        async_engine, model_name, tokenizer, limits or Limits(), vocab_size, max_position,
        stop_ids,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()

    app = FastAPI(title="akv_jax", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = srv

    @app.exception_handler(CacheOpError)
    async def _on_invalid(_request: Request, e: CacheOpError) -> JSONResponse:
        return _invalid(e)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "error")
        return error_response(e.status_code, str(e.detail), type_=kind)

    @app.exception_handler(Exception)
    async def _on_error(_request: Request, e: Exception) -> JSONResponse:
        log.error("internal error: %s: %s", type(e).__name__, e)
        return error_response(500, "internal server error", type_="server_error")

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await srv.generate(request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await srv.chat(request)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(srv.models())

    @app.get("/health")
    async def health() -> Response:
        # An engine that stopped for good (e.g. a lost multi-host follower) is unhealthy,
        # for load balancers and supervisors, while the server shuts down.
        failure = getattr(async_engine, "failure", None)
        if failure is not None:
            return error_response(503, failure, type_="server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await asyncio.to_thread(srv.metrics.render), media_type=CONTENT_TYPE)

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        return await srv.flush_cache()

    app.add_middleware(_Gate, api_key=api_key, metrics=srv.metrics)
    return app
