"""OpenAI's Responses API (``POST /v1/responses``) translated to and from chat completions.

Pure translation, no engine and no route: :class:`ResponsesBody` is the request, :func:`to_chat`
turns it into a Chat Completions body (the level the engine speaks), and
:func:`response_object` / :class:`ResponseEvents` turn the chat-level reply back into a
Response object or its server-sent events.

The server keeps no state: ``store`` must be false or absent, and ``previous_response_id``,
``conversation``, ``background`` and encrypted reasoning (we hold no keys) are refused. A
client sends the whole conversation as ``input`` each time, as with chat.

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

Output: one ``reasoning`` item (``reasoning_text`` content, empty ``summary``) if the model
reasoned, one assistant ``message`` item if it wrote content, one ``function_call`` item per
call, in the order generated. A length cut is status ``incomplete`` with reason
``max_output_tokens`` (its last item ``incomplete`` too).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
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

from akv_jax.cache.ops import parse_history
from akv_jax.errors import InvalidField
from akv_jax.serving.schemas import FUNCTION_NAME, CacheOps, Count, SamplingFields

__all__ = [
    "ChatTranslation",
    "ResponseEvents",
    "ResponsesBody",
    "ToolCall",
    "Usage",
    "response_object",
    "to_chat",
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


def _joined(parts: Sequence[TextPart]) -> str:
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
        return _joined(self.content) if self.content else "".join(p.text for p in self.summary)


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


def _assistant_side(item: InputItem) -> bool:
    return isinstance(item, (ReasoningItem, FunctionCallItem)) or (
        isinstance(item, MessageItem) and item.role == "assistant"
    )


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


# --------------------------------------------------------------------------- request -> chat


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
                             "name": names[item.call_id], "content": _joined(item.output)})
        else:
            assert isinstance(item, MessageItem)
            messages.append({"role": item.role, "content": _joined(item.content)})
    return messages, item_to_message


def _assistant_message(run: list[InputItem]) -> dict[str, Any]:
    reasoning = [it.text() for it in run if isinstance(it, ReasoningItem)]
    texts = [_joined(it.content) for it in run if isinstance(it, MessageItem)]
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


# --------------------------------------------------------------------------- chat -> response

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
