"""Client-side context policies: AKV's rolling drop and the summarising baselines.

Every policy maps the agent's full message history to the request it sends next
(:meth:`Policy.next_request`) and is told what the server answered (:meth:`Policy.observe`).
A policy object holds the state of one trajectory.

* :class:`RollingDrop` (AKV's default, paper §5): keep the KV of the ``keep_tools`` most recent
  tool responses and of every other message; each turn, the tool responses that just became too
  old are dropped *at the current last boundary*. Earlier ops stay where they were, so the cache
  field of turn t+1 restricted to turn t's segments equals turn t's field: the op history grows
  only at its end and the server's op-aware prefix cache keeps hitting. When the position
  counter reaches ``repos_threshold`` (the Standard threshold, as in the paper) a reposition is
  added at the current last boundary, closing the gaps the drops left.
* :class:`Summarize` (Pi-style compaction): once the prompt reaches ``threshold`` tokens, the
  policy first sends a summarisation request (its own prompt + the serialised old messages) and
  then continues from ``[system/developer messages] + [summary] + [recent messages]``, keeping
  at least ``keep_recent_tokens`` of the most recent messages. The rewritten prefix differs
  from the last request, so the prefix cache misses after the system prompt.
  ``Standard`` and ``TextEngineering`` are the same policy at the paper's two thresholds.

Scaling (:class:`Scale`). The paper's numbers are for a 131,072-position model (GPT-OSS-120B):
Standard summarises at 96K, Text Engineering at 48K, Pi uses reserveTokens=16,384 and
keepRecentTokens=20,000. A smaller window multiplies every context-length setting by
``context / 131072``: the replay serves the tiny model with 32,768 positions
(:data:`REPLAY_SCALE`, 1/4: 24,576 / 12,288 / 4,096 / 5,000 tokens), the tiny model's own
4,096 positions give :data:`TINY_SCALE` (1/32). The number of kept tool responses (K=12) is a
count, not a length, and is not scaled; neither are tool responses (100-2,000 tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from akv_jax.agent.messages import INSTRUCTION_ROLES, Message, Request, synthetic_tokens
from akv_jax.cache.ops import OpHistory
from akv_jax.cache.timeline import Timeline, timeline

# The paper's settings, in tokens of the 131,072-position model they were chosen for.
PAPER_CONTEXT = 131_072
PAPER_STANDARD_THRESHOLD = 96 * 1024
PAPER_TEXT_ENGINEERING_THRESHOLD = 48 * 1024
PAPER_RESERVE_TOKENS = 16_384
PAPER_KEEP_RECENT_TOKENS = 20_000
# Assumed here, not given by the paper: the length of a recorded summary and of the
# summariser's prompt (Pi caps the summary at 0.8 x reserveTokens = 13,107 tokens; real
# summaries are much shorter).
PAPER_SUMMARY_TOKENS = 4_096
PAPER_SUMMARY_PROMPT_TOKENS = 1_024
DEFAULT_KEEP_TOOLS = 12


@dataclasses.dataclass(frozen=True)
class Scale:
    """Maps the paper's token counts onto a model with ``context`` positions."""

    context: int = 4096
    paper_context: int = PAPER_CONTEXT

    @property
    def factor(self) -> float:
        return self.context / self.paper_context

    def tokens(self, paper_tokens: int) -> int:
        return max(1, round(paper_tokens * self.factor))


TINY_SCALE = Scale(4096)  # --model-path tiny: factor 1/32
REPLAY_SCALE = Scale(32768)  # bench/replay.py: tiny with --context-length 32768, factor 1/4
PAPER_SCALE = Scale(PAPER_CONTEXT)  # factor 1: the paper's own numbers


class ContextOverflow(RuntimeError):
    """The policy cannot keep the request inside the model's position limit."""


class Policy(Protocol):
    name: str

    def next_request(self, history: Sequence[Message], max_new_tokens: int) -> Request:
        """The request to send for ``history`` (whose last message is the newest)."""
        ...

    def observe(self, request: Request, output_ids: Sequence[int]) -> None:
        """Record the server's answer to ``request`` (needed after a summary request)."""
        ...


class RollingDrop:
    """AKV's default policy: rolling drop of old tool responses plus repos at a threshold."""

    def __init__(
        self,
        keep_tools: int = DEFAULT_KEEP_TOOLS,
        repos_threshold: int = TINY_SCALE.tokens(PAPER_STANDARD_THRESHOLD),
        max_positions: int = TINY_SCALE.context,
        name: str = "akv",
    ):
        if keep_tools < 0:
            raise ValueError("keep_tools must be >= 0")
        self.name = name
        self.keep_tools = keep_tools
        self.repos_threshold = repos_threshold
        self.max_positions = max_positions
        self._drops: dict[int, tuple[int, ...]] = {}
        self._repos: list[int] = []
        self._dropped: set[int] = set()
        self._seen = 0

    @property
    def cache(self) -> dict[str, object]:
        """The op history so far, in the API grammar."""
        return {
            "drop": {str(b): list(s) for b, s in sorted(self._drops.items())},
            "reposition": list(self._repos),
        }

    def next_request(self, history: Sequence[Message], max_new_tokens: int) -> Request:
        n = len(history)
        if n < self._seen:
            raise ValueError(f"history shrank from {self._seen} to {n} messages")
        self._seen = n
        b = n - 1
        tools = [i for i, m in enumerate(history) if m.role == "tool"]
        old = tools[: max(0, len(tools) - self.keep_tools)]
        stale = tuple(i for i in old if i not in self._dropped)
        if stale:
            # Drops go to the current last boundary only; ops at earlier boundaries are never
            # rewritten (that would change the prefix of ops and miss the server's cache).
            self._drops[b] = tuple(sorted(self._drops.get(b, ()) + stale))
            self._dropped.update(stale)
        tl = self._timeline(history)
        active = int(tl.final_active.sum())
        repos_tokens = 0
        if tl.next_pos >= self.repos_threshold and active < tl.next_pos and b not in self._repos:
            self._repos.append(b)
            tl = self._timeline(history)
            repos_tokens = active  # the repos re-encodes every active entry
        peak, next_pos = tl.max_position + 1, tl.next_pos
        if peak > self.max_positions or next_pos + max_new_tokens > self.max_positions:
            raise ContextOverflow(
                f"{self.name}: context reaches position {max(peak, next_pos + max_new_tokens)}"
                f" (active {active}), past the limit of {self.max_positions}"
            )
        return Request(
            segments=tuple(m.tokens for m in history),
            cache=self.cache,
            max_new_tokens=max_new_tokens,
            repos_tokens=repos_tokens,
        )

    def observe(self, request: Request, output_ids: Sequence[int]) -> None:
        return None  # the next turn's history carries the output as an assistant message

    def _timeline(self, history: Sequence[Message]) -> Timeline:
        """Positions of ``history`` under the ops so far, as the server computes them
        (DESIGN.md §2; :mod:`akv_jax.cache.timeline` is its one statement)."""
        ops = OpHistory(len(history), dict(self._drops), tuple(sorted(self._repos)))
        return timeline([m.num_tokens for m in history], ops)


class Summarize:
    """Pi-style compaction at an exact prompt-token threshold (Standard / Text Engineering)."""

    def __init__(
        self,
        threshold: int,
        *,
        keep_recent_tokens: int = TINY_SCALE.tokens(PAPER_KEEP_RECENT_TOKENS),
        reserve_tokens: int = TINY_SCALE.tokens(PAPER_RESERVE_TOKENS),
        summary_tokens: int = TINY_SCALE.tokens(PAPER_SUMMARY_TOKENS),
        summary_prompt_tokens: int = TINY_SCALE.tokens(PAPER_SUMMARY_PROMPT_TOKENS),
        vocab_size: int = 512,
        name: str = "standard",
    ):
        if summary_tokens > int(0.8 * reserve_tokens):
            raise ValueError("Pi caps a summary at 0.8 x reserve_tokens")
        if keep_recent_tokens >= threshold:
            raise ValueError("keep_recent_tokens must be below the threshold")
        self.name = name
        self.threshold = threshold
        self.keep_recent_tokens = keep_recent_tokens
        self.reserve_tokens = reserve_tokens
        self.summary_tokens = summary_tokens
        # The summariser's own system prompt and closing instruction (fixed per harness, so
        # shared by every summary call), as two segments around the serialised conversation.
        half = max(1, summary_prompt_tokens // 2)
        self.summary_prompt = synthetic_tokens("pi-summary-system", half, vocab_size)
        self.summary_instruction = synthetic_tokens("pi-summary-instruction", half, vocab_size)
        self.compactions = 0
        self._cut = 0  # messages [head, _cut) are replaced by the summary
        self._summary: Message | None = None
        self._pending: int | None = None

    def context(self, history: Sequence[Message]) -> list[Message]:
        """What the agent currently sends: instructions, summary, recent messages."""
        head = _head(history)
        if self._summary is None:
            return list(history)
        return [*history[:head], self._summary, *history[max(self._cut, head):]]

    def next_request(self, history: Sequence[Message], max_new_tokens: int) -> Request:
        if self._pending is not None:
            raise RuntimeError("observe() the summary request before asking for the next one")
        ctx = self.context(history)
        if sum(m.num_tokens for m in ctx) >= self.threshold:
            cut = self._cut_point(history)
            if cut > max(self._cut, _head(history)):
                old = history[max(self._cut, _head(history)) : cut]
                parts = ([self._summary] if self._summary is not None else []) + list(old)
                transcript = tuple(t for m in parts for t in m.tokens)
                self._pending = cut
                return Request(
                    segments=(self.summary_prompt, transcript, self.summary_instruction),
                    cache=None,
                    max_new_tokens=self.summary_tokens,
                    kind="summary",
                )
        return Request(
            segments=tuple(m.tokens for m in ctx), cache=None, max_new_tokens=max_new_tokens
        )

    def observe(self, request: Request, output_ids: Sequence[int]) -> None:
        if request.kind != "summary":
            return
        if self._pending is None:
            raise RuntimeError("a summary answer arrived without a pending summary request")
        if not output_ids:
            raise ValueError("empty summary (Pi rejects those)")
        self._summary = Message("user", tuple(int(t) for t in output_ids))
        self._cut = self._pending
        self._pending = None
        self.compactions += 1

    def _cut_point(self, history: Sequence[Message]) -> int:
        """First kept message: the newest messages worth >= keep_recent_tokens, moved back so a
        tool result never starts the kept part (it stays with the call that produced it)."""
        head = _head(history)
        cut, kept = len(history), 0
        while cut > head and kept < self.keep_recent_tokens:
            cut -= 1
            kept += history[cut].num_tokens
        while cut > head and history[cut].role == "tool":
            cut -= 1
        return cut


def _head(history: Sequence[Message]) -> int:
    """Number of leading system/developer messages (never compacted)."""
    n = 0
    while n < len(history) and history[n].role in INSTRUCTION_ROLES:
        n += 1
    return n


def rolling_drop(scale: Scale = TINY_SCALE, keep_tools: int = DEFAULT_KEEP_TOOLS) -> RollingDrop:
    """AKV's default policy at ``scale`` (repos at the Standard threshold)."""
    return RollingDrop(
        keep_tools=keep_tools,
        repos_threshold=scale.tokens(PAPER_STANDARD_THRESHOLD),
        max_positions=scale.context,
    )


def _summarize(name: str, paper_threshold: int, scale: Scale, vocab_size: int) -> Summarize:
    return Summarize(
        scale.tokens(paper_threshold),
        keep_recent_tokens=scale.tokens(PAPER_KEEP_RECENT_TOKENS),
        reserve_tokens=scale.tokens(PAPER_RESERVE_TOKENS),
        summary_tokens=scale.tokens(PAPER_SUMMARY_TOKENS),
        summary_prompt_tokens=scale.tokens(PAPER_SUMMARY_PROMPT_TOKENS),
        vocab_size=vocab_size,
        name=name,
    )


def standard(scale: Scale = TINY_SCALE, vocab_size: int = 512) -> Summarize:
    """The Standard baseline: summarise at 96K (scaled)."""
    return _summarize("standard", PAPER_STANDARD_THRESHOLD, scale, vocab_size)


def text_engineering(scale: Scale = TINY_SCALE, vocab_size: int = 512) -> Summarize:
    """Text Engineering: the same compaction at 48K (scaled)."""
    return _summarize("text_engineering", PAPER_TEXT_ENGINEERING_THRESHOLD, scale, vocab_size)


POLICIES = {"akv": rolling_drop, "standard": standard, "text_engineering": text_engineering}


def make_policy(name: str, scale: Scale = TINY_SCALE) -> Policy:
    """A fresh policy (one per trajectory) by name: akv, standard, text_engineering."""
    try:
        return POLICIES[name](scale)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None
