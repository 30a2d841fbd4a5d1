"""The body of ``POST /v1/chat/completions`` as a pydantic model: messages, the agent fields
(``tools``, ``tool_choice``, ``response_format``), the sampling extensions, AKV's ``cache``.

The shared field types are :mod:`.body_fields`'s; OpenAI options the engine cannot honour
are accepted only at their default value.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from akv_jax.serving.body_fields import (
    STRICT,
    CacheOps,
    Count,
    Int,
    Number,
    SamplingFields,
    at_most,
    int_field,
    max_items,
    only_default,
)
from akv_jax.serving.body_validation import shown

__all__ = [
    "FUNCTION_NAME",
    "ChatBody",
    "Message",
    "ResponseFormat",
    "Tool",
]

# What the server itself passes to a chat template (chat_template_kwargs may not set them).
TEMPLATE_INPUTS = frozenset({"messages", "add_generation_prompt", "tools", "bos_token",
                             "eos_token", "raise_exception"})


# --------------------------------------------------------------------------- chat


class TextPart(BaseModel):
    """An OpenAI content part; a text-only chat template renders only text."""

    model_config = ConfigDict(**STRICT, extra="allow")

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
            {"kind": shown(v)},
        )
    return v


class CalledFunction(BaseModel):
    model_config = ConfigDict(**STRICT, extra="forbid")

    name: str
    # OpenAI sends a JSON string; kept exactly as sent (a reply's record is keyed on it).
    arguments: str | dict[str, Any]


class ToolCallIn(BaseModel):
    """A call of an assistant message sent back as history."""

    model_config = ConfigDict(**STRICT, extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    """A chat message; keys not named here are passed to the chat template as they are."""

    model_config = ConfigDict(**STRICT, extra="allow")

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
    model_config = STRICT

    include_usage: bool | None = None


# --------------------------------------------------------------------------- agents

# OpenAI's rule for function names (the Agents SDK and the official client follow it).
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


def _json_schema_object(v: Any) -> Any:
    if not isinstance(v, dict):
        raise PydanticCustomError("schema_type", "a JSON schema must be an object, got {kind}",
                                  {"kind": shown(v)})
    return v


JsonSchema = Annotated[dict[str, Any], BeforeValidator(_json_schema_object)]


class FunctionDef(BaseModel):
    model_config = ConfigDict(**STRICT, extra="forbid")

    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: JsonSchema | None = None  # None: any arguments object
    strict: bool | None = None


class Tool(BaseModel):
    """A Chat Completions tool: only functions are served."""

    model_config = ConfigDict(**STRICT, extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(**STRICT, extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(**STRICT, extra="forbid")

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
        {"shape": "{'type': 'function', 'function': {'name': ...}}", "value": shown(v)},
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
    model_config = ConfigDict(**STRICT, extra="forbid")

    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    schema_: Annotated[JsonSchema | None, Field(alias="schema")] = None
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}``; the JSON kinds are enforced by constrained
    decoding."""

    model_config = ConfigDict(**STRICT, extra="forbid")

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

    model_config = ConfigDict(**STRICT, extra="ignore")

    messages: Annotated[
        list[Message], max_items("max_segments", "messages"), Field(min_length=1)
    ]
    model: str | None = None
    cache: CacheOps = None
    max_tokens: Annotated[Count, at_most("max_new_tokens")] | None = None
    # The newer name for max_tokens; it wins if both are given.
    max_completion_tokens: Annotated[Count, at_most("max_new_tokens")] | None = None
    stop: Annotated[
        list[Annotated[str, Field(min_length=1)]],
        BeforeValidator(_one_stop, json_schema_input_type=str | list[str] | None),
        max_items("max_stop"),
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
    n: Annotated[Int, only_default(1)] | None = None
    top_logprobs: Annotated[int_field(ge=0), only_default(0)] | None = None
    presence_penalty: Annotated[Number, only_default(0)] | None = None
    frequency_penalty: Annotated[Number, only_default(0)] | None = None
    logit_bias: Annotated[dict[str, Any], only_default({})] | None = None
    best_of: Annotated[Int, only_default(1)] | None = None
    echo: Annotated[bool, only_default(False)] | None = None
    suffix: Annotated[str, only_default("")] | None = None
    response_format: ResponseFormat | None = None
