"""Next-token sampling on the host: temperature, top-k and top-p over one logits row.

Pure numpy functions of the logits row, the request's sampling parameters and (for
temperature > 0) the request's own ``numpy.random.Generator``: the token a request draws
depends on nothing else, so a seeded request gives the same tokens whatever runs beside it.

The distribution a request samples from (:func:`sampling_probs`), in float64:

1. ``temperature == 0``: greedy, the first index of the largest logit (no random draw).
2. ``z = (logits - max) / temperature``. Subtracting the maximum first keeps a tiny
   temperature from overflowing (the best token is exactly 0, the rest finite or ``-inf``,
   never ``inf - inf``).
3. top-k (``top_k > 0``): keep every token whose logit is at least the k-th largest, so
   **ties at the k-th value are all kept** (more than k tokens can survive). This is vLLM's
   rule (``logits < kth`` is masked); SGLang's torch fallback instead keeps exactly k by sort
   position, which makes the set depend on how the sort orders equal values. Keeping ties
   makes the set a function of the values alone. ``top_k >= vocab`` keeps everything.
4. ``p = softmax(z)`` over the kept tokens (renormalised after top-k, as in vLLM and
   Hugging Face; SGLang's torch fallback cumulates top-p over the un-renormalised softmax).
5. top-p (``top_p < 1``): in order of decreasing ``p``, the smallest prefix whose cumulative
   probability reaches ``top_p``: token ``i`` is kept iff the mass of the tokens before it is
   ``< top_p``. The first token is always kept (so a tiny or zero ``top_p`` is greedy on the
   tempered distribution), and, as for top-k, tokens tied with the last kept one are kept too.
   At exact equality (the prefix sums to exactly ``top_p``) the next token is not kept, as in
   vLLM and Hugging Face (SGLang's ``probs_sum - probs_sort > top_p`` would keep it).
6. Renormalise; the draw is ``rng.choice(V, p=probs)`` (inverse CDF of one uniform).

The returned log-prob is the token's log-probability under the **model's** distribution:
``log_softmax(logits)`` of the raw row, before temperature, top-k and top-p, so a sampled
token's log-prob equals what a greedy or teacher-forced run reports for it. This is vLLM's
default (``logprobs_mode="raw_logprobs"``); SGLang by default reports the log-prob after
temperature (and its top-p renormalisation) unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is
set; OpenAI does not document which it reports.

Rows with NaN or ``+inf``, or with no finite logit, raise ``ValueError``: a broken forward is
an error of that request, not a token.
"""

from __future__ import annotations

import math
import numbers
from typing import Protocol

import numpy as np

__all__ = [
    "SamplingLike",
    "invalid_param",
    "log_softmax",
    "make_rng",
    "sample",
    "sampling_probs",
]


class SamplingLike(Protocol):
    """The fields of the engine's ``SamplingParams`` (or the API's ``Sampling``) used here."""

    @property
    def temperature(self) -> float: ...

    @property
    def top_p(self) -> float: ...

    @property
    def top_k(self) -> int: ...


def make_rng(seed: int | None) -> np.random.Generator:
    """A request's generator: seeded, or fresh OS entropy when ``seed`` is None.

    Any integer is a seed: negative ones (the API accepts the int64 range, like vLLM) are
    taken modulo 2**64, which is one-to-one on int64 and leaves seeds >= 0 unchanged
    (``numpy.random.default_rng`` itself refuses negative seeds).
    """
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng(int(seed) % 2**64)


def invalid_param(params: SamplingLike) -> tuple[str, str] | None:
    """The first out-of-range sampling field as ``(name, reason)``, or None if all are valid.

    temperature: finite and >= 0 (0 is greedy); top_p: in (0, 1]; top_k: an integer >= 0
    (0 is off; the API maps -1 to 0).
    """
    t = params.temperature
    if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
        return "temperature", f"{t!r} is not a finite number >= 0"
    p = params.top_p
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 < p <= 1.0:
        return "top_p", f"{p!r} is outside (0, 1]"
    k = params.top_k
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
        return "top_k", f"{k!r} is not an integer >= 0"
    return None


def _checked_row(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"expected one non-empty logits row, got shape {x.shape}")
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError("logits row contains NaN or +inf")
    if not np.isfinite(x).any():
        raise ValueError("logits row has no finite value")
    return x


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``log_softmax`` of one logits row in float64 (``-inf`` logits stay ``-inf``)."""
    x = _checked_row(logits)
    m = x.max()
    return x - (m + np.log(np.sum(np.exp(x - m))))


def sampling_probs(logits: np.ndarray, params: SamplingLike) -> np.ndarray:
    """The float64 probability vector :func:`sample` draws from (zero outside the kept set).

    ``temperature == 0`` gives the one-hot vector of the greedy token. See the module
    docstring for the order of the steps and the tie rules.
    """
    bad = invalid_param(params)
    if bad is not None:
        raise ValueError(f"{bad[0]}: {bad[1]}")
    x = _checked_row(logits)
    V = x.size
    if params.temperature == 0:
        probs = np.zeros(V)
        probs[int(np.argmax(x))] = 1.0
        return probs
    with np.errstate(over="ignore"):  # a tiny temperature: -large / tiny is -inf, as meant
        z = (x - x.max()) / params.temperature
    k = int(params.top_k)
    if 0 < k < V:
        kth = np.partition(z, V - k)[V - k]  # the k-th largest value
        z = np.where(z >= kth, z, -np.inf)
    e = np.exp(z)  # max(z) == 0, so 1 <= sum(e) <= V
    probs = e / e.sum()
    if params.top_p < 1.0:
        ps = np.sort(probs)[::-1]
        # The mass of the tokens ahead of each in sorted order: an exclusive (sequential)
        # cumulative sum, non-decreasing, so the kept tokens are a prefix of length n.
        before = np.concatenate(([0.0], np.cumsum(ps)[:-1]))
        n = max(1, int(np.count_nonzero(before < params.top_p)))
        probs = np.where(probs >= ps[n - 1], probs, 0.0)
        probs = probs / probs.sum()
    return probs


def sample(
    logits: np.ndarray, params: SamplingLike, rng: np.random.Generator
) -> tuple[int, float]:
    """Draw the next token from ``logits`` (one row, any float dtype).

    Returns ``(token, logprob)``: the token drawn from :func:`sampling_probs` with ``rng``
    (greedy draws nothing), and its log-probability under the model's own distribution
    (``log_softmax(logits)[token]``, before temperature, top-k and top-p).
    """
    probs = sampling_probs(logits, params)
    if params.temperature == 0:
        tok = int(np.argmax(probs))
    else:
        tok = int(rng.choice(probs.size, p=probs))
    return tok, float(log_softmax(logits)[tok])
