"""Offline cost estimate: a trajectory's requests against an ideal prefix cache (no server).

The recorded assistant messages stand in for generated ones and summaries are synthetic tokens
of the recorded length. A request's ``cached_tokens`` is the longest prefix, in tokens *and*
ops (DESIGN.md §2: sharing needs a common prefix of both), that it shares with an earlier
request of the same trajectory followed by that request's output, i.e. what a server that never
evicts would report (page rounding ignored). Prefixes are compared on the server's own radix
keys (:func:`akv_jax.serving.radix_keys.request_keys`), and an answer is cached as the server caches
it: every generated token but the last (which is sampled, never fed back, so has no KV). This
isolates the policies' cost from server capacity and timing: the measured replay reports the
same quantities from the server.
"""

from __future__ import annotations

from collections.abc import Sequence

from akv_jax.agent.cost import Usage
from akv_jax.agent.messages import Message, Request, synthetic_tokens
from akv_jax.agent.policies import Policy
from akv_jax.agent.trajectory import Trajectory
from akv_jax.cache.ops import parse_history
from akv_jax.serving.radix_keys import Key, request_keys


def request_key(req: Request) -> list[Key]:
    """The server's radix keys of ``req``: its tokens with op items after their boundary."""
    return request_keys(req.segments, parse_history(req.cache, len(req.segments)))


def _common(a: Sequence[Key], b: Sequence[Key]) -> int:
    """Tokens (op markers not counted) in the longest common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += isinstance(x, int)
    return n


def offline_usage(policy: Policy, traj: Trajectory, vocab_size: int = 512) -> list[Usage]:
    """Usage of every request ``policy`` sends over ``traj`` (ideal prefix cache)."""
    seen: list[list[Key]] = []
    usages: list[Usage] = []
    history = traj.initial_history()
    for k, turn in enumerate(traj.turns):
        while True:
            req = policy.next_request(history, turn.output_tokens)
            if req.kind == "turn":
                out = turn.assistant
            else:
                out = synthetic_tokens(f"summary/{traj.index}/{k}", req.max_new_tokens,
                                       vocab_size)
            key = request_key(req)
            cached = max((_common(key, s) for s in seen), default=0)
            # the last prompt token is always recomputed for its logits
            cached = min(cached, req.prompt_tokens - 1)
            usages.append(Usage(req.prompt_tokens, cached, len(out), req.repos_tokens))
            seen.append(key + list(out[:-1]))  # the server keeps the KV of fed tokens
            policy.observe(req, out)
            if req.kind == "turn":
                break
        history += [Message("assistant", turn.assistant), Message("tool", turn.tool)]
    return usages
