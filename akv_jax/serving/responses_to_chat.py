"""A Responses request (:class:`ResponsesBody`) as the Chat Completions request the engine
speaks: :func:`to_chat`.

Input items -> chat messages (the contract the ``cache`` indices rely on):

- ``instructions``, if given, is message 0, a ``developer`` message; no cache index names it.
- ``input`` as a string is one user message item (item 0).
- A ``message`` item of role user, system or developer is one message of that role.
- A run of consecutive assistant-side items (``reasoning``, ``message`` of role assistant,
  ``function_call``) is ONE assistant message: ``reasoning_content`` is the reasoning texts
  (an item's ``reasoning_text`` content parts, else its ``summary`` parts), ``content`` the
  assistant texts, ``tool_calls`` the calls in order (``id`` = ``call_id``, arguments the exact
  string sent). Parts of one item are joined with "", items of a run with "\\n". The order of
  kinds inside a run is not kept: the chat template renders reasoning, content, calls.
- A ``function_call_output`` is one ``tool`` message: ``tool_call_id`` = its ``call_id``, and
  ``name`` that of the ``function_call`` with that ``call_id``, which must come earlier.

``ChatTranslation.item_to_message[i]`` is the message index of input item ``i``.

``cache`` has chat's grammar (DESIGN §2, ``{"drop": {"5": [1, 3]}, "reposition": [5, 9]}``)
with INPUT ITEM indices; the item-level rules (ranges, order, duplicates) are chat's, then:

- a boundary b (a ``drop`` key or a ``reposition`` entry) must be the last item of its
  message, and becomes that message's index;
- dropping item i drops its whole message, so every item of that message must be dropped, at
  the same boundary;
- other keys of ``cache`` pass to the chat body unchanged, for the chat layer to judge.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from akv_jax.cache.ops import parse_history
from akv_jax.errors import InvalidField
from akv_jax.serving.body_fields import SamplingFields
from akv_jax.serving.responses_body import (
    FormatJsonObject,
    FormatJsonSchema,
    FormatText,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ReasoningItem,
    ResponsesBody,
    ToolChoiceFunction,
    joined_text,
)

__all__ = ["ChatTranslation", "to_chat"]


@dataclasses.dataclass(frozen=True)
class ChatTranslation:
    """A Chat Completions request body, and the message index of each input item."""

    body: dict[str, Any]
    item_to_message: list[int]


def to_chat(body: ResponsesBody) -> ChatTranslation:
    """The chat request equivalent to ``body`` (mapping in the module docstring). Raises
    :class:`InvalidField` for what needs the whole request to judge: ``cache``, a
    ``function_call_output`` with no call, ``tool_choice`` naming no tool."""
    messages, item_to_message = _messages(body)
    chat: dict[str, Any] = {"messages": messages}
    if body.model is not None:
        chat["model"] = body.model
    if body.tools is not None:
        chat["tools"] = [t.to_chat() for t in body.tools]
    if body.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(body)
    if body.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    fmt = body.text.format if body.text is not None else None
    if fmt is not None:
        chat["response_format"] = _chat_format(fmt)
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    chat.update(body.model_dump(include=set(SamplingFields.model_fields), exclude_none=True))
    if body.stream is not None:
        chat["stream"] = body.stream
    if body.stream:
        chat["stream_options"] = {"include_usage": True}  # a Response always reports usage
    if body.cache is not None:
        chat["cache"] = _chat_cache(body.cache, item_to_message)
    return ChatTranslation(chat, item_to_message)


def _messages(body: ResponsesBody) -> tuple[list[dict[str, Any]], list[int]]:
    runs: list[list[InputItem]] = []  # one per message: a run of assistant-side items or one
    for item in body.input:
        if runs and _assistant_side(item) and _assistant_side(runs[-1][-1]):
            runs[-1].append(item)
        else:
            runs.append([item])
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "developer", "content": body.instructions})
    item_to_message: list[int] = []
    names: dict[str, str] = {}  # call_id -> function name, of the calls seen so far
    for run in runs:
        first = len(item_to_message)
        item_to_message += [len(messages)] * len(run)
        item = run[0]
        if _assistant_side(item):
            messages.append(_assistant_message(run))
            names.update((c.call_id, c.name) for c in run if isinstance(c, FunctionCallItem))
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in names:
                raise InvalidField(f"input[{first}].call_id",
                                   f"no function_call with call_id {item.call_id!r} before it")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "name": names[item.call_id], "content": joined_text(item.output)})
        else:
            assert isinstance(item, MessageItem)
            messages.append({"role": item.role, "content": joined_text(item.content)})
    return messages, item_to_message


def _assistant_side(item: InputItem) -> bool:
    return isinstance(item, (ReasoningItem, FunctionCallItem)) or (
        isinstance(item, MessageItem) and item.role == "assistant"
    )


def _assistant_message(run: list[InputItem]) -> dict[str, Any]:
    reasoning = [it.text() for it in run if isinstance(it, ReasoningItem)]
    texts = [joined_text(it.content) for it in run if isinstance(it, MessageItem)]
    calls = [it for it in run if isinstance(it, FunctionCallItem)]
    # Chat's shape: content may be null only beside tool calls.
    out: dict[str, Any] = {"role": "assistant",
                           "content": "\n".join(texts) if texts else (None if calls else "")}
    if reasoning:
        out["reasoning_content"] = "\n".join(reasoning)
    if calls:
        out["tool_calls"] = [
            {"id": c.call_id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return out


def _chat_tool_choice(body: ResponsesBody) -> Any:
    choice = body.tool_choice
    if not isinstance(choice, ToolChoiceFunction):
        return choice
    if choice.name not in {t.name for t in body.tools or ()}:
        raise InvalidField("tool_choice.name", f"no function tool named {choice.name!r} in tools")
    return {"type": "function", "function": {"name": choice.name}}


def _chat_format(fmt: FormatText | FormatJsonObject | FormatJsonSchema) -> dict[str, Any]:
    if not isinstance(fmt, FormatJsonSchema):
        return {"type": fmt.type}
    spec = fmt.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)
    return {"type": "json_schema", "json_schema": spec}


def _chat_cache(cache: Any, item_to_message: list[int]) -> Any:
    """``cache`` with item indices -> the same ops with message indices (module docstring)."""
    ops = ("drop", "reposition")
    if not isinstance(cache, dict):
        parse_history(cache, len(item_to_message), "cache")  # raises, naming the field
        return cache
    # Chat's rules on the item indices first, so their errors name items as sent.
    parse_history({k: v for k, v in cache.items() if k in ops}, len(item_to_message), "cache")
    members: dict[int, list[int]] = {}
    for i, m in enumerate(item_to_message):
        members.setdefault(m, []).append(i)

    def boundary(b: int, field: str) -> int:
        m = item_to_message[b]
        last = members[m][-1]
        if b != last:
            raise InvalidField(field, f"boundary {b} is inside message {m} (input items "
                                      f"{members[m][0]}..{last}): an op boundary must be the "
                                      f"last item of its message, here input item {last}")
        return m

    out = {k: v for k, v in cache.items() if k not in ops}
    if "drop" in cache:
        drops: dict[str, list[int]] = {}
        for key, items in (cache["drop"] or {}).items():
            field = f'cache.drop["{key}"]'
            if not items:
                continue  # no op at this boundary, as chat reads it
            m = boundary(int(key), field)
            dropped = set(items)
            for k, i in enumerate(items):
                missing = [j for j in members[item_to_message[i]] if j not in dropped]
                if missing:
                    mi = item_to_message[i]
                    raise InvalidField(
                        f"{field}[{k}]",
                        f"item {i} is part of message {mi} (input items {members[mi][0]}.."
                        f"{members[mi][-1]}), which is dropped whole: drop all its items at the "
                        f"same boundary (item {missing[0]} is not dropped at {key})",
                    )
            drops[str(m)] = sorted({item_to_message[i] for i in items})
        out["drop"] = dict(sorted(drops.items(), key=lambda kv: int(kv[0])))
    if "reposition" in cache:
        out["reposition"] = sorted(
            boundary(b, f"cache.reposition[{j}]") for j, b in enumerate(cache["reposition"] or [])
        )
    return out
