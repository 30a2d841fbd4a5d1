"""Estimated API cost with the paper's fixed rates (Table 6; USD per 1M tokens).

A request is charged from the server's usage fields:

    cost = miss x (prompt_tokens - cached_tokens) + hit x cached_tokens
         + output x completion_tokens + hit x repos_tokens

``prompt_tokens`` are the logical input tokens (dropped messages included: the client still
sends them), ``cached_tokens`` those the server reused. ``repos_tokens`` are the active entries
re-encoded by reposition ops the request newly adds; the paper charges them at the cache-hit
rate (conservative: a repos only rotates keys that are already cached). Summarisation calls of
the baselines are requests like any other and are charged the same way.

These are the paper's accounting rates, not current prices, and no server bills them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

PER_TOKENS = 1_000_000


@dataclasses.dataclass(frozen=True)
class Rates:
    """USD per 1M tokens."""

    miss: float
    hit: float
    output: float


RATES: dict[str, Rates] = {
    "MiniMax-M2.7": Rates(miss=0.300, hit=0.060, output=1.200),
    "GPT-OSS-120B": Rates(miss=0.150, hit=0.075, output=0.600),
    "MiroThinker-1.7-Mini": Rates(miss=0.200, hit=0.040, output=2.400),
    "GPT-OSS-20B": Rates(miss=0.075, hit=0.0375, output=0.300),
}


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    repos_tokens: int = 0

    def __post_init__(self) -> None:
        if min(self.prompt_tokens, self.cached_tokens, self.completion_tokens,
               self.repos_tokens) < 0:
            raise ValueError(f"negative token count in {self}")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(f"cached_tokens {self.cached_tokens} > prompt_tokens "
                             f"{self.prompt_tokens}")

    @property
    def miss_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.cached_tokens + other.cached_tokens,
            self.completion_tokens + other.completion_tokens,
            self.repos_tokens + other.repos_tokens,
        )

    @staticmethod
    def from_meta(meta: dict, repos_tokens: int = 0) -> Usage:
        """From ``/generate``'s ``meta_info`` (or an OpenAI ``usage`` object)."""
        if "prompt_tokens_details" in meta:  # OpenAI usage
            cached = (meta.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        else:
            cached = meta.get("cached_tokens", 0)
        return Usage(int(meta["prompt_tokens"]), int(cached or 0),
                     int(meta["completion_tokens"]), repos_tokens)


def rates_for(model: str) -> Rates:
    try:
        return RATES[model]
    except KeyError:
        raise ValueError(f"no rates for {model!r}; known: {sorted(RATES)}") from None


def cost_breakdown(usage: Usage, rates: Rates) -> dict[str, float]:
    """USD per component: cache miss, cache hit (incl. repos), output, and the total."""
    miss = usage.miss_tokens * rates.miss / PER_TOKENS
    hit = (usage.cached_tokens + usage.repos_tokens) * rates.hit / PER_TOKENS
    out = usage.completion_tokens * rates.output / PER_TOKENS
    return {"miss": miss, "hit": hit, "output": out, "total": miss + hit + out}


def cost_usd(usage: Usage, rates: Rates | str) -> float:
    if isinstance(rates, str):
        rates = rates_for(rates)
    return cost_breakdown(usage, rates)["total"]


def total_usage(usages: Iterable[Usage]) -> Usage:
    out = Usage(0, 0, 0)
    for u in usages:
        out = out + u
    return out


def costs_by_model(usage: Usage) -> dict[str, float]:
    """USD of ``usage`` under every model's rates."""
    return {name: cost_usd(usage, r) for name, r in RATES.items()}
