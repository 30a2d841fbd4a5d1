"""Client-side data: agent messages (token ids with a role) and the requests a policy sends.

A policy turns the agent's full message history into a :class:`Request` for ``POST /generate``:
one segment per message plus the ``cache`` field (DESIGN.md §2). Summarising baselines also
send ``kind="summary"`` requests whose output becomes the summary message.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
# Instructions a harness never compacts (Pi keeps system and developer messages).
INSTRUCTION_ROLES = ("system", "developer")


@dataclasses.dataclass(frozen=True)
class Message:
    role: str
    tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.tokens:
            raise ValueError("a message needs at least one token (segments are non-empty)")

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class Request:
    """One ``/generate`` call: segments, cache ops, output budget.

    ``kind`` is ``"turn"`` (an agent step) or ``"summary"`` (a compaction call of a summarising
    baseline). ``repos_tokens`` counts the active entries re-encoded by reposition ops that this
    request adds to the history (0 when it adds none); cost accounting charges them at the
    cache-hit rate on top of the usage fields (the paper's conservative choice).
    """

    segments: tuple[tuple[int, ...], ...]
    cache: dict[str, Any] | None
    max_new_tokens: int
    kind: str = "turn"
    repos_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s) for s in self.segments)

    def generate_body(self, *, stream: bool) -> dict[str, Any]:
        """The JSON body of ``POST /generate`` (greedy, fixed budget: the replay protocol)."""
        body: dict[str, Any] = {
            "input_ids": [list(s) for s in self.segments],
            "sampling_params": {
                "max_new_tokens": self.max_new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
            "return_logprob": False,
            "stream": stream,
        }
        if self.cache is not None:
            body["cache"] = self.cache
        return body


def synthetic_tokens(seed: int | str, n: int, vocab_size: int) -> tuple[int, ...]:
    """``n`` reproducible pseudo-random token ids in ``[0, vocab_size - 1)``.

    The last id is left out because the tiny model uses it as EOS; prompts never need it.
    """
    rng = random.Random(seed)
    return tuple(rng.randrange(vocab_size - 1) for _ in range(n))


def total_tokens(messages: Sequence[Message]) -> int:
    return sum(m.num_tokens for m in messages)
