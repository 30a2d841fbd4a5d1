"""The body of ``POST /v1/responses`` as a pydantic model: OpenAI's Responses request
(input items, function tools, ``tool_choice``, ``text.format``, ``reasoning``) plus AKV's
``cache`` and chat's sampling extensions.

The server keeps no state: ``store`` must be false or absent, and ``previous_response_id``,
``conversation``, ``background`` and encrypted reasoning (we hold no keys) are refused. A
client sends the whole conversation as ``input`` each time, as with chat. The body becomes a
chat request in :mod:`.responses_to_chat`; the reply becomes a Response in
:mod:`.responses_output`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    WrapValidator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from akv_jax.serving.body_fields import CacheOps, Count, SamplingFields
from akv_jax.serving.chat_body import FUNCTION_NAME

__all__ = [
    "FormatJsonObject",
    "FormatJsonSchema",
    "FormatText",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "InputItem",
    "MessageItem",
    "ReasoningItem",
    "ResponsesBody",
    "ToolChoiceFunction",
    "joined_text",
]

STATELESS = "this server keeps no state"

# --------------------------------------------------------------------------- validation helpers

_ITEM = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


def _error_at(loc: tuple[str | int, ...], value: Any, message: str) -> ValidationError:
    """An error at ``loc`` below the field being validated (raised from a wrap validator,
    pydantic prefixes the field's own location)."""
    err = PydanticCustomError("unsupported", message)
    return ValidationError.from_exception_data(
        "responses", [InitErrorDetails(type=err, loc=loc, input=value)]
    )


def _by_type(pick: Callable[[Any], TypeAdapter[Any]]) -> WrapValidator:
    """Validate with the model ``pick`` chooses (by the value's ``type``). Unlike a tagged
    union, errors keep the model's own paths: ``input[3].call_id``, no tag in between."""

    def run(v: Any, handler: Any, info: ValidationInfo) -> Any:
        return pick(v).validate_python(v, context=info.context)

    return WrapValidator(run)


def _type_of(v: Any, default: str | None = None) -> Any:
    return v.get("type", default) if isinstance(v, dict) else None


def _only_types(*kinds: str, what: str):
    """A before-validator for a ``type`` field: anything but ``kinds`` is refused plainly."""

    def check(v: Any) -> Any:
        if v not in kinds:
            raise PydanticCustomError(
                "unsupported", "only {kinds} {what} supported, got {got}",
                {"kinds": " and ".join(kinds), "what": what, "got": json.dumps(v, default=repr)},
            )
        return v

    return check


def _refuse_state(name: str, hint: str):
    """An after-validator for a field that would need server-side state."""

    def check(v: Any) -> Any:
        if v is not None and v is not False:
            raise PydanticCustomError(
                "stateless", "{name} is not supported: {why}; {hint}",
                {"name": name, "why": STATELESS, "hint": hint},
            )
        return v

    return AfterValidator(check)


def _within_max_new_tokens(v: int, info: ValidationInfo) -> int:
    limits = (info.context or {}).get("limits")
    if limits is not None and v > limits.max_new_tokens:
        raise PydanticCustomError("limit", "{value} exceeds the limit {limit}",
                                  {"value": v, "limit": limits.max_new_tokens})
    return v


def _as_text_parts(v: Any) -> Any:
    """A string is one text part."""
    return [{"type": "input_text", "text": v}] if isinstance(v, str) else v


# --------------------------------------------------------------------------- input items


class TextPart(BaseModel):
    model_config = _ITEM

    type: Annotated[
        Literal["input_text", "output_text"],
        BeforeValidator(_only_types("input_text", "output_text", what="content parts are")),
    ]
    text: str


TextParts = Annotated[
    list[TextPart], BeforeValidator(_as_text_parts, json_schema_input_type=str | list[TextPart])
]


def joined_text(parts: Sequence[TextPart]) -> str:
    """The text of one item's parts, joined with ""."""
    return "".join(p.text for p in parts)


class MessageItem(BaseModel):
    """A message; ``type`` may be left out (the short form ``{"role", "content"}``)."""

    model_config = _ITEM

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: TextParts


class FunctionCallItem(BaseModel):
    model_config = _ITEM

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = _ITEM

    type: Literal["function_call_output"]
    call_id: str
    output: TextParts


class SummaryPart(BaseModel):
    model_config = _ITEM

    type: Annotated[Literal["summary_text"],
                    BeforeValidator(_only_types("summary_text", what="summary parts are"))]
    text: str


class ReasoningTextPart(BaseModel):
    model_config = _ITEM

    type: Annotated[Literal["reasoning_text"],
                    BeforeValidator(_only_types("reasoning_text", what="content parts are"))]
    text: str


def _no_encrypted(v: str | None) -> str | None:
    if v is not None:
        raise PydanticCustomError(
            "unsupported", "encrypted reasoning is not supported: this server keeps no keys; "
            "send the reasoning as content parts of type reasoning_text"
        )
    return v


class ReasoningItem(BaseModel):
    model_config = _ITEM

    type: Literal["reasoning"]
    summary: list[SummaryPart] = []
    content: list[ReasoningTextPart] | None = None
    encrypted_content: Annotated[str | None, AfterValidator(_no_encrypted)] = None

    def text(self) -> str:
        # The full reasoning when the client has it; the summary stands in otherwise.
        return joined_text(self.content) if self.content else "".join(p.text for p in self.summary)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEMS: dict[str, TypeAdapter[Any]] = {
    "message": TypeAdapter(MessageItem),
    "function_call": TypeAdapter(FunctionCallItem),
    "function_call_output": TypeAdapter(FunctionCallOutputItem),
    "reasoning": TypeAdapter(ReasoningItem),
}


def _pick_item(v: Any) -> TypeAdapter[Any]:
    if not isinstance(v, dict):
        return _ITEMS["message"]  # which says "Input should be an object"
    kind = _type_of(v, "message")
    if kind == "item_reference":
        raise _error_at(("type",), kind, f"item references are not supported: {STATELESS}; "
                                         "send the item itself")
    if kind not in _ITEMS:
        raise _error_at(("type",), kind, f"unsupported input item type {json.dumps(kind)} "
                                         f"(supported: {', '.join(_ITEMS)})")
    return _ITEMS[kind]


def _as_items(v: Any) -> Any:
    """A string is one user message; anything but a string or a list is refused here."""
    if isinstance(v, str):
        return [{"type": "message", "role": "user", "content": v}]
    if not isinstance(v, list):
        raise PydanticCustomError("input_type", "expected a string or a list of input items")
    return v


# --------------------------------------------------------------------------- request options


class FunctionTool(BaseModel):
    """A function tool in the Responses shape (flat, not nested under ``function``)."""

    model_config = _ITEM

    type: Annotated[Literal["function"],
                    BeforeValidator(_only_types("function", what="tools are"))]
    # Chat's rule too: checked here, so the error names this request's field.
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat(self) -> dict[str, Any]:
        fn = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": fn}


class ToolChoiceFunction(BaseModel):
    model_config = _ITEM

    type: Literal["function"]
    name: str


ToolMode = Literal["none", "auto", "required"]
_TOOL_MODE: TypeAdapter[Any] = TypeAdapter(ToolMode)
_TOOL_FUNCTION: TypeAdapter[Any] = TypeAdapter(ToolChoiceFunction)


def _pick_tool_choice(v: Any) -> TypeAdapter[Any]:
    if not isinstance(v, dict):
        return _TOOL_MODE
    if v.get("type") != "function":
        raise _error_at(("type",), v.get("type"), "only 'none', 'auto', 'required' or "
                                                  "{'type': 'function', 'name': ...} are supported")
    return _TOOL_FUNCTION


class FormatText(BaseModel):
    model_config = _ITEM

    type: Literal["text"]


class FormatJsonObject(BaseModel):
    model_config = _ITEM

    type: Literal["json_object"]


class FormatJsonSchema(BaseModel):
    model_config = _ITEM

    type: Literal["json_schema"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


TextFormat = FormatText | FormatJsonObject | FormatJsonSchema
_FORMATS: dict[str, TypeAdapter[Any]] = {
    "text": TypeAdapter(FormatText),
    "json_object": TypeAdapter(FormatJsonObject),
    "json_schema": TypeAdapter(FormatJsonSchema),
}


def _pick_format(v: Any) -> TypeAdapter[Any]:
    if not isinstance(v, dict):
        return _FORMATS["text"]
    if _type_of(v) not in _FORMATS:
        raise _error_at(("type",), _type_of(v), f"expected one of {', '.join(_FORMATS)}")
    return _FORMATS[v["type"]]


class TextConfig(BaseModel):
    model_config = _ITEM

    format: Annotated[TextFormat, _by_type(_pick_format)] | None = None


class ReasoningConfig(BaseModel):
    model_config = _ITEM

    effort: Literal["low", "medium", "high"] | None = None


def _unique_names(tools: list[FunctionTool]) -> list[FunctionTool]:
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.name in seen:
            raise PydanticCustomError("duplicate", "function {name!r} is declared twice "
                                      "(tools[{i}])", {"name": t.name, "i": i})
        seen.add(t.name)
    return tools


def _only_disabled(v: str) -> str:
    if v != "disabled":
        raise PydanticCustomError("unsupported", 'not supported (only truncation="disabled" is)')
    return v


class ResponsesBody(SamplingFields):
    """The body of ``POST /v1/responses``: OpenAI's request plus AKV's ``cache`` (indices name
    input items) and chat's sampling extensions (``top_k``, ``seed``, ``stop_token_ids``,
    ``ignore_eos``). OpenAI fields not named here are ignored."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    model: str | None = None
    input: Annotated[
        list[Annotated[InputItem, _by_type(_pick_item)]],
        BeforeValidator(_as_items, json_schema_input_type=str | list[InputItem]),
        Field(min_length=1),
    ]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], AfterValidator(_unique_names)] | None = None
    tool_choice: Annotated[ToolMode | ToolChoiceFunction, _by_type(_pick_tool_choice)] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[Count, AfterValidator(_within_max_new_tokens)] | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = None
    store: Annotated[bool, _refuse_state("store", "send store=false")] | None = None
    previous_response_id: Annotated[
        Any, _refuse_state("previous_response_id", "send the whole conversation as input")
    ] = None
    conversation: Annotated[
        Any, _refuse_state("conversation", "send the whole conversation as input")
    ] = None
    background: Annotated[bool, _refuse_state("background", "send background=false")] | None = None
    cache: CacheOps = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None  # nothing extra to include (no encrypted reasoning)
    truncation: Annotated[str, AfterValidator(_only_disabled)] | None = None

