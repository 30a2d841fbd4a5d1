"""What the HTTP API answers with: the one error shape, server-sent events, client
disconnects, and the record of one generation's output (:class:`Run`).

Every invalid request is answered with HTTP 400 and one JSON shape,
``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``, where ``param``
names the field and index at fault (a body over the size limit: 413, same shape). Faults inside
the server become a JSON 500 without a traceback, or an SSE error event once a stream has
started.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from akv_jax.errors import InvalidField
from akv_jax.serving.protocol import BodyTooLarge
from akv_jax.serving.types import TokenEvent

log = logging.getLogger("akv_jax.serving")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = "data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # OpenAI's stand-in for log(0); JSON has no -Infinity


def error_body(message: str, param: str | None = None, type_: str = "invalid_request_error"):
    return {"error": {"message": message, "type": type_, "param": param, "code": None}}


def error_response(
    status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"
) -> JSONResponse:
    return JSONResponse(error_body(message, param, type_), status_code=status)


def invalid(e: InvalidField) -> JSONResponse:
    """The answer to an invalid request: 400 (413 for a body over the size limit)."""
    return error_response(413 if isinstance(e, BodyTooLarge) else 400, str(e), e.field)


def failure(e: Exception) -> JSONResponse:
    """The answer to a generation that failed after validation (an engine fault)."""
    if isinstance(e, InvalidField):  # the engine refused it after all
        return invalid(e)
    log.error("generation failed: %s: %s", type(e).__name__, e)
    return error_response(500, f"generation failed: {e}", type_="server_error")


def failure_event(e: Exception) -> str:
    """The same, as the last SSE event of a stream whose status line is already sent."""
    if isinstance(e, InvalidField):
        return sse(error_body(str(e), e.field))
    log.error("generation failed: %s: %s", type(e).__name__, e)
    return sse(error_body(f"generation failed: {e}", None, "server_error"))


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def gone() -> Response:
    """The answer to a client that disconnected: nobody reads it, but the access log and the
    request counter show 499 ("client closed request", as nginx logs it)."""
    return Response(status_code=499)


async def _wait_disconnect(request: Request) -> None:
    """Return once the client disconnects (the body has been read: the next ASGI message is
    the disconnect, which uvicorn delivers as soon as the connection drops)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, None]) -> bool:
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


async def drain(request: Request, stream: AsyncIterator[Any]) -> Response | None:
    """Run ``stream`` to its end for a non-streamed answer: None once it has, else the answer
    to give instead (499 if the client left first, the error if generation failed)."""

    async def work() -> None:
        async for _ in stream:
            pass

    try:
        if not await unless_disconnected(request, work()):
            return gone()
    except Exception as e:
        return failure(e)
    return None


def _logprob(lp: float | None) -> float | None:
    if lp is None or math.isnan(lp):
        return None
    return max(lp, MIN_LOGPROB)


@dataclasses.dataclass
class Run:
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
