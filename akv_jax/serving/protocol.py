"""Request parsing for the HTTP API: raw bytes -> validated engine inputs, or an error.

The body shapes are the pydantic models of :mod:`akv_jax.serving.generate_body` and
:mod:`akv_jax.serving.chat_body`, run by :func:`akv_jax.serving.body_validation.validated`;
this module adds what no schema says, each rule stated once elsewhere and only called here:
op histories and segments (:mod:`akv_jax.cache.ops`), the valid sampling ranges
(:func:`akv_jax.serving.sampler.invalid_param`), and converts the result into engine types.
Every rejection is an :class:`~akv_jax.errors.InvalidField` naming the field and index
(``input_ids[2][5]``, ``cache.drop["7"]``, ``messages[3].content``); the op-history and segment
ones are its subclass :class:`~akv_jax.cache.ops.CacheOpError`. The app answers them with 400.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from akv_jax.cache.ops import OpHistory, parse_history, validate_segments
from akv_jax.errors import InvalidField
from akv_jax.serving.body_fields import SamplingFields
from akv_jax.serving.body_validation import validated
from akv_jax.serving.chat_body import ChatBody, Message
from akv_jax.serving.generate_body import GenerateBody
from akv_jax.serving.sampler import invalid_param
from akv_jax.serving.segment_memo import SegmentMemo
from akv_jax.serving.types import SamplingParams

__all__ = [
    "BodyTooLarge",
    "ChatInput",
    "GenerateInput",
    "Limits",
    "chat_history",
    "check_prompt_size",
    "parse_chat",
    "parse_generate",
    "parse_generate_bytes",
    "parse_json_body",
    "removed_reasoning",
    "sampling",
]


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-request size limits (each violation is a 400 naming the field)."""

    max_segments: int = 4096  # segments of /generate, messages of a chat request
    max_prompt_tokens: int = 1 << 20  # all segments together, dropped ones included
    max_new_tokens: int = 32768
    default_max_tokens: int = 1024  # chat requests that give no max_tokens
    max_stop: int = 16  # stop strings / stop token ids
    max_body_bytes: int = 64 << 20
    # Agents (tool_use.py, reply_record.py): tokens a constrained reply may reason for before
    # its call or document, and how many recent replies' ids are kept for cache hits.
    reasoning_budget: int = 256
    reply_record: int = 4096


class BodyTooLarge(InvalidField):
    """A request body over ``Limits.max_body_bytes``: HTTP 413, not 400."""

    def __init__(self, limit: int):
        super().__init__("body", f"request body exceeds the limit of {limit} bytes")


@dataclasses.dataclass(frozen=True)
class GenerateInput:
    segments: list[list[int]]
    history: OpHistory
    sampling: SamplingParams
    return_logprob: bool
    stream: bool


@dataclasses.dataclass(frozen=True)
class ChatInput:
    messages: list[dict[str, Any]]  # as the chat template takes them (content a string)
    cache: Any  # raw ``cache`` object; validated once the segment count is known
    max_tokens: int | None  # None: the server default, clipped to the positions left
    sampling: SamplingParams  # max_new_tokens is a placeholder until max_tokens is resolved
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    template_kwargs: dict[str, Any]  # tools etc., passed to the chat template
    tools: list[dict[str, Any]] | None = None  # OpenAI's tool dicts, as sent
    tool_choice: str | dict[str, Any] = "none"  # resolved: "auto" when tools are given
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None  # json_object / json_schema; None: text
    # cache.removed_reasoning: "drop" serves reasoning left out of a recorded reply as a drop
    # of it (removed_reasoning.py); "as_sent" (the default) serves the text as sent.
    removed_reasoning: str = "as_sent"


def parse_json_body(raw: bytes, limits: Limits) -> dict[str, Any]:
    if len(raw) > limits.max_body_bytes:
        raise BodyTooLarge(limits.max_body_bytes)
    body = _loads(raw)
    if not isinstance(body, dict):
        raise InvalidField("body", f"expected a JSON object, got {_JSON_KINDS[type(body)]}")
    return body


def _loads(raw: bytes) -> Any:
    """``raw`` parsed as ``json.loads(raw, parse_constant=_reject_constant)`` would, with its
    errors, but at orjson's speed (a 32K-token history is resent every turn).

    orjson gives the same values wherever it accepts a body, except integers past 64 bits,
    which it turns into floats (a token id 2**64 must stay an int, refused by the vocabulary
    check later): a body with a run of 19 digits or more goes to ``json.loads``. So does
    every body orjson refuses, for ``json.loads``'s own error message, or its value where
    it is more lenient (UTF-16 and UTF-32 bodies, a BOM, lone surrogates, deep nesting).
    """
    if not _long_digit_run(raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    try:
        # NaN/Infinity are not JSON; refuse them here instead of as odd sampling values later.
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidField("body", f"malformed JSON: {e}") from None


def _long_digit_run(raw: bytes) -> bool:
    """Whether ``raw`` holds 19 ASCII digits in a row (an integer literal outside
    [-2**63, 2**63) has that many), as array ops: digit flags ANDed with themselves shifted
    by 1, 2, 4, 8 (a run of 16 starts at i) and 3 (a run of 19)."""
    run = (np.frombuffer(raw, np.uint8) - ord("0")) < 10  # bytes below "0" wrap past 10
    for k in (1, 2, 4, 8, 3):
        run = run[:-k] & run[k:]
    return bool(run.any())


_JSON_KINDS = {list: "a list", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def sampling(
    fields: SamplingFields, max_new_tokens: int | None, prefix: str = ""
) -> SamplingParams:
    """The engine's :class:`SamplingParams` from the API's sampling fields (the one place they
    are converted); out-of-range values raise :class:`InvalidField` ``<prefix><name>``."""
    kw = fields.model_dump(include=set(SamplingFields.model_fields), exclude_none=True)
    if max_new_tokens is not None:
        kw["max_new_tokens"] = max_new_tokens
    if "stop_token_ids" in kw:
        kw["stop_token_ids"] = tuple(kw["stop_token_ids"])
    if kw.get("top_k") == -1:
        kw["top_k"] = 0  # -1 (vLLM/SGLang spelling) and 0 both mean "no top-k"
    params = SamplingParams(**kw)
    bad = invalid_param(params)
    if bad is not None:
        raise InvalidField(prefix + bad[0], bad[1])
    return params


def check_prompt_size(segments: Sequence[Sequence[int]], limits: Limits, field: str) -> None:
    if len(segments) > limits.max_segments:
        raise InvalidField(
            field, f"{len(segments)} segments exceed the limit of {limits.max_segments}"
        )
    total = sum(len(s) for s in segments)
    if total > limits.max_prompt_tokens:
        raise InvalidField(
            field, f"{total} prompt tokens exceed the limit of {limits.max_prompt_tokens}"
        )


# --------------------------------------------------------------------------- /generate


def parse_generate_bytes(raw: bytes, limits: Limits, vocab_size: int | None,
                         memo: SegmentMemo | None = None) -> GenerateInput:
    """A /generate body as :func:`parse_generate` reads it; with ``memo``, segments sent
    before are not parsed or checked again (see :mod:`.segment_memo`)."""
    if len(raw) > limits.max_body_bytes:
        raise BodyTooLarge(limits.max_body_bytes)
    split = memo.split(raw) if memo is not None else None
    if split is not None:
        rest, segments = split
        try:
            body = _loads(rest)
        except InvalidField:  # worded from the whole body below
            body = None
        if isinstance(body, dict) and body.get("input_ids") == []:  # not given twice
            body["input_ids"] = segments
            return parse_generate(body, limits, vocab_size)
    return parse_generate(parse_json_body(raw, limits), limits, vocab_size)


def parse_generate(body: Any, limits: Limits, vocab_size: int | None) -> GenerateInput:
    b = validated(GenerateBody, body, limits, vocab_size)
    raw = b.input_ids
    # Size limits before the per-token walk, so a huge request is refused cheaply.
    if isinstance(raw, list) and raw and all(isinstance(s, (list, np.ndarray)) for s in raw):
        check_prompt_size(raw, limits, "input_ids")
    elif isinstance(raw, list):
        check_prompt_size([raw], limits, "input_ids")
    segments = validate_segments(raw, "input_ids", vocab_size)
    history = parse_history(b.cache, len(segments), "cache")
    sp = b.sampling_params or SamplingFields()
    return GenerateInput(
        segments=segments,
        history=history,
        sampling=sampling(sp, getattr(sp, "max_new_tokens", None), "sampling_params."),
        return_logprob=bool(b.return_logprob),
        stream=bool(b.stream),
    )


# --------------------------------------------------------------------------- chat


def _template_message(m: Message) -> dict[str, Any]:
    """A message as the chat template takes it: its keys as sent, content one string."""
    out = m.model_dump(exclude_unset=True, exclude={"content"})
    out["content"] = "".join(p.text for p in m.content or ())
    return out


def parse_chat(body: Any, limits: Limits, vocab_size: int | None) -> ChatInput:
    """An OpenAI chat request plus AKV's ``cache``; unknown OpenAI fields are ignored."""
    b = validated(ChatBody, body, limits, vocab_size)
    max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    cache, removed = removed_reasoning(b.cache, "cache")
    return ChatInput(
        messages=[_template_message(m) for m in b.messages],
        cache=cache,
        removed_reasoning=removed,
        max_tokens=max_tokens,
        sampling=sampling(b, max_tokens or 1),
        stop=tuple(b.stop or ()),
        stream=bool(b.stream),
        include_usage=bool(b.stream_options and b.stream_options.include_usage),
        logprobs=bool(b.logprobs),
        template_kwargs=_template_kwargs(b),
        **agent_fields(b),
    )


def agent_fields(b: ChatBody) -> dict[str, Any]:
    """tools, tool_choice, parallel_tool_calls and response_format as plain values, with
    OpenAI's defaults resolved; what depends on the model (a template that cannot render
    tools, a schema the grammar engine refuses) is checked by :mod:`.tool_use`."""
    tools = [t.model_dump(exclude_none=True) for t in b.tools] if b.tools else None
    choice: str | dict[str, Any] = (
        b.tool_choice if isinstance(b.tool_choice, str)
        else b.tool_choice.model_dump() if b.tool_choice is not None
        else "auto" if tools else "none"
    )
    if choice != "none" and not tools:
        raise InvalidField("tool_choice", f"{json.dumps(choice)} needs tools, and none are given")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in {t["function"]["name"] for t in tools or ()}:
            raise InvalidField("tool_choice.function.name",
                               f"{name!r} is not one of the declared tools")
    rf = b.response_format
    fmt = None
    if rf is not None and rf.type != "text":
        fmt = {"type": rf.type}
        if rf.json_schema is not None:
            fmt["json_schema"] = rf.json_schema.model_dump(by_alias=True, exclude_none=True)
    return dict(tools=tools, tool_choice=choice,
                parallel_tool_calls=b.parallel_tool_calls is not False, response_format=fmt)


REMOVED_REASONING = ("as_sent", "drop")


def removed_reasoning(cache: Any, field: str) -> tuple[Any, str]:
    """``cache`` without its ``removed_reasoning`` option, and the option (checked)."""
    if not isinstance(cache, dict) or "removed_reasoning" not in cache:
        return cache, "as_sent"
    value = cache["removed_reasoning"]
    if value not in REMOVED_REASONING:
        raise InvalidField(f"{field}.removed_reasoning",
                           f"expected one of {', '.join(map(repr, REMOVED_REASONING))}, "
                           f"got {json.dumps(value)}")
    rest = {k: v for k, v in cache.items() if k != "removed_reasoning"}
    return rest, value


def _template_kwargs(b: ChatBody) -> dict[str, Any]:
    """Variables for the chat template beside the messages: chat_template_kwargs, then the
    request's own fields (tools, reasoning_effort) where given."""
    out = dict(b.chat_template_kwargs or {})
    if b.tools:
        out["tools"] = [t.model_dump(exclude_none=True) for t in b.tools]
    if b.reasoning_effort is not None:
        out["reasoning_effort"] = b.reasoning_effort
    return out


def chat_history(cache: Any, num_messages: int, num_segments: int) -> OpHistory:
    """The op history of a chat request: indices name messages; the generation-prompt segment
    (if any) comes after them and cannot itself be the target of an op."""
    h = parse_history(cache, num_messages, "cache")
    return OpHistory(num_segments, h.drops, h.repos)
