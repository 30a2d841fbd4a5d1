"""``POST /v1/chat/completions``: OpenAI chat requests translated to segments and back.

Messages are tokenized by the model's chat template one segment per message, with the
template's generation prompt as a segment of its own after them (DESIGN §2), so the indices
of AKV's ``cache`` field name messages. Replies are decoded incrementally (stop strings,
multi-byte characters) and answered in OpenAI's shapes, plain or streamed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from akv_jax.cache.timeline import timeline
from akv_jax.errors import InvalidField
from akv_jax.serving import protocol
from akv_jax.serving.detok import TextStream
from akv_jax.serving.responses import (
    SSE_DONE,
    SSE_HEADERS,
    Run,
    failure,
    failure_event,
    gone,
    sse,
    unless_disconnected,
)
from akv_jax.serving.types import GenerateRequest

if TYPE_CHECKING:
    from akv_jax.serving.api import Server


class ChatCompletions:
    """The chat route of one :class:`~akv_jax.serving.api.Server`."""

    def __init__(self, srv: Server):
        self.srv = srv
        self._gen_prompt: list[int] | None = None

    def gen_prompt(self) -> list[int]:
        if self._gen_prompt is None:
            self._gen_prompt = self.srv.tokenizer.generation_prompt_segment()
        return self._gen_prompt

    async def __call__(self, request: Request) -> Response:
        srv = self.srv
        body = await srv.read_json(request)
        inp = protocol.parse_chat(body, srv.limits, srv.vocab_size)
        tok = srv.tokenizer
        if tok is None or getattr(tok, "chat_template", None) is None:
            raise InvalidField("messages", "model has no chat template; use /generate")
        segments = await asyncio.to_thread(self._encode, inp)
        protocol.check_prompt_size(segments, srv.limits, "messages")
        history = protocol.chat_history(inp.cache, len(inp.messages), len(segments))
        max_tokens = inp.max_tokens
        if max_tokens is None:
            # OpenAI's default is "as much as fits"; cap it so a forgotten max_tokens does
            # not tie up a slot for the whole context length.
            max_tokens = srv.limits.default_max_tokens
            if srv.max_position is not None:
                tl = await asyncio.to_thread(timeline, [len(s) for s in segments], history)
                room = srv.max_position - tl.next_pos  # where generation starts (§2)
                max_tokens = min(max_tokens, room) if room >= 1 else max_tokens
        sampling = dataclasses.replace(inp.sampling, max_new_tokens=max_tokens)
        req = srv.make_request(segments, history, sampling, inp.logprobs)
        await srv.check(req)
        run = Run(req.rid, sum(len(s) for s in segments))
        text = TextStream(tok, inp.stop)
        if inp.stream:
            return StreamingResponse(
                self._stream(req, run, text, inp), media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        content_lp: list[dict[str, Any]] = []

        async def collect() -> None:
            async for _ in self._tokens(req, run, text, content_lp):
                pass

        try:
            if not await unless_disconnected(request, collect()):
                return gone()
        except Exception as e:
            return failure(e)
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
            "model": srv.model_name,
            "choices": [choice],
            "usage": run.usage(),
            "meta_info": run.meta_info(),
        })

    def _encode(self, inp: protocol.ChatInput) -> list[list[int]]:
        from akv_jax.model.tokenizer import TokenizerError

        try:
            gp = self.gen_prompt()
            # The generation prompt is a segment of its own after the messages (DESIGN §2),
            # so the cache indices of the messages equal their segment indices.
            return self.srv.tokenizer.encode_messages(
                inp.messages, add_generation_prompt=bool(gp), **inp.template_kwargs
            )
        except TokenizerError as e:
            raise InvalidField("messages", str(e)) from None

    async def _tokens(
        self, req: GenerateRequest, run: Run, text: TextStream, content_lp: list[dict[str, Any]]
    ) -> AsyncIterator[str]:
        """Text deltas of a chat generation; stops early (aborting the request) on a stop
        string. Stop tokens are not part of the content, as in OpenAI's API."""
        stops = self.srv.stop_ids | set(req.sampling.stop_token_ids)
        # aclosing: a stop string leaves the loop early, and the engine request must be
        # aborted now, not whenever the abandoned generator is garbage-collected.
        async with contextlib.aclosing(self.srv.events(req, run, "chat")) as events:
            async for ev in events:
                new = run.add(ev)
                delta = ""
                stop_token = ev.finished and run.finish_reason == "stop" and ev.token_id in stops
                if new and not stop_token:
                    delta = text.push(ev.token_id)
                    if req.return_logprob:
                        piece = self.srv.tokenizer.decode([ev.token_id])
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

    async def _stream(
        self, req: GenerateRequest, run: Run, text: TextStream, inp: protocol.ChatInput
    ) -> AsyncIterator[str]:
        base = {
            "id": f"chatcmpl-{run.rid}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": self.srv.model_name,
        }
        extra = {"usage": None} if inp.include_usage else {}

        def chunk(delta: dict[str, Any], finish: str | None = None, lp=None) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return sse({**base, "choices": [choice], **extra})

        yield chunk({"role": "assistant", "content": ""})
        content_lp: list[dict[str, Any]] = []
        try:
            async for delta in self._tokens(req, run, text, content_lp):
                lp = {"content": content_lp[:]} if inp.logprobs and content_lp else None
                content_lp.clear()
                if delta or lp:
                    yield chunk({"content": delta}, None, lp)
            yield chunk({}, run.finish_reason)
            if inp.include_usage:
                yield sse({**base, "choices": [], "usage": run.usage()})
        except Exception as e:
            yield failure_event(e)
        yield SSE_DONE
