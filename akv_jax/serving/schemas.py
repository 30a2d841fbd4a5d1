"""The request bodies of the HTTP API as pydantic models, and their errors in our notation.

The models state the shape of each body (types, required fields, unknown-key policy, fixed
ranges); they also give the OpenAPI document at ``/openapi.json``. Limits that depend on the
server (``Limits``, the vocabulary size) come in as the validation context. What no schema can
say stays by hand in one place each: the op-history rules (``cache``:
:func:`akv_jax.cache.ops.parse_history`), the segment and vocabulary rules (``input_ids``:
:func:`akv_jax.cache.ops.validate_segments`) and the valid sampling ranges
(:func:`akv_jax.serving.sampler.invalid_param`); those two fields are ``Any`` here, with a
hand-written JSON schema for the documentation.

:func:`validated` runs a model and turns the first pydantic error into :class:`InvalidField`,
its ``loc`` written by :func:`field_path` in the bracket notation of the whole API
(``messages[3].content``, ``sampling_params.top_p``, ``cache.drop["5"][1]``).

Numbers are strict, as JSON is: a boolean is never a number, a string never an integer;
an integral float (``3.0``) is an integer, since JSON has one number type. NaN and Infinity
never get here (the body parser refuses them), and float fields refuse them anyway.
"""

from __future__ import annotations

import json
import reprlib
import typing
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_core.core_schema import ErrorType

from akv_jax.cache.ops import token_outside_vocab
from akv_jax.errors import InvalidField

__all__ = [
    "FUNCTION_NAME",
    "ChatBody",
    "ResponseFormat",
    "Tool",
    "GenerateBody",
    "Message",
    "SamplingBody",
    "SamplingFields",
    "field_path",
    "validated",
]

INT64_MAX = 2**63 - 1
# What the server itself passes to a chat template (chat_template_kwargs may not set them).
TEMPLATE_INPUTS = frozenset({"messages", "add_generation_prompt", "tools", "bos_token",
                             "eos_token", "raise_exception"})

# --------------------------------------------------------------------------- errors


def field_path(loc: Sequence[str | int]) -> str:
    """A pydantic ``loc`` in the API's notation: ``("messages", 3, "content")`` ->
    ``messages[3].content``; an integer is a list index, a string that is not an identifier
    a mapping key (``["5"]``)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.isidentifier():
            out += f"[{json.dumps(part)}]"
        else:
            out += f".{part}" if out else part
    return out


_BUILTIN_ERRORS = frozenset(typing.get_args(ErrorType))
_REPR = reprlib.Repr(maxstring=30, maxother=30, maxlist=3, maxdict=3, maxlevel=2)


def _shown(v: Any) -> str:
    """A value at fault, short: JSON's spelling of true/false/null, else an abbreviated
    repr (a client may send megabytes)."""
    text = json.dumps(v) if v is None or isinstance(v, bool) else _REPR.repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _message(err: Any) -> str:
    """Pydantic's message, plus the value at fault where it is short to show. Messages of our
    own validators already say what they need."""
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "too_short":
        return "at least {min_length} required, got {actual_length}".format(**err["ctx"])
    msg = "Input should be an object" if kind in ("model_type", "dict_type") else err["msg"]
    if kind in _BUILTIN_ERRORS and kind != "missing":
        return f"{msg}, got {_shown(err['input'])}"
    return msg


def validated[M: BaseModel](
    model: type[M], data: Any, limits: Any = None, vocab_size: int | None = None
) -> M:
    """``model`` validated from ``data`` (a decoded JSON body); the first problem raises
    :class:`InvalidField` naming its field."""
    try:
        return model.model_validate(data, context={"limits": limits, "vocab_size": vocab_size})
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        raise InvalidField(field_path(err["loc"]) or "body", _message(err)) from None


# --------------------------------------------------------------------------- field types


def _integral(v: Any) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _limit(info: ValidationInfo, name: str) -> int | None:
    limits = (info.context or {}).get("limits")
    return None if limits is None else getattr(limits, name)


def _at_most(name: str):
    """At most ``Limits.<name>`` (a server setting, so not part of the static schema)."""

    def check(v: int, info: ValidationInfo) -> int:
        hi = _limit(info, name)
        if hi is not None and v > hi:
            raise PydanticCustomError("limit", "{value} exceeds the limit {limit}",
                                      {"value": v, "limit": hi})
        return v

    return AfterValidator(check)


def _max_items(name: str, what: str = "entries"):
    """At most ``Limits.<name>`` items, checked before the items are (a huge list is refused
    cheaply)."""

    def check(v: Any, info: ValidationInfo) -> Any:
        hi = _limit(info, name)
        if hi is not None and isinstance(v, list) and len(v) > hi:
            raise PydanticCustomError("limit", "{n} {what} exceed the limit of {limit}",
                                      {"n": len(v), "what": what, "limit": hi})
        return v

    return BeforeValidator(check)


def _only(default: Any):
    """An OpenAI option the engine cannot honour: accepted only at its default value."""

    def check(v: Any, info: ValidationInfo) -> Any:
        if v != default:
            raise PydanticCustomError(
                "unsupported", "not supported (only {field}={default} is)",
                {"field": info.field_name, "default": json.dumps(default)},
            )
        return v

    return AfterValidator(check)


def _in_vocab(t: int, info: ValidationInfo) -> int:
    why = token_outside_vocab(t, (info.context or {}).get("vocab_size"))
    if why is not None:
        raise PydanticCustomError("vocab", why)
    return t


def _int(**bounds: int) -> Any:
    """An integer within ``bounds`` (the bounds go first, so the JSON schema shows them)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


Int = _int()
Count = _int(ge=1)  # max_new_tokens, max_tokens
TokenId = Annotated[Int, AfterValidator(_in_vocab)]
Number = float  # strict: an int is a number, a bool or a string is not

# Documentation only: these two are checked by cache/ops (see the module docstring).
_INPUT_IDS_SCHEMA = {
    "description": "token ids: a list of segments (lists of ids), or one flat list "
                   "(a single segment)",
    "anyOf": [
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
        {"type": "array", "items": {"type": "integer"}},
    ],
}
_CACHE_SCHEMA = {
    "description": "cache operations (DESIGN.md §2): after appending segment b, drop the "
                   "listed segments (drop), and/or compact positions (reposition)",
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "drop": {"type": "object",
                         "additionalProperties": {"type": "array", "items": {"type": "integer"}}},
                "reposition": {"type": "array", "items": {"type": "integer"}},
            },
            "additionalProperties": False,
        },
        {"type": "null"},
    ],
}
InputIds = Annotated[Any, WithJsonSchema(_INPUT_IDS_SCHEMA)]
CacheOps = Annotated[Any, WithJsonSchema(_CACHE_SCHEMA)]

_STRICT = ConfigDict(strict=True, allow_inf_nan=False)


# --------------------------------------------------------------------------- sampling


class SamplingFields(BaseModel):
    """Sampling fields shared by ``sampling_params`` (/generate) and the chat body.
    ``None`` (or absent) is the engine's default. Valid ranges are ``invalid_param``'s, checked
    when the fields become the engine's ``SamplingParams`` (``protocol.sampling``)."""

    model_config = _STRICT

    temperature: Annotated[Number, Field(le=100.0)] | None = None  # 0 is greedy
    top_p: Number | None = None
    top_k: _int(ge=-1) | None = None  # -1 (vLLM/SGLang's spelling) and 0: off
    seed: _int(ge=-INT64_MAX - 1, le=INT64_MAX) | None = None
    stop_token_ids: Annotated[list[TokenId], _max_items("max_stop")] | None = None
    ignore_eos: bool | None = None


class SamplingBody(SamplingFields):
    """``sampling_params`` of /generate; unknown keys are errors, not ignored."""

    model_config = ConfigDict(**_STRICT, extra="forbid")

    max_new_tokens: Annotated[Count, _at_most("max_new_tokens")] | None = None


# --------------------------------------------------------------------------- /generate


class GenerateBody(BaseModel):
    """The body of ``POST /generate``: token-id segments plus cache operations."""

    model_config = ConfigDict(**_STRICT, extra="forbid")

    input_ids: InputIds
    cache: CacheOps = None
    sampling_params: SamplingBody | None = None
    return_logprob: bool | None = None
    stream: bool | None = None


# --------------------------------------------------------------------------- chat


class TextPart(BaseModel):
    """An OpenAI content part; a text-only chat template renders only text."""

    model_config = ConfigDict(**_STRICT, extra="allow")

    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if not isinstance(v, dict) or v.get("type") != "text":
            raise PydanticCustomError(
                "unsupported", "only {'type': 'text'} content parts are supported"
            )
        return v


def _as_parts(v: Any) -> Any:
    """A string is one text part; anything but a string, a list or null is refused here."""
    if isinstance(v, str):
        return [{"type": "text", "text": v}]
    if v is not None and not isinstance(v, list):
        raise PydanticCustomError(
            "content_type", "expected a string or a list of content parts, got {kind}",
            {"kind": _shown(v)},
        )
    return v


class CalledFunction(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="forbid")

    name: str
    # OpenAI sends a JSON string; kept exactly as sent (a reply's record is keyed on it).
    arguments: str | dict[str, Any]


class ToolCallIn(BaseModel):
    """A call of an assistant message sent back as history."""

    model_config = ConfigDict(**_STRICT, extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    """A chat message; keys not named here are passed to the chat template as they are."""

    model_config = ConfigDict(**_STRICT, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    tool_calls: list[ToolCallIn] | None = None
    content: Annotated[
        list[TextPart] | None,
        BeforeValidator(_as_parts, json_schema_input_type=str | list[TextPart] | None),
    ] = Field(None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _content_required(cls, v: Any, info: ValidationInfo) -> Any:
        # Only an assistant message that calls tools may leave its content out.
        if v is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise PydanticCustomError("missing", "required (only an assistant message with "
                                                 "tool_calls may omit it)")
        return v


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool | None = None


# --------------------------------------------------------------------------- agents

# OpenAI's rule for function names (the Agents SDK and the official client follow it).
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


def _json_schema_object(v: Any) -> Any:
    if not isinstance(v, dict):
        raise PydanticCustomError("schema_type", "a JSON schema must be an object, got {kind}",
                                  {"kind": _shown(v)})
    return v


JsonSchema = Annotated[dict[str, Any], BeforeValidator(_json_schema_object)]


class FunctionDef(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="forbid")

    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: JsonSchema | None = None  # None: any arguments object
    strict: bool | None = None


class Tool(BaseModel):
    """A Chat Completions tool: only functions are served."""

    model_config = ConfigDict(**_STRICT, extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="forbid")

    type: Literal["function"]
    function: NamedFunction


TOOL_CHOICE_MODES = ("none", "auto", "required")


def _tool_choice(v: Any) -> Any:
    """A mode or a named function; one message for every wrong shape (a union's errors would
    name pydantic's branches instead of the field)."""
    if isinstance(v, str) and v in TOOL_CHOICE_MODES:
        return v
    fn = v.get("function") if isinstance(v, dict) else None
    if (isinstance(v, dict) and set(v) == {"type", "function"} and v["type"] == "function"
            and isinstance(fn, dict) and set(fn) == {"name"} and isinstance(fn["name"], str)):
        return NamedToolChoice.model_validate(v)
    raise PydanticCustomError(
        "tool_choice", "expected 'none', 'auto', 'required' or {shape}, got {value}",
        {"shape": "{'type': 'function', 'function': {'name': ...}}", "value": _shown(v)},
    )


ToolChoice = Annotated[
    Any, BeforeValidator(_tool_choice),
    WithJsonSchema({"anyOf": [
        {"enum": list(TOOL_CHOICE_MODES)},
        {"type": "object", "required": ["type", "function"], "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"],
                         "properties": {"name": {"type": "string"}}}}},
    ]}),
]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="forbid")

    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    schema_: Annotated[JsonSchema | None, Field(alias="schema")] = None
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}``; the JSON kinds are enforced by constrained
    decoding."""

    model_config = ConfigDict(**_STRICT, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("missing", "json_schema is required when type is "
                                                 "'json_schema'")
        return self


def _unique_names(tools: list[Tool] | None) -> list[Tool] | None:
    seen: set[str] = set()
    for i, t in enumerate(tools or ()):
        if t.function.name in seen:
            raise PydanticCustomError("duplicate", "function {name!r} is declared twice "
                                      "(tools[{i}])", {"name": t.function.name, "i": i})
        seen.add(t.function.name)
    return tools


def _one_stop(v: Any) -> Any:
    return [v] if isinstance(v, str) else v


class ChatBody(SamplingFields):
    """The body of ``POST /v1/chat/completions``: OpenAI's chat request plus AKV's ``cache``
    (indices name messages) and the sampling extensions ``top_k``, ``stop_token_ids`` and
    ``ignore_eos``. OpenAI fields not named here are ignored."""

    model_config = ConfigDict(**_STRICT, extra="ignore")

    messages: Annotated[
        list[Message], _max_items("max_segments", "messages"), Field(min_length=1)
    ]
    model: str | None = None
    cache: CacheOps = None
    max_tokens: Annotated[Count, _at_most("max_new_tokens")] | None = None
    # The newer name for max_tokens; it wins if both are given.
    max_completion_tokens: Annotated[Count, _at_most("max_new_tokens")] | None = None
    stop: Annotated[
        list[Annotated[str, Field(min_length=1)]],
        BeforeValidator(_one_stop, json_schema_input_type=str | list[str] | None),
        _max_items("max_stop"),
    ] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    tools: Annotated[list[Tool], AfterValidator(_unique_names)] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None
    # GPT-OSS's harmony template reads it; other templates ignore it.
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # Extra variables for the chat template (as vLLM and SGLang take them), e.g.
    # {"enable_thinking": false} for Qwen3; they cannot replace the template's own inputs.
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_template_inputs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        for k in v or {}:
            if k in TEMPLATE_INPUTS:
                raise PydanticCustomError(
                    "reserved", "{key} is set by the server, not by chat_template_kwargs",
                    {"key": k},
                )
        return v
    # Options that change the output in ways the engine cannot do: refused unless default.
    n: Annotated[Int, _only(1)] | None = None
    top_logprobs: Annotated[_int(ge=0), _only(0)] | None = None
    presence_penalty: Annotated[Number, _only(0)] | None = None
    frequency_penalty: Annotated[Number, _only(0)] | None = None
    logit_bias: Annotated[dict[str, Any], _only({})] | None = None
    best_of: Annotated[Int, _only(1)] | None = None
    echo: Annotated[bool, _only(False)] | None = None
    suffix: Annotated[str, _only("")] | None = None
    response_format: ResponseFormat | None = None
