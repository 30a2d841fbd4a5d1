"""A chat-level reply as a Responses API answer: the Response object
(:func:`response_object`) or its server-sent events (:class:`ResponseEvents`).

Output: one ``reasoning`` item (``reasoning_text`` content, empty ``summary``) if the model
reasoned, one assistant ``message`` item if it wrote content, one ``function_call`` item per
call, in the order generated. A length cut is status ``incomplete`` with reason
``max_output_tokens`` (its last item ``incomplete`` too).

A streamed response assembles to exactly the plain one: :func:`response_object` replays the
reply through :class:`ResponseEvents`.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from akv_jax.serving.responses_body import ResponsesBody, ToolChoiceFunction

__all__ = ["ResponseEvents", "ToolCall", "Usage", "response_object"]

ToolCall = tuple[str, str, str]  # (call_id, name, arguments)


@dataclasses.dataclass(frozen=True)
class Usage:
    """Token counts of one response."""

    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @classmethod
    def from_chat(cls, usage: dict[str, Any], reasoning_tokens: int = 0) -> Usage:
        """From a chat ``usage`` object (``prompt_tokens``, ``completion_tokens``, ...)."""
        details = usage.get("prompt_tokens_details") or {}
        return cls(int(usage["prompt_tokens"]), int(usage["completion_tokens"]),
                   int(details.get("cached_tokens", 0)), reasoning_tokens)

    def to_api(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            # Every prompt token the engine computes (not found cached) enters its cache.
            "input_tokens_details": {
                "cached_tokens": self.cached_tokens,
                "cache_write_tokens": max(0, self.input_tokens - self.cached_tokens),
            },
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.input_tokens + self.output_tokens,
        }


_FINISHED = {"stop": "completed", "tool_calls": "completed", "length": "incomplete"}
_ID_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


@dataclasses.dataclass
class _Item:
    """One output item as it grows: ``text`` is the reasoning, the content or the arguments."""

    kind: str  # reasoning | message | function_call
    id: str
    index: int  # output_index
    call_id: str = ""
    name: str = ""
    text: str = ""
    status: str = "in_progress"

    def part(self, text: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": []}

    def render(self, added: bool = False) -> dict[str, Any]:
        """The item as the API shows it; ``added``: as first announced, before any delta."""
        head = {"id": self.id, "type": self.kind, "status": self.status}
        if self.kind == "function_call":
            return {**head, "call_id": self.call_id, "name": self.name,
                    "arguments": "" if added else self.text}
        content = [] if added else [self.part(self.text)]
        if self.kind == "reasoning":
            return {**head, "summary": [], "content": content}
        return {**head, "role": "assistant", "content": content}


class ResponseEvents:
    """The server-sent events of one streamed response. Feed it the reply as it is generated:
    :meth:`start`, then :meth:`reasoning` / :meth:`content` / :meth:`tool_call` deltas, then
    :meth:`finish` (or :meth:`error`); each returns the SSE strings to send. One output item is
    open at a time: a delta of another kind (or another call) finishes the open one.
    ``response`` is the Response object so far; after :meth:`finish` the final one."""

    def __init__(self, body: ResponsesBody, *, model: str | None = None,
                 response_id: str | None = None, created_at: int | None = None):
        self.body = body
        self.id = response_id or f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time()) if created_at is None else created_at
        self.model = model if model is not None else (body.model or "")
        self.items: list[_Item] = []
        self._open: _Item | None = None
        self._calls: dict[int, _Item] = {}  # tool-call index -> its item
        self._seq = 0
        self._state = "new"
        self.response = self._response("in_progress", None)

    # -- the caller's side

    def start(self) -> list[str]:
        self._expect("new")
        self._state = "running"
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def reasoning(self, text: str) -> list[str]:
        return self._text("reasoning", text)

    def content(self, text: str) -> list[str]:
        return self._text("message", text)

    def tool_call(self, index: int, id: str | None, name: str | None,
                  arguments: str) -> list[str]:
        """A piece of tool call ``index``'s arguments; its ``id`` (the call_id) and ``name``
        come with its first piece."""
        self._expect("running")
        out: list[str] = []
        item = self._calls.get(index)
        if item is None:
            if id is None or name is None:
                raise ValueError(f"tool call {index}: the first piece needs its id and name")
            out += self._close("completed")
            item = self._add("function_call", call_id=id, name=name)
            self._calls[index] = item
            out.append(self._added(item))
        elif item is not self._open:
            raise ValueError(f"tool call {index} was already finished")
        if arguments:
            item.text += arguments
            out.append(self._event("response.function_call_arguments.delta",
                                   **self._where(item), delta=arguments))
        return out

    def finish(self, finish_reason: str, usage: Usage) -> list[str]:
        """The last events: ``finish_reason`` is chat's (stop, length or tool_calls)."""
        self._expect("running")
        if finish_reason not in _FINISHED:
            raise ValueError(f"unknown finish reason {finish_reason!r}")
        status = _FINISHED[finish_reason]
        out = self._close(status)
        self._state = "finished"
        self.response = self._response(status, usage)
        out.append(self._event(f"response.{status}", response=self.response))
        return out

    def error(self, message: str, param: str | None = None,
              code: str | None = None) -> list[str]:
        """An ``error`` event for a failure after the stream has started; it ends the stream."""
        self._state = "finished"
        return [self._event("error", code=code, message=message, param=param)]

    # -- events

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def _where(self, item: _Item) -> dict[str, Any]:
        where: dict[str, Any] = {"item_id": item.id, "output_index": item.index}
        if item.kind != "function_call":
            where["content_index"] = 0  # one part per item
        return where

    def _expect(self, state: str) -> None:
        if self._state != state:
            raise RuntimeError(f"response stream is {self._state}, not {state}")

    def _add(self, kind: str, **fields: Any) -> _Item:
        suffix, n = self.id.removeprefix("resp_"), len(self.items)
        item = _Item(kind, f"{_ID_PREFIX[kind]}_{suffix}_{n}", n, **fields)
        self.items.append(item)
        self._open = item
        return item

    def _added(self, item: _Item) -> str:
        return self._event("response.output_item.added", output_index=item.index,
                           item=item.render(added=True))

    def _text(self, kind: str, text: str) -> list[str]:
        self._expect("running")
        if not text:
            return []
        out: list[str] = []
        item = self._open
        if item is None or item.kind != kind:
            out += self._close("completed")
            item = self._add(kind)
            out.append(self._added(item))
            out.append(self._event("response.content_part.added", **self._where(item),
                                   part=item.part("")))
        item.text += text
        if kind == "reasoning":
            out.append(self._event("response.reasoning_text.delta", **self._where(item),
                                   delta=text))
        else:
            out.append(self._event("response.output_text.delta", **self._where(item),
                                   delta=text, logprobs=[]))
        return out

    def _close(self, status: str) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        where = self._where(item)
        if item.kind == "function_call":
            out = [self._event("response.function_call_arguments.done", **where,
                               arguments=item.text)]
        else:
            if item.kind == "reasoning":
                done = self._event("response.reasoning_text.done", **where, text=item.text)
            else:
                done = self._event("response.output_text.done", **where, text=item.text,
                                   logprobs=[])
            out = [done, self._event("response.content_part.done", **where,
                                     part=item.part(item.text))]
        out.append(self._event("response.output_item.done", output_index=item.index,
                               item=item.render()))
        return out

    # -- the Response object

    def _response(self, status: str, usage: Usage | None) -> dict[str, Any]:
        b = self.body
        fmt = b.text.format if b.text is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": b.instructions,
            "metadata": b.metadata or {},
            "model": self.model,
            "output": [it.render() for it in self.items] if status != "in_progress" else [],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "tool_choice": _echo_tool_choice(b),
            "tools": [t.model_dump(exclude_none=False) for t in b.tools or ()],
            "text": {"format": (fmt.model_dump(by_alias=True, exclude_none=True)
                                if fmt is not None else {"type": "text"})},
            "max_output_tokens": b.max_output_tokens,
            "reasoning": ({"effort": b.reasoning.effort, "summary": None}
                          if b.reasoning is not None else None),
            "previous_response_id": None,
            "store": False,
            "truncation": "disabled",
            "user": b.user,
            "usage": usage.to_api() if usage is not None else None,
        }


def _echo_tool_choice(b: ResponsesBody) -> Any:
    if b.tool_choice is None:
        return "auto"
    if isinstance(b.tool_choice, ToolChoiceFunction):
        return b.tool_choice.model_dump()
    return b.tool_choice


def response_object(
    body: ResponsesBody,
    *,
    reasoning: str = "",
    content: str = "",
    tool_calls: Sequence[ToolCall] = (),
    finish_reason: str,
    usage: Usage,
    model: str | None = None,
    response_id: str | None = None,
    created_at: int | None = None,
) -> dict[str, Any]:
    """The Response object of a finished reply. Built by replaying the reply through
    :class:`ResponseEvents`, so a streamed response assembles to exactly this object."""
    events = ResponseEvents(body, model=model, response_id=response_id, created_at=created_at)
    events.start()
    events.reasoning(reasoning)
    events.content(content)
    for i, (call_id, name, arguments) in enumerate(tool_calls):
        events.tool_call(i, call_id, name, arguments)
    events.finish(finish_reason, usage)
    return events.response
