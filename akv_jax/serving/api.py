"""The HTTP API: the app, its routes and middleware; /generate (token ids + cache ops) and the
service routes are served here, OpenAI chat completions by :mod:`.openai_chat`.

Every invalid request is answered with HTTP 400 and one JSON shape (:mod:`.responses`), naming
the field and index at fault. Bodies are read here (bounded by ``Limits.max_body_bytes``) and
validated by :mod:`.protocol` against the models of :mod:`.schemas`, which also make the
OpenAPI document (``/openapi.json``, browsable at ``/docs``). Validation happens before any
response bytes are sent, so streamed requests fail the same way as plain ones. Faults inside
the server become a JSON 500 without a traceback (an SSE error event once a stream has
started), and the server keeps serving. A client that disconnects, streaming or not, aborts
its request: the engine frees its pages at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from akv_jax.errors import InvalidField
from akv_jax.serving import protocol
from akv_jax.serving.async_engine import AsyncEngine
from akv_jax.serving.chat_body import ChatBody
from akv_jax.serving.generate_body import GenerateBody
from akv_jax.serving.metrics import CONTENT_TYPE, ServerMetrics
from akv_jax.serving.openai_chat import ChatCompletions
from akv_jax.serving.openai_responses import Responses
from akv_jax.serving.protocol import BodyTooLarge, Limits
from akv_jax.serving.responses import (
    SSE_DONE,
    SSE_HEADERS,
    Run,
    error_response,
    failure,
    failure_event,
    gone,
    invalid,
    sse,
    unless_disconnected,
)
from akv_jax.serving.responses_body import ResponsesBody
from akv_jax.serving.segment_memo import SegmentMemo
from akv_jax.serving.types import GenerateRequest, SamplingParams

__all__ = ["BodyTooLarge", "Server", "create_app"]

log = logging.getLogger("akv_jax.serving")

ROUTES = ("/generate", "/v1/chat/completions", "/v1/responses", "/v1/models", "/health",
          "/metrics", "/flush_cache", "/docs", "/openapi.json")
# Open without the API key: liveness, and the API's description (no data in either).
PUBLIC = frozenset({"/health", "/docs", "/openapi.json"})


# --------------------------------------------------------------------------- middleware


class _Gate:
    """Pure ASGI middleware: bearer-key check (all routes but ``PUBLIC``) and request counting.

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
            if self.expected is not None and path not in PUBLIC and not self._authorized(scope):
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


class Server:
    """What the routes share: the engine, the model's facts, limits and metrics."""

    def __init__(
        self,
        async_engine: AsyncEngine,
        model_name: str,
        tokenizer: Any,
        limits: Limits,
        vocab_size: int | None,
        max_position: int | None,
        stop_ids: Sequence[int],
        arch: str = "plain",
        reply_format: str | None = None,
    ):
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.limits = limits
        self.vocab_size = vocab_size
        # /generate segments seen before, by their JSON text (segment_memo.py).
        self.segments = SegmentMemo(vocab_size)
        self.max_position = max_position
        self.stop_ids = frozenset(stop_ids)
        self.arch = arch  # the model's architecture: picks its reply format (tool_use.py)
        self.reply_format = reply_format  # a family named on the command line, or None
        self.created = int(time.time())
        # Read stats without going through the engine thread: a scrape must not wait for a
        # long prefill step, and the values are plain counters (a torn read is harmless).
        self.metrics = ServerMetrics(lambda: self.engine.stats())
        self.chat = ChatCompletions(self)
        self.responses = Responses(self)

    # ---- shared pieces

    async def read_json(self, request: Request) -> dict[str, Any]:
        return protocol.parse_json_body(await self.read_body(request), self.limits)

    async def read_body(self, request: Request) -> bytes:
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
        return b"".join(chunks)

    def make_request(self, segments, history, sampling: SamplingParams, logprob: bool,
                     constraint=None) -> GenerateRequest:
        return GenerateRequest(uuid.uuid4().hex, segments, history, sampling, logprob,
                               constraint)

    async def check(self, req: GenerateRequest) -> GenerateRequest:
        """``req`` checked and prepared (Engine.prepare) in a worker thread, so neither the
        event loop nor the engine's step waits for it."""
        return await asyncio.to_thread(self.engine.prepare, req)

    async def events(self, req: GenerateRequest, run: Run, endpoint: str):
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
        raw = await self.read_body(request)
        inp = protocol.parse_generate_bytes(raw, self.limits, self.vocab_size, self.segments)
        req = self.make_request(inp.segments, inp.history, inp.sampling, inp.return_logprob)
        req = await self.check(req)
        run = Run(req.rid, sum(len(s) for s in inp.segments))
        if inp.stream:
            return StreamingResponse(
                self._generate_stream(req, run, inp.return_logprob),
                media_type="text/event-stream", headers=SSE_HEADERS,
            )

        async def collect() -> None:
            async for ev in self.events(req, run, "generate"):
                run.add(ev)

        try:
            if not await unless_disconnected(request, collect()):
                return gone()
        except Exception as e:
            return failure(e)
        out: dict[str, Any] = {"output_ids": run.ids}
        if self.tokenizer is not None:
            out["text"] = await asyncio.to_thread(self.tokenizer.decode, run.ids)
        if inp.return_logprob:
            out["output_token_logprobs"] = run.logprobs
        out["meta_info"] = run.meta_info()
        return JSONResponse(out)

    async def _generate_stream(
        self, req: GenerateRequest, run: Run, logprob: bool
    ) -> AsyncIterator[str]:
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
                    yield sse(chunk)
        except Exception as e:
            yield failure_event(e)
        yield SSE_DONE

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
    arch: str = "plain",
    reply_format: str | None = None,
) -> FastAPI:
    """The FastAPI app. Its lifespan starts and stops ``async_engine``'s thread.

    ``vocab_size`` and ``max_position`` come from the model config; ``stop_ids`` are the EOS
    ids the engine stops on (left out of chat message content); ``arch`` (the config's) picks
    the reply format chat replies are parsed in, unless ``reply_format`` names one.
    """
    srv = Server(
        async_engine, model_name, tokenizer, limits or Limits(), vocab_size, max_position,
        stop_ids, arch, reply_format,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()

    app = FastAPI(title="akv_jax", summary="AKV agent KV-cache serving", lifespan=lifespan,
                  redoc_url=None)
    app.state.server = srv
    _document_bodies(app)

    @app.exception_handler(InvalidField)
    async def _on_invalid(_request: Request, e: InvalidField) -> JSONResponse:
        return invalid(e)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "error")
        return error_response(e.status_code, str(e.detail), type_=kind)

    @app.exception_handler(Exception)
    async def _on_error(_request: Request, e: Exception) -> JSONResponse:
        log.error("internal error: %s: %s", type(e).__name__, e)
        return error_response(500, "internal server error", type_="server_error")

    @app.post("/generate", openapi_extra=_body_doc(GenerateBody))
    async def generate(request: Request) -> Response:
        """Generate from token-id segments, with cache operations (drop, reposition)."""
        return await srv.generate(request)

    @app.post("/v1/chat/completions", openapi_extra=_body_doc(ChatBody))
    async def chat(request: Request) -> Response:
        """OpenAI chat completions; AKV's ``cache`` operations name messages."""
        return await srv.chat(request)

    @app.post("/v1/responses", openapi_extra=_body_doc(ResponsesBody))
    async def responses(request: Request) -> Response:
        """OpenAI Responses, stateless; AKV's ``cache`` operations name input items."""
        return await srv.responses(request)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(srv.models())

    @app.get("/health")
    async def health() -> Response:
        # An engine that stopped for good (e.g. a lost multi-host follower) is unhealthy,
        # for load balancers and supervisors, while the server shuts down.
        fault = getattr(async_engine, "failure", None)
        if fault is not None:
            return error_response(503, fault, type_="server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await asyncio.to_thread(srv.metrics.render), media_type=CONTENT_TYPE)

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        return await srv.flush_cache()

    app.add_middleware(_Gate, api_key=api_key, metrics=srv.metrics)
    return app


# --------------------------------------------------------------------------- OpenAPI

# The routes read and validate their bodies themselves (a bounded read, NaN refused, limits
# of this server as validation context: see protocol.py), so FastAPI does not see the models
# in their signatures; they are declared to the OpenAPI document here instead.
_BODIES: tuple[type[BaseModel], ...] = (GenerateBody, ChatBody, ResponsesBody)
_REF = "#/components/schemas/{model}"


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    ref = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _document_bodies(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, summary=app.summary,
                              routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in _BODIES],
                                         ref_template=_REF)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
