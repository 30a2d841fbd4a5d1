"""Smoke replay against a tiny server: AKV keeps hitting the prefix cache, Standard misses
after its compaction. Small thresholds so that compaction happens within a few turns."""

import asyncio

import httpx
import pytest
from server_support import shared_server

from akv_jax.agent.policies import RollingDrop, Summarize
from akv_jax.agent.replay import Cell, run_trajectory, summarize
from akv_jax.agent.trajectory import TrajectorySpec, make_trajectory

SPEC = TrajectorySpec(system_tokens=16, task_range=(8, 16), output_range=(3, 6),
                      tool_range=(20, 60), max_turns=7, min_turns=7, keep_tools=2,
                      active_cap=1.0)
THRESHOLD = 250


def policy(method: str):
    if method == "akv":
        return RollingDrop(keep_tools=2, repos_threshold=THRESHOLD, max_positions=4096)
    return Summarize(THRESHOLD, keep_recent_tokens=60, reserve_tokens=40, summary_tokens=8,
                     summary_prompt_tokens=8, name=method)


async def replay(url: str, method: str):
    trajs = [make_trajectory(3, i, SPEC) for i in range(2)]
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        runs = await asyncio.gather(*(run_trajectory(client, policy(method), t) for t in trajs))
    return trajs, runs


@pytest.fixture(scope="module")
def replays():
    srv = shared_server()
    httpx.post(srv.url + "/flush_cache", timeout=60).raise_for_status()
    return {m: asyncio.run(replay(srv.url, m)) for m in ("standard", "akv")}


def test_every_turn_generates_its_recorded_budget(replays):
    for method, (trajs, runs) in replays.items():
        for traj, recs in zip(trajs, runs, strict=True):
            turns = [r for r in recs if r.kind == "turn"]
            assert [r.turn for r in turns] == list(range(len(traj.turns)))
            assert [r.completion_tokens for r in turns] == [t.output_tokens for t in traj.turns]
            assert all(r.error is None and r.finish_reason == "length" for r in recs)
            assert all(r.t_send < r.t_first <= r.t_end for r in recs)
            if method == "standard":
                assert [r.completion_tokens for r in recs if r.kind == "summary"] == [8] * len(
                    [r for r in recs if r.kind == "summary"])


def test_akv_hits_the_cache_where_standard_misses_after_compaction(replays):
    _, std_runs = replays["standard"]
    _, akv_runs = replays["akv"]
    for std, akv in zip(std_runs, akv_runs, strict=True):
        first_sum = next(i for i, r in enumerate(std) if r.kind == "summary")
        after = std[first_sum + 1]
        assert after.kind == "turn"
        # the rewritten history shares only the 16-token system prompt with the cache
        assert after.cached_tokens <= 16
        compact_turn = after.turn
        akv_turns = [r for r in akv if r.kind == "turn"]
        # every AKV turn reuses the previous turn's prompt (all but a last partial page)
        for prev, cur in zip(akv_turns[:-1], akv_turns[1:], strict=True):
            assert cur.cached_tokens >= prev.prompt_tokens - 16
        std_after = std[first_sum:]
        akv_after = [r for r in akv_turns if r.turn >= compact_turn]
        hit = lambda rs: sum(r.cached_tokens for r in rs) / sum(r.prompt_tokens for r in rs)  # noqa: E731
        assert hit(akv_after) > hit(std_after)
    # the ops really dropped old tool responses: AKV's last turn attends to fewer entries
    # than it sends
    last = [r for r in akv_runs[0] if r.kind == "turn"][-1]
    assert last.active_tokens < last.prompt_tokens + last.completion_tokens


def test_cell_summary_counts_requests_and_cost(replays):
    trajs, runs = replays["standard"]
    recs = [r for run in runs for r in run]
    t0 = min(r.t_send for r in recs)
    t1 = max(r.t_end for r in recs) + 1e-6
    row = summarize(Cell("standard", 2, t1 - t0, t0, t1, recs))
    assert row["requests"] == len(recs)
    assert row["turn_requests"] == sum(len(t.turns) for t in trajs)
    assert row["summary_requests"] == len(recs) - row["turn_requests"] >= 2
    out = sum(r.completion_tokens for r in recs)
    assert row["output_throughput"] == pytest.approx(out / (t1 - t0))
    usage = row["usage"]
    assert usage["prompt_tokens"] == sum(r.prompt_tokens for r in recs)
    assert usage["cached_tokens"] == sum(r.cached_tokens for r in recs)
    expected = (0.15 * (usage["prompt_tokens"] - usage["cached_tokens"])
                + 0.075 * usage["cached_tokens"] + 0.6 * out) / 1e6
    assert row["cost_usd"] == pytest.approx(expected)
