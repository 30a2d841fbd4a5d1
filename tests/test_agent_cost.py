"""Cost accounting with the paper's rates (Table 6), checked against hand-computed values."""

import dataclasses

import pytest
from radix_support import insert

from akv_jax.agent.cost import (
    RATES,
    Rates,
    Usage,
    cost_breakdown,
    cost_usd,
    costs_by_model,
    total_usage,
)
from akv_jax.agent.messages import Request
from akv_jax.agent.offline import offline_usage, request_key
from akv_jax.agent.policies import RollingDrop, Summarize
from akv_jax.agent.trajectory import TrajectorySpec, make_trajectory
from akv_jax.cache.ops import parse_history
from akv_jax.serving.page_pool import PagePool
from akv_jax.serving.radix import RadixTree
from akv_jax.serving.radix_keys import request_keys


def test_rates_are_the_papers():
    assert RATES == {
        "MiniMax-M2.7": Rates(0.300, 0.060, 1.200),
        "GPT-OSS-120B": Rates(0.150, 0.075, 0.600),
        "MiroThinker-1.7-Mini": Rates(0.200, 0.040, 2.400),
        "GPT-OSS-20B": Rates(0.075, 0.0375, 0.300),
    }


def test_one_request_gpt_oss_120b():
    # 2,000 missed x 0.15 + 8,000 hit x 0.075 + 500 out x 0.6, per 1M tokens
    u = Usage(prompt_tokens=10_000, cached_tokens=8_000, completion_tokens=500)
    parts = cost_breakdown(u, RATES["GPT-OSS-120B"])
    assert parts["miss"] == pytest.approx(0.0003, abs=1e-12)
    assert parts["hit"] == pytest.approx(0.0006, abs=1e-12)
    assert parts["output"] == pytest.approx(0.0003, abs=1e-12)
    assert cost_usd(u, "GPT-OSS-120B") == pytest.approx(0.0012, abs=1e-12)


def test_one_million_tokens_cost_the_rate():
    assert cost_usd(Usage(1_000_000, 0, 0), "MiniMax-M2.7") == pytest.approx(0.300)
    assert cost_usd(Usage(1_000_000, 1_000_000, 0), "MiniMax-M2.7") == pytest.approx(0.060)
    assert cost_usd(Usage(0, 0, 1_000_000), "MiroThinker-1.7-Mini") == pytest.approx(2.400)
    assert cost_usd(Usage(3_000_000, 1_000_000, 2_000_000), "GPT-OSS-20B") == pytest.approx(
        2 * 0.075 + 0.0375 + 2 * 0.300
    )


def test_repos_tokens_are_charged_at_the_hit_rate():
    # MiroThinker: 1,000 missed x 0.2 + 3,000 hit x 0.04 + 4,000 repos'd x 0.04 + 100 x 2.4
    u = Usage(prompt_tokens=4_000, cached_tokens=3_000, completion_tokens=100, repos_tokens=4_000)
    expected = (1_000 * 0.2 + 3_000 * 0.04 + 4_000 * 0.04 + 100 * 2.4) / 1e6
    assert cost_usd(u, "MiroThinker-1.7-Mini") == pytest.approx(expected, abs=1e-15)
    assert expected == pytest.approx(0.00072, abs=1e-15)
    assert cost_breakdown(u, RATES["MiroThinker-1.7-Mini"])["hit"] == pytest.approx(0.00028)


def test_summarising_vs_dropping_turn_costs():
    # Same 3,000-token logical prompt and 100 output tokens under GPT-OSS-120B rates: a turn
    # right after compaction misses everything but the 48-token system prompt, a rolling-drop
    # turn reuses all but the 150 new tokens.
    after_compaction = Usage(3_000, 48, 100)
    rolling = Usage(3_000, 2_850, 100)
    assert cost_usd(after_compaction, "GPT-OSS-120B") == pytest.approx(
        (2_952 * 0.15 + 48 * 0.075 + 100 * 0.6) / 1e6
    )
    assert cost_usd(rolling, "GPT-OSS-120B") == pytest.approx(
        (150 * 0.15 + 2_850 * 0.075 + 100 * 0.6) / 1e6
    )
    assert cost_usd(after_compaction, "GPT-OSS-120B") == pytest.approx(0.0005064)
    assert cost_usd(rolling, "GPT-OSS-120B") == pytest.approx(0.00029625)


def test_usage_from_server_fields():
    meta = {"id": "x", "prompt_tokens": 900, "cached_tokens": 640, "active_tokens": 700,
            "completion_tokens": 32, "finish_reason": "length"}
    assert Usage.from_meta(meta, repos_tokens=12) == Usage(900, 640, 32, 12)
    openai_usage = {"prompt_tokens": 900, "completion_tokens": 32, "total_tokens": 932,
                    "prompt_tokens_details": {"cached_tokens": 640}}
    assert Usage.from_meta(openai_usage) == Usage(900, 640, 32, 0)


def test_totals_and_all_models():
    total = total_usage([Usage(100, 50, 10, 5), Usage(200, 0, 20), Usage(0, 0, 1)])
    assert total == Usage(300, 50, 31, 5)
    by_model = costs_by_model(Usage(1_000_000, 500_000, 1_000_000))
    assert by_model == pytest.approx({
        "MiniMax-M2.7": 0.5 * 0.300 + 0.5 * 0.060 + 1.200,
        "GPT-OSS-120B": 0.5 * 0.150 + 0.5 * 0.075 + 0.600,
        "MiroThinker-1.7-Mini": 0.5 * 0.200 + 0.5 * 0.040 + 2.400,
        "GPT-OSS-20B": 0.5 * 0.075 + 0.5 * 0.0375 + 0.300,
    })


def test_invalid_usage_is_rejected():
    with pytest.raises(ValueError, match="cached_tokens"):
        Usage(10, 11, 0)
    with pytest.raises(ValueError, match="negative"):
        Usage(10, 0, -1)
    with pytest.raises(ValueError, match="no rates"):
        cost_usd(Usage(1, 0, 0), "GPT-5")


SMALL = TrajectorySpec(system_tokens=16, task_range=(8, 8), output_range=(4, 4),
                      tool_range=(30, 30), max_turns=8, min_turns=8, keep_tools=2,
                      active_cap=1.0)


def test_offline_prefix_cache_usage():
    traj = make_trajectory(0, 0, SMALL)
    # every turn: 4 recorded output tokens + a 30-token tool response; 24 tokens to start
    akv = offline_usage(RollingDrop(keep_tools=2, repos_threshold=10**6), traj)
    assert [u.prompt_tokens for u in akv] == [24 + 34 * k for k in range(8)]
    # turn k reuses all of turn k-1's prompt (same tokens, same ops before it) and its output
    # but the last token (sampled and never fed back, so the server holds no KV for it)
    assert [u.cached_tokens for u in akv] == [0] + [24 + 34 * (k - 1) + 3 for k in range(1, 8)]
    assert all(u.completion_tokens == 4 and u.repos_tokens == 0 for u in akv)
    std = offline_usage(Summarize(150, keep_recent_tokens=40, reserve_tokens=40,
                                  summary_tokens=8, summary_prompt_tokens=8), traj)
    # turns 0-3 grow to 126 tokens; turn 4 (160 >= 150) first sends a summary request (4 + 76
    # transcript + 4 tokens), then a turn whose rewritten prefix [system 16, summary 8, last two
    # turns 68] shares only the system prompt with the cache; at turn 6 the same again, the
    # second summary request sharing its 4-token summariser prompt with the first
    assert std == [
        Usage(24, 0, 4), Usage(58, 27, 4), Usage(92, 61, 4), Usage(126, 95, 4),
        Usage(84, 0, 8), Usage(92, 16, 4), Usage(126, 95, 4),
        Usage(84, 4, 8), Usage(92, 16, 4), Usage(126, 95, 4),
    ]


def test_request_key_is_the_servers():
    req = Request(((1, 2), (3,), (4, 5)), {"drop": {"2": [1]}, "reposition": [2]}, 4)
    # ops follow their boundary, drops first; a drop names the absolute token ranges it drops
    assert request_key(req) == [1, 2, 3, 4, 5, ("drop", ((2, 3),)), ("repos",)]
    assert request_key(req) == request_keys(req.segments, parse_history(req.cache, 3))
    assert request_key(Request(((1,), (2,)), None, 1)) == [1, 2]


class MergedHead:
    """A client that from turn ``from_turn`` on sends the system prompt and the task as one
    segment (as a harness does that folds the task into its system message when it resumes a
    session) and renumbers its ops to match: it drops the same messages, by indices one lower.
    Records every request with the output it was told."""

    def __init__(self, inner, from_turn: int):
        self.inner, self.from_turn, self.turns = inner, from_turn, 0
        self.name = "merged-head"
        self.sent: list[tuple[Request, tuple[int, ...]]] = []

    def next_request(self, history, max_new_tokens):
        req = self.inner.next_request(history, max_new_tokens)
        if self.turns >= self.from_turn:
            ops = req.cache
            req = dataclasses.replace(
                req,
                segments=(req.segments[0] + req.segments[1], *req.segments[2:]),
                cache={"drop": {str(int(b) - 1): [i - 1 for i in v]
                                for b, v in ops["drop"].items()},
                       "reposition": [b - 1 for b in ops["reposition"]]},
            )
        self.turns += 1
        return req

    def observe(self, req, output_ids):
        self.sent.append((req, tuple(output_ids)))
        self.inner.observe(req, output_ids)


def test_offline_sharing_is_the_server_radix_trees_when_segment_indices_change():
    """A re-segmented request keeps the same tokens and drops the same token ranges, under
    other segment indices: the same cache state (DESIGN.md §2), so the server shares it. The
    offline model must count exactly what the server's radix tree shares."""
    traj = make_trajectory(0, 0, SMALL)
    client = MergedHead(RollingDrop(keep_tools=2, repos_threshold=150), from_turn=5)
    usage = offline_usage(client, traj)
    # The server's side: its radix keys in its radix tree (one-token pages: no page rounding),
    # each answer's fed tokens stored after its prompt, as the engine does.
    tree = RadixTree(PagePool(1 << 16), 1)
    served = []
    for req, out in client.sent:
        keys = request_keys(req.segments, parse_history(req.cache, len(req.segments)))
        hit = sum(len(n.key) for n in tree.match(keys) if n.kind == "tokens")
        served.append(min(hit, req.prompt_tokens - 1))
        path = insert(tree, keys)
        tree.add_child(path[-1], out[:-1], "tokens", req.prompt_tokens)
    assert [u.cached_tokens for u in usage] == served
    # every turn reuses the previous prompt and output, the re-segmented turn 5 included
    assert served == [0] + [24 + 34 * (k - 1) + 3 for k in range(1, 8)]
    assert sum(u.repos_tokens > 0 for u in usage) >= 1  # a repos is among the shared ops
    # by segment index, turn 5 drops other segments than turn 4 did (an encoding by index
    # would stop sharing at turn 4's first drop, after 24 + 34 x 3 = 126 tokens) ...
    (turn4, _), (turn5, _) = client.sent[4], client.sent[5]
    assert turn4.cache["drop"]["7"] == [3] and "7" not in turn5.cache["drop"]
    assert turn5.cache["drop"]["6"] == [2]
    # ... but the same token ranges, so the server's keys agree on all of turn 4's ops
    ops4 = [k for k in request_key(turn4) if not isinstance(k, int)]
    ops5 = [k for k in request_key(turn5) if not isinstance(k, int)]
    assert ops4 and ops5[: len(ops4)] == ops4
