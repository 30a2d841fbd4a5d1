"""Cost accounting with the paper's rates (Table 6), checked against hand-computed values."""

import pytest

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


def test_offline_prefix_cache_usage():
    spec = TrajectorySpec(system_tokens=16, task_range=(8, 8), output_range=(4, 4),
                          tool_range=(30, 30), max_turns=8, min_turns=8, keep_tools=2,
                          active_cap=1.0)
    traj = make_trajectory(0, 0, spec)
    # every turn: 4 recorded output tokens + a 30-token tool response; 24 tokens to start
    akv = offline_usage(RollingDrop(keep_tools=2, repos_threshold=10**6), traj)
    assert [u.prompt_tokens for u in akv] == [24 + 34 * k for k in range(8)]
    # turn k reuses all of turn k-1's prompt and output (same tokens, same ops before it)
    assert [u.cached_tokens for u in akv] == [0] + [24 + 34 * (k - 1) + 4 for k in range(1, 8)]
    assert all(u.completion_tokens == 4 and u.repos_tokens == 0 for u in akv)
    std = offline_usage(Summarize(150, keep_recent_tokens=40, reserve_tokens=40,
                                  summary_tokens=8, summary_prompt_tokens=8), traj)
    # turns 0-3 grow to 126 tokens; turn 4 (160 >= 150) first sends a summary request (4 + 76
    # transcript + 4 tokens), then a turn whose rewritten prefix [system 16, summary 8, last two
    # turns 68] shares only the system prompt with the cache; at turn 6 the same again, the
    # second summary request sharing its 4-token summariser prompt with the first
    assert std == [
        Usage(24, 0, 4), Usage(58, 28, 4), Usage(92, 62, 4), Usage(126, 96, 4),
        Usage(84, 0, 8), Usage(92, 16, 4), Usage(126, 96, 4),
        Usage(84, 4, 8), Usage(92, 16, 4), Usage(126, 96, 4),
    ]


def test_request_key_places_ops_after_their_boundary():
    req = Request(((1, 2), (3,), (4, 5)), {"drop": {"2": [1]}, "reposition": [2]}, 4)
    assert request_key(req) == [1, 2, 3, 4, 5, ("drop", (1,)), ("repos",)]
    assert request_key(Request(((1,), (2,)), None, 1)) == [1, 2]
