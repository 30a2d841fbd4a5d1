"""The field types the request bodies share, and the sampling fields of /generate and chat.

The bodies are pydantic models (:mod:`.generate_body`, :mod:`.chat_body`,
:mod:`.responses_body`) that state the shape of each body (types, required fields,
unknown-key policy, fixed ranges); they also give the OpenAPI document at ``/openapi.json``.
Limits that depend on the server (``Limits``, the vocabulary size) come in as the validation
context. What no schema can say stays by hand in one place each: the op-history rules
(``cache``: :func:`akv_jax.cache.ops.parse_history`), the segment and vocabulary rules
(``input_ids``: :func:`akv_jax.cache.ops.validate_segments`) and the valid sampling ranges
(:func:`akv_jax.serving.sampler.invalid_param`); those two fields are ``Any`` here, with a
hand-written JSON schema for the documentation.

Numbers are strict, as JSON is: a boolean is never a number, a string never an integer;
an integral float (``3.0``) is an integer, since JSON has one number type. NaN and Infinity
never get here (the body parser refuses them), and float fields refuse them anyway.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
)
from pydantic_core import PydanticCustomError

from akv_jax.cache.ops import token_outside_vocab

__all__ = [
    "STRICT",
    "CacheOps",
    "Count",
    "InputIds",
    "Int",
    "Number",
    "SamplingFields",
    "TokenId",
    "at_most",
    "int_field",
    "max_items",
    "only_default",
]

INT64_MAX = 2**63 - 1


def _integral(v: Any) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _limit(info: ValidationInfo, name: str) -> int | None:
    limits = (info.context or {}).get("limits")
    return None if limits is None else getattr(limits, name)


def at_most(name: str) -> AfterValidator:
    """At most ``Limits.<name>`` (a server setting, so not part of the static schema)."""

    def check(v: int, info: ValidationInfo) -> int:
        hi = _limit(info, name)
        if hi is not None and v > hi:
            raise PydanticCustomError("limit", "{value} exceeds the limit {limit}",
                                      {"value": v, "limit": hi})
        return v

    return AfterValidator(check)


def max_items(name: str, what: str = "entries") -> BeforeValidator:
    """At most ``Limits.<name>`` items, checked before the items are (a huge list is refused
    cheaply)."""

    def check(v: Any, info: ValidationInfo) -> Any:
        hi = _limit(info, name)
        if hi is not None and isinstance(v, list) and len(v) > hi:
            raise PydanticCustomError("limit", "{n} {what} exceed the limit of {limit}",
                                      {"n": len(v), "what": what, "limit": hi})
        return v

    return BeforeValidator(check)


def only_default(default: Any) -> AfterValidator:
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


def int_field(**bounds: int) -> Any:
    """An integer within ``bounds`` (the bounds go first, so the JSON schema shows them)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


Int = int_field()
Count = int_field(ge=1)  # max_new_tokens, max_tokens
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

STRICT = ConfigDict(strict=True, allow_inf_nan=False)

# --------------------------------------------------------------------------- sampling


class SamplingFields(BaseModel):
    """Sampling fields shared by ``sampling_params`` (/generate) and the chat body.
    ``None`` (or absent) is the engine's default. Valid ranges are ``invalid_param``'s, checked
    when the fields become the engine's ``SamplingParams`` (``protocol.sampling``)."""

    model_config = STRICT

    temperature: Annotated[Number, Field(le=100.0)] | None = None  # 0 is greedy
    top_p: Number | None = None
    top_k: int_field(ge=-1) | None = None  # -1 (vLLM/SGLang's spelling) and 0: off
    seed: int_field(ge=-INT64_MAX - 1, le=INT64_MAX) | None = None
    stop_token_ids: Annotated[list[TokenId], max_items("max_stop")] | None = None
    ignore_eos: bool | None = None

