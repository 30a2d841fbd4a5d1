"""What crosses the engine's boundary: a request, its sampling parameters, the events it
streams back, and the one-line form of an error that a client is shown."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from akv_jax.cache.ops import OpHistory


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


class TokenConstraint(Protocol):
    """A grammar over one request's output (:mod:`akv_jax.formats.constraint`): the engine
    masks the logits row with it where it samples and advances it with each token."""

    def allowed(self) -> np.ndarray: ...  # bool [vocab]: the ids the grammar allows next

    def advance(self, token_id: int) -> None: ...

    @property
    def finished(self) -> bool: ...


@dataclasses.dataclass
class GenerateRequest:
    rid: str
    segments: list[list[int]] | list[np.ndarray]
    history: OpHistory
    sampling: SamplingParams = SamplingParams()
    return_logprob: bool = False
    constraint: TokenConstraint | None = None
    # (timeline, radix keys), made by Engine.prepare off the engine's thread; None: the
    # engine makes them when the request is added.
    prepared: tuple | None = None


@dataclasses.dataclass
class TokenEvent:
    rid: str
    token_id: int
    logprob: float | None
    finished: bool
    finish_reason: str | None
    meta: dict
    # Set, with finish_reason "error", on the last event of a request that failed inside the
    # engine (its pages are already released); AsyncEngine raises it to the API layer.
    error: str | None = None


def describe_error(e: BaseException) -> str:
    """One line for a client: the exception's type and message, no traceback."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
