"""Request parsing for the HTTP API: raw JSON -> validated inputs, or a :class:`CacheOpError`.

Parsing is hand-written rather than left to pydantic so that every rejection names the exact
field and index (``input_ids[2][5]``, ``cache.drop["7"]``, ``messages[3].content``) in the one
error shape the API promises. ``CacheOpError`` is the single "invalid request" exception of the
whole stack: the engine's :meth:`check` raises it too, and the app turns it into HTTP 400.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from akv_jax.cache.ops import CacheOpError, OpHistory, parse_history, validate_segments
from akv_jax.serving.types import SamplingParams

__all__ = [
    "CacheOpError",
    "ChatInput",
    "GenerateInput",
    "Limits",
    "chat_history",
    "check_prompt_size",
    "final_position",
    "parse_chat",
    "parse_generate",
    "parse_json_body",
    "parse_sampling",
]

INT64_MAX = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-request size limits (each violation is a 400 naming the field)."""

    max_segments: int = 4096  # segments of /generate, messages of a chat request
    max_prompt_tokens: int = 1 << 20  # all segments together, dropped ones included
    max_new_tokens: int = 32768
    default_max_tokens: int = 1024  # chat requests that give no max_tokens
    max_stop: int = 16  # stop strings / stop token ids
    max_body_bytes: int = 64 << 20


@dataclasses.dataclass(frozen=True)
class GenerateInput:
    segments: list[list[int]]
    history: OpHistory
    sampling: SamplingParams
    return_logprob: bool
    stream: bool


@dataclasses.dataclass(frozen=True)
class ChatInput:
    messages: list[dict[str, Any]]
    cache: Any  # raw ``cache`` object; validated once the segment count is known
    max_tokens: int | None  # None: the server default, clipped to the positions left
    sampling: SamplingParams  # max_new_tokens is a placeholder until max_tokens is resolved
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    template_kwargs: dict[str, Any]  # tools etc., passed to the chat template


# --------------------------------------------------------------------------- field helpers


def parse_json_body(raw: bytes, limits: Limits) -> dict[str, Any]:
    if len(raw) > limits.max_body_bytes:
        raise CacheOpError("body", f"request body of {len(raw)} bytes exceeds the limit of "
                                   f"{limits.max_body_bytes} bytes")
    try:
        # NaN/Infinity are not JSON; refuse them here instead of as odd sampling values later.
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise CacheOpError("body", f"malformed JSON: {e}") from None
    if not isinstance(body, dict):
        raise CacheOpError("body", f"expected a JSON object, got {_kind(body)}")
    return body


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _int(v: Any, field: str, lo: int | None = None, hi: int | None = None) -> int:
    # 3.0 is accepted as 3 (JSON has one number type); 3.5 and True are not integers.
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise CacheOpError(field, f"expected an integer, got {_kind(v)}")
    if lo is not None and v < lo:
        raise CacheOpError(field, f"{v} is below the minimum {lo}")
    if hi is not None and v > hi:
        raise CacheOpError(field, f"{v} exceeds the limit {hi}")
    return v


def _float(v: Any, field: str, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise CacheOpError(field, f"expected a number, got {_kind(v)}")
    x = float(v)
    if not math.isfinite(x) or x < lo or x > hi or (lo_open and x == lo):
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise CacheOpError(field, f"{v} is outside {rng}")
    return x


def _bool(v: Any, field: str) -> bool:
    if not isinstance(v, bool):
        raise CacheOpError(field, f"expected true or false, got {_kind(v)}")
    return v


def _list(v: Any, field: str) -> list[Any]:
    if not isinstance(v, list):
        raise CacheOpError(field, f"expected a list, got {_kind(v)}")
    return v


def _token_ids(v: Any, field: str, vocab_size: int | None, max_len: int) -> tuple[int, ...]:
    items = _list(v, field)
    if len(items) > max_len:
        raise CacheOpError(field, f"{len(items)} entries exceed the limit {max_len}")
    hi = None if vocab_size is None else vocab_size - 1
    out = []
    for j, t in enumerate(items):
        try:
            out.append(_int(t, f"{field}[{j}]", 0, hi))
        except CacheOpError as e:
            if isinstance(t, int) and not isinstance(t, bool):
                raise CacheOpError(e.field, f"token id {t} outside the vocabulary") from None
            raise
    return tuple(out)


def _check_keys(obj: Mapping[str, Any], allowed: set[str], prefix: str) -> None:
    for k in obj:
        if k not in allowed:
            raise CacheOpError(f"{prefix}{k}", "unknown field")


# --------------------------------------------------------------------------- /generate

_GENERATE_KEYS = {"input_ids", "cache", "sampling_params", "return_logprob", "stream"}
_SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos",
}


def parse_sampling(
    obj: Any, limits: Limits, vocab_size: int | None, field: str = "sampling_params"
) -> SamplingParams:
    """The ``sampling_params`` object of /generate (unknown keys are errors, not ignored)."""
    if obj is None:
        obj = {}
    if not isinstance(obj, dict):
        raise CacheOpError(field, f"expected an object, got {_kind(obj)}")
    _check_keys(obj, _SAMPLING_KEYS, f"{field}.")
    kw: dict[str, Any] = {"max_new_tokens": 16}
    if obj.get("max_new_tokens") is not None:
        kw["max_new_tokens"] = _int(
            obj["max_new_tokens"], f"{field}.max_new_tokens", 1, limits.max_new_tokens
        )
    return SamplingParams(**kw, **_common_sampling(obj, field + ".", limits, vocab_size))


def _common_sampling(
    obj: Mapping[str, Any], prefix: str, limits: Limits, vocab_size: int | None
) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if obj.get("temperature") is not None:
        kw["temperature"] = _float(obj["temperature"], f"{prefix}temperature", 0.0, 100.0)
    if obj.get("top_p") is not None:
        kw["top_p"] = _float(obj["top_p"], f"{prefix}top_p", 0.0, 1.0, lo_open=True)
    if obj.get("top_k") is not None:
        k = _int(obj["top_k"], f"{prefix}top_k", -1)
        kw["top_k"] = max(k, 0)  # -1 (vLLM/SGLang spelling) and 0 both mean "no top-k"
    if obj.get("seed") is not None:
        kw["seed"] = _int(obj["seed"], f"{prefix}seed", -INT64_MAX - 1, INT64_MAX)
    if obj.get("stop_token_ids") is not None:
        kw["stop_token_ids"] = _token_ids(
            obj["stop_token_ids"], f"{prefix}stop_token_ids", vocab_size, limits.max_stop
        )
    if obj.get("ignore_eos") is not None:
        kw["ignore_eos"] = _bool(obj["ignore_eos"], f"{prefix}ignore_eos")
    return kw


def check_prompt_size(segments: Sequence[Sequence[int]], limits: Limits, field: str) -> None:
    if len(segments) > limits.max_segments:
        raise CacheOpError(
            field, f"{len(segments)} segments exceed the limit of {limits.max_segments}"
        )
    total = sum(len(s) for s in segments)
    if total > limits.max_prompt_tokens:
        raise CacheOpError(
            field, f"{total} prompt tokens exceed the limit of {limits.max_prompt_tokens}"
        )


def parse_generate(body: dict[str, Any], limits: Limits, vocab_size: int | None) -> GenerateInput:
    _check_keys(body, _GENERATE_KEYS, "")
    if "input_ids" not in body:
        raise CacheOpError("input_ids", "required")
    raw = body["input_ids"]
    # Size limits before the per-token walk, so a huge request is refused cheaply.
    if isinstance(raw, list) and raw and all(isinstance(s, list) for s in raw):
        check_prompt_size(raw, limits, "input_ids")
    elif isinstance(raw, list):
        check_prompt_size([raw], limits, "input_ids")
    segments = validate_segments(raw, "input_ids", vocab_size)
    history = parse_history(body.get("cache"), len(segments), "cache")
    sampling = parse_sampling(body.get("sampling_params"), limits, vocab_size)
    return_logprob = body.get("return_logprob")
    stream = body.get("stream")
    return GenerateInput(
        segments=segments,
        history=history,
        sampling=sampling,
        return_logprob=False if return_logprob is None else _bool(return_logprob,
                                                                  "return_logprob"),
        stream=False if stream is None else _bool(stream, "stream"),
    )


# --------------------------------------------------------------------------- chat

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
# Non-default values of these change the output in ways the engine cannot do; refusing is
# better than silently ignoring them.
_UNSUPPORTED_UNLESS_DEFAULT = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
}


def _message(m: Any, i: int) -> dict[str, Any]:
    field = f"messages[{i}]"
    if not isinstance(m, dict):
        raise CacheOpError(field, f"expected an object, got {_kind(m)}")
    role = m.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise CacheOpError(f"{field}.role", f"expected one of {sorted(_ROLES)}, got {role!r}")
    out = dict(m)
    content = m.get("content")
    if isinstance(content, list):
        # OpenAI content parts: only text can be rendered by a text-only chat template.
        texts = []
        for j, part in enumerate(content):
            pf = f"{field}.content[{j}]"
            if not isinstance(part, dict) or part.get("type") != "text":
                raise CacheOpError(pf, "only {'type': 'text'} content parts are supported")
            if not isinstance(part.get("text"), str):
                raise CacheOpError(f"{pf}.text", "expected a string")
            texts.append(part["text"])
        out["content"] = "".join(texts)
    elif content is None:
        if role != "assistant" or not m.get("tool_calls"):
            raise CacheOpError(f"{field}.content", "required")
        out["content"] = ""
    elif not isinstance(content, str):
        raise CacheOpError(f"{field}.content", f"expected a string, got {_kind(content)}")
    for key in ("name", "tool_call_id", "reasoning_content"):
        if key in m and m[key] is not None and not isinstance(m[key], str):
            raise CacheOpError(f"{field}.{key}", f"expected a string, got {_kind(m[key])}")
    if "tool_calls" in m and m["tool_calls"] is not None:
        _list(m["tool_calls"], f"{field}.tool_calls")
    return out


def parse_chat(body: dict[str, Any], limits: Limits, vocab_size: int | None) -> ChatInput:
    """An OpenAI chat request plus AKV's ``cache``; unknown OpenAI fields are ignored."""
    if "messages" not in body:
        raise CacheOpError("messages", "required")
    raw = _list(body["messages"], "messages")
    if not raw:
        raise CacheOpError("messages", "at least one message is required")
    if len(raw) > limits.max_segments:
        raise CacheOpError(
            "messages", f"{len(raw)} messages exceed the limit of {limits.max_segments}"
        )
    messages = [_message(m, i) for i, m in enumerate(raw)]
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise CacheOpError("model", f"expected a string, got {_kind(body['model'])}")
    n = body.get("n")
    if n is not None and _int(n, "n") != 1:
        raise CacheOpError("n", "only n=1 is supported")
    for key, defaults in _UNSUPPORTED_UNLESS_DEFAULT.items():
        if body.get(key) is not None and body[key] not in defaults:
            raise CacheOpError(key, "not supported")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise CacheOpError("response_format", "only {'type': 'text'} is supported")

    max_tokens = None
    for key in ("max_completion_tokens", "max_tokens"):  # the newer name wins if both
        if body.get(key) is not None:
            max_tokens = _int(body[key], key, 1, limits.max_new_tokens)
            break
    stop: tuple[str, ...] = ()
    if body.get("stop") is not None:
        raw_stop = body["stop"]
        items = [raw_stop] if isinstance(raw_stop, str) else _list(raw_stop, "stop")
        if len(items) > limits.max_stop:
            raise CacheOpError("stop", f"{len(items)} entries exceed the limit {limits.max_stop}")
        for j, s in enumerate(items):
            sf = "stop" if isinstance(raw_stop, str) else f"stop[{j}]"
            if not isinstance(s, str) or not s:
                raise CacheOpError(sf, "expected a non-empty string")
        stop = tuple(items)
    stream = False if body.get("stream") is None else _bool(body["stream"], "stream")
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise CacheOpError("stream_options", f"expected an object, got {_kind(opts)}")
        if opts.get("include_usage") is not None:
            include_usage = _bool(opts["include_usage"], "stream_options.include_usage")
    logprobs = False if body.get("logprobs") is None else _bool(body["logprobs"], "logprobs")
    if body.get("top_logprobs") not in (None, 0):
        _int(body["top_logprobs"], "top_logprobs", 0)
        raise CacheOpError("top_logprobs", "only top_logprobs=0 is supported")
    template_kwargs: dict[str, Any] = {}
    if body.get("tools") is not None:
        tools = _list(body["tools"], "tools")
        for j, t in enumerate(tools):
            if not isinstance(t, dict):
                raise CacheOpError(f"tools[{j}]", f"expected an object, got {_kind(t)}")
        template_kwargs["tools"] = tools
    common = _common_sampling(body, "", limits, vocab_size)
    return ChatInput(
        messages=messages,
        cache=body.get("cache"),
        max_tokens=max_tokens,
        sampling=SamplingParams(max_new_tokens=max_tokens or 1, **common),
        stop=stop,
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        template_kwargs=template_kwargs,
    )


def chat_history(cache: Any, num_messages: int, num_segments: int) -> OpHistory:
    """The op history of a chat request: indices name messages; the generation-prompt segment
    (if any) comes after them and cannot itself be the target of an op."""
    h = parse_history(cache, num_messages, "cache")
    return OpHistory(num_segments, h.drops, h.repos)


def final_position(seg_lens: Sequence[int], history: OpHistory) -> int:
    """``next_pos`` after the last boundary (DESIGN.md §2): where generation starts."""
    pos = 0
    active = [False] * len(seg_lens)
    for s, n in enumerate(seg_lens):
        pos += n
        active[s] = True
        for i in history.drops_at(s):
            active[i] = False
        if history.repos_at(s):
            pos = sum(seg_lens[i] for i in range(s + 1) if active[i])
    return pos
