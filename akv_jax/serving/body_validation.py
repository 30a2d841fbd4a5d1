"""Running a request body's pydantic model, and its errors in the API's notation.

:func:`validated` runs a model and turns the first pydantic error into :class:`InvalidField`,
its ``loc`` written by :func:`field_path` in the bracket notation of the whole API
(``messages[3].content``, ``sampling_params.top_p``, ``cache.drop["5"][1]``). :func:`shown`
abbreviates a value at fault for a message (the models' own validators use it too).
"""

from __future__ import annotations

import json
import reprlib
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core.core_schema import ErrorType

from akv_jax.errors import InvalidField

__all__ = ["field_path", "shown", "validated"]


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


def shown(v: Any) -> str:
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
        return f"{msg}, got {shown(err['input'])}"
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

