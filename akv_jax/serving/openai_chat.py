"""``POST /v1/chat/completions``: OpenAI chat requests translated to segments and back.

Messages are tokenized by the model's chat template one segment per message, with the
template's generation prompt as a segment of its own after them (DESIGN §2), so the indices
of AKV's ``cache`` field name messages. An assistant message sent back as history is
tokenized as the ids the model generated for it where its text allows
(:mod:`.reply_record`), so the next turn finds the whole reply in the cache. Replies are
parsed per model family into content, ``reasoning_content`` and ``tool_calls``
(:mod:`.reply_stream`), decoding is held to a grammar where ``tool_choice`` or
``response_format`` asks for one (:mod:`.tool_use`), and answers come in OpenAI's shapes,
plain or streamed.
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

from akv_jax.cache.ops import OpHistory
from akv_jax.cache.timeline import timeline
from akv_jax.errors import InvalidField
from akv_jax.formats.reply import Reply, ReplyDelta
from akv_jax.serving import protocol
from akv_jax.serving.removed_reasoning import SplitMessage, removed_span, segment_history
from akv_jax.serving.reply_record import (
    ReplyRecord,
    as_generated,
    message_key,
    partly_generated,
    reply_key,
)
from akv_jax.serving.reply_stream import ReplyStream, merged
from akv_jax.serving.responses import (
    SSE_DONE,
    SSE_HEADERS,
    Run,
    drain,
    failure_event,
    sse,
)
from akv_jax.serving.tool_use import ToolUse
from akv_jax.serving.types import GenerateRequest

if TYPE_CHECKING:
    from akv_jax.serving.api import Server


@dataclasses.dataclass
class ChatTurn:
    """One chat generation under way: the engine request and what its reply becomes."""

    inp: protocol.ChatInput
    segments: list[list[int]]
    req: GenerateRequest
    run: Run
    reply: ReplyStream
    # Generated tokens up to the last one that wrote reasoning (markup within included).
    reasoning_tokens: int = 0

    def finish_reason(self) -> str | None:
        reason = self.run.finish_reason
        if reason == "stop" and self.reply.reply().tool_calls:
            return "tool_calls"
        return reason


class ChatCompletions:
    """The chat route of one :class:`~akv_jax.serving.api.Server`; its :meth:`prepare` and
    :meth:`deltas` also serve the Responses route."""

    def __init__(self, srv: Server):
        self.srv = srv
        self._gen_prompt: list[int] | None = None
        self.record = ReplyRecord(srv.limits.reply_record)
        tok = srv.tokenizer
        # A template without the role (Qwen3's, MiniMax-M2's) drops a developer message or
        # renders it as nothing: OpenAI's instructions role becomes the system role.
        template = getattr(tok, "chat_template", None) or ""
        self.developer_as_system = "developer" not in template
        self.tool_use = None if tok is None else ToolUse(
            tok, srv.arch, srv.vocab_size or tok.vocab_size, family=srv.reply_format,
            reasoning_budget=srv.limits.reasoning_budget,
        )

    def gen_prompt(self) -> list[int]:
        if self._gen_prompt is None:
            self._gen_prompt = self.srv.tokenizer.generation_prompt_segment()
        return self._gen_prompt

    async def __call__(self, request: Request) -> Response:
        srv = self.srv
        body = await srv.read_json(request)
        inp = protocol.parse_chat(body, srv.limits, srv.vocab_size)
        turn = await self.prepare(inp)
        if inp.stream:
            return StreamingResponse(
                self._stream(turn), media_type="text/event-stream", headers=SSE_HEADERS,
            )
        content_lp: list[dict[str, Any]] = []
        if (answer := await drain(request, self.deltas(turn, content_lp))) is not None:
            return answer
        run = turn.run
        choice = {
            "index": 0,
            "message": assistant_message(turn.reply.reply()),
            "logprobs": {"content": content_lp} if inp.logprobs else None,
            "finish_reason": turn.finish_reason(),
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

    async def prepare(self, inp: protocol.ChatInput) -> ChatTurn:
        """Validate ``inp`` against the model, tokenize it and queue nothing yet: the engine
        request is submitted when :meth:`deltas` is iterated."""
        srv = self.srv
        tok = srv.tokenizer
        if tok is None or getattr(tok, "chat_template", None) is None:
            raise InvalidField("messages", "model has no chat template; use /generate")
        self.tool_use.check(inp)
        segments, history = await asyncio.to_thread(self._encode, inp)
        protocol.check_prompt_size(segments, srv.limits, "messages")
        max_tokens = inp.max_tokens
        if max_tokens is None:
            # OpenAI's default is "as much as fits"; cap it so a forgotten max_tokens does
            # not tie up a slot for the whole context length.
            max_tokens = srv.limits.default_max_tokens
            if srv.max_position is not None:
                tl = await asyncio.to_thread(timeline, [len(s) for s in segments], history)
                room = srv.max_position - tl.next_pos  # where generation starts (§2)
                max_tokens = min(max_tokens, room) if room >= 1 else max_tokens
        opens = bool(self.gen_prompt()) and self.tool_use.opens_reasoning(segments[-1])
        constraint = await asyncio.to_thread(self.tool_use.constraint, inp, max_tokens, opens)
        sampling = dataclasses.replace(inp.sampling, max_new_tokens=max_tokens)
        req = srv.make_request(segments, history, sampling, inp.logprobs, constraint)
        req = await srv.check(req)
        run = Run(req.rid, sum(len(s) for s in segments))
        parser = None if self.tool_use.family == "plain" else self.tool_use.parser(inp, opens)
        return ChatTurn(inp, segments, req, run, ReplyStream(tok, parser, inp.stop))

    def _encode(self, inp: protocol.ChatInput) -> tuple[list[list[int]], OpHistory]:
        """The request's segments and op history. Assistant messages on record are tokenized
        as generated; with ``removed_reasoning`` "drop", one whose reasoning was left out
        becomes three segments, the removed one dropped (:mod:`.removed_reasoning`)."""
        from akv_jax.model.tokenizer import TokenizerError

        tok = self.srv.tokenizer
        messages = inp.messages
        if self.developer_as_system:
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m
                        for m in messages]
        try:
            gp = self.gen_prompt()
            # The generation prompt is a segment of its own after the messages (DESIGN §2),
            # so the cache indices of the messages equal their segment indices.
            segments = tok.encode_messages(
                messages, add_generation_prompt=bool(gp), **inp.template_kwargs
            )
        except TokenizerError as e:
            raise InvalidField("messages", str(e)) from None
        history = protocol.chat_history(inp.cache, len(inp.messages), len(segments))
        splits: dict[int, SplitMessage] = {}
        for i, m in enumerate(inp.messages):
            rec = self.record.lookup(message_key(m)) if m.get("role") == "assistant" else None
            if rec is None:
                continue
            ids = rec.ids
            seg = as_generated(segments[i], ids, tok)
            if seg is segments[i] and inp.removed_reasoning == "drop":
                split = removed_span(ids, segments[i], tok, rec.reply_start)
                if split is not None:
                    splits[i] = split
                    continue
            if seg is segments[i]:
                seg = partly_generated(segments[i], ids, tok)
            segments[i] = seg
        if not splits:
            return segments, history
        out: list[list[int]] = []
        message_segments: list[list[int]] = []
        removed: dict[int, int] = {}
        for i, seg in enumerate(segments):
            parts = [p for p in splits.get(i, (seg,)) if p]
            first = len(out)
            out.extend(parts)
            message_segments.append(list(range(first, len(out))))
            if i in splits:
                removed[len(out) - 2] = len(out) - 1  # dropped once its message is in
        return out, segment_history(history, message_segments, removed, len(out))

    async def deltas(
        self, turn: ChatTurn, content_lp: list[dict[str, Any]] | None = None,
        endpoint: str = "chat",
    ) -> AsyncIterator[ReplyDelta]:
        """The reply's deltas as the engine generates it; stops early (aborting the request)
        on a stop string. Stop tokens are not content, as in OpenAI's API."""
        srv, req, run, reply = self.srv, turn.req, turn.run, turn.reply
        stops = srv.stop_ids | set(req.sampling.stop_token_ids)
        # aclosing: a stop string leaves the loop early, and the engine request must be
        # aborted now, not whenever the abandoned generator is garbage-collected.
        async with contextlib.aclosing(srv.events(req, run, endpoint)) as events:
            async for ev in events:
                new = run.add(ev)
                delta = ReplyDelta()
                if new:
                    stop_token = (ev.finished and run.finish_reason == "stop"
                                  and ev.token_id in stops)
                    delta = reply.push(ev.token_id, stop_token)
                    if delta.reasoning:
                        turn.reasoning_tokens = len(run.ids)
                    if req.return_logprob and content_lp is not None and not stop_token:
                        piece = srv.tokenizer.decode([ev.token_id])
                        content_lp.append({
                            "token": piece, "logprob": run.logprobs[-1],
                            "bytes": list(piece.encode("utf-8")), "top_logprobs": [],
                        })
                if reply.stopped:
                    run.finish_reason = "stop"
                    yield merged(delta, reply.finish())
                    self._remember(turn)
                    return
                if ev.finished:
                    delta = merged(delta, reply.finish())
                    self._remember(turn)
                yield delta

    def _remember(self, turn: ChatTurn) -> None:
        """Keep the reply's ids (generation prompt first) for when it is sent back."""
        r = turn.reply.reply()
        key = reply_key(r.content, [c.id for c in r.tool_calls])
        self.record.remember(key, [*turn.segments[-1], *turn.run.ids], len(turn.segments[-1]))

    async def _stream(self, turn: ChatTurn) -> AsyncIterator[str]:
        inp, run = turn.inp, turn.run
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
            async for d in self.deltas(turn, content_lp):
                lp = {"content": content_lp[:]} if inp.logprobs and content_lp else None
                content_lp.clear()
                delta = delta_fields(d)
                if delta or lp:
                    yield chunk(delta, None, lp)
            yield chunk({}, turn.finish_reason())
            if inp.include_usage:
                yield sse({**base, "choices": [], "usage": run.usage()})
        except Exception as e:
            yield failure_event(e)
        yield SSE_DONE


def assistant_message(r: Reply) -> dict[str, Any]:
    """The reply as an OpenAI chat message (``content`` null when only calls came back, as
    OpenAI sends it; reasoning as ``reasoning_content``, as vLLM and SGLang name it)."""
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": r.content if r.content or not r.tool_calls else None,
    }
    if r.reasoning:
        msg["reasoning_content"] = r.reasoning
    if r.tool_calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for c in r.tool_calls
        ]
    return msg


def delta_fields(d: ReplyDelta) -> dict[str, Any]:
    """A streamed chunk's ``delta``: the id, type and name once per call, arguments in
    pieces, as the official client assembles them."""
    out: dict[str, Any] = {}
    if d.reasoning:
        out["reasoning_content"] = d.reasoning
    if d.content:
        out["content"] = d.content
    calls = []
    for c in d.tool_calls:
        call: dict[str, Any] = {"index": c.index}
        if c.id is not None:
            call["id"] = c.id
            call["type"] = "function"
        fn: dict[str, Any] = {}
        if c.name is not None:
            fn["name"] = c.name
        fn["arguments"] = c.arguments
        call["function"] = fn
        calls.append(call)
    if calls:
        out["tool_calls"] = calls
    return out
