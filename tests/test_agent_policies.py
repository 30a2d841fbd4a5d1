"""Client-side policies: valid and stable cache fields (rolling drop), Pi-style compaction."""

import pytest

from akv_jax.agent.messages import Message, Request
from akv_jax.agent.policies import (
    PAPER_STANDARD_THRESHOLD,
    POLICIES,
    ContextOverflow,
    RollingDrop,
    Scale,
    Summarize,
    make_policy,
    standard,
    text_engineering,
)
from akv_jax.agent.trajectory import TrajectorySpec, make_trajectory
from akv_jax.cache.ops import parse_history
from akv_jax.cache.timeline import timeline


def msg(role: str, n: int, fill: int = 1) -> Message:
    return Message(role, (fill,) * n)


def agent_run(policy, n_turns: int, out_len: int = 5, tool_len: int = 10):
    """Drive ``policy`` for ``n_turns`` turns; (histories, requests) of the turn requests."""
    history = [msg("system", 8), msg("user", 6)]
    histories, requests = [], []
    for k in range(n_turns):
        while True:
            req = policy.next_request(history, out_len)
            policy.observe(req, (7,) * req.max_new_tokens)
            if req.kind == "turn":
                break
        histories.append(list(history))
        requests.append(req)
        history = history + [msg("assistant", out_len, 2), msg("tool", tool_len + k, 3)]
    return histories, requests


# ----------------------------------------------------------------------------- rolling drop


def test_rolling_drop_keeps_the_12_most_recent_tool_responses():
    histories, requests = agent_run(RollingDrop(repos_threshold=10**6, max_positions=10**6), 20)
    for hist, req in zip(histories, requests, strict=True):
        ops = parse_history(req.cache, len(hist))  # valid in the server's grammar
        tools = [i for i, m in enumerate(hist) if m.role == "tool"]
        dropped = {i for segs in ops.drops.values() for i in segs}
        assert dropped == set(tools[:-12])
        # only tool responses are ever dropped; reasoning and instructions stay
        assert all(hist[i].role == "tool" for i in dropped)
        assert req.segments == tuple(m.tokens for m in hist)
        assert req.kind == "turn" and req.repos_tokens == 0
    # turn k has k tool responses at indices 3, 5, ..., 2k + 1; from turn 13 on, the one that
    # just fell out of the 12 most recent (index 2(k - 13) + 3) is dropped at that turn's
    # last boundary 2k + 1, one per turn
    last = parse_history(requests[-1].cache, len(histories[-1]))
    assert last.drops == {2 * k + 1: (2 * (k - 13) + 3,) for k in range(13, 20)}


def test_rolling_drop_ops_are_stable_across_turns():
    policy = RollingDrop(keep_tools=3, repos_threshold=60, max_positions=4096)
    histories, requests = agent_run(policy, 15)
    for t in range(len(requests) - 1):
        now = parse_history(requests[t].cache, len(histories[t]))
        nxt = parse_history(requests[t + 1].cache, len(histories[t + 1]))
        assert nxt.truncate(len(histories[t])) == now
        # new ops appear only at the new request's last boundary
        new_bounds = set(nxt.drops) - set(now.drops) | (set(nxt.repos) - set(now.repos))
        assert new_bounds <= {len(histories[t + 1]) - 1}


def test_rolling_drop_repos_at_threshold_matches_the_timeline():
    policy = RollingDrop(keep_tools=2, repos_threshold=120, max_positions=200)
    histories, requests = agent_run(policy, 14)
    saw_repos = 0
    for hist, req in zip(histories, requests, strict=True):
        ops = parse_history(req.cache, len(hist))
        tl = timeline([m.num_tokens for m in hist], ops)
        b = len(hist) - 1
        if req.repos_tokens:
            saw_repos += 1
            assert b in ops.repos
            # the repos re-encodes exactly the active entries; next_pos drops to their count
            assert req.repos_tokens == int(tl.final_active.sum()) == tl.next_pos
        else:
            assert tl.next_pos < 120 or int(tl.final_active.sum()) == tl.next_pos
        assert tl.max_position < 200 and tl.next_pos + 5 <= 200
    assert saw_repos >= 3
    repos = parse_history(requests[-1].cache, len(histories[-1])).repos
    assert len(repos) == saw_repos
    assert all(b % 2 == 1 for b in repos)  # always at a turn's last boundary (a tool response)


def test_rolling_drop_positions_worked_by_hand():
    """The policy's positions are the timeline's (DESIGN.md §2); values worked out by hand.

    agent_run: 14 tokens to start, turn k adds an assistant message of 5 and a tool response
    of 10 + k tokens. keep_tools=2, repos at 120: turn 7 sends 14 + 7 x 15 + 21 = 140 tokens,
    tools 10..14 (60) dropped, so a repos re-encodes 80; turn 9 reaches 80 + 22 + 23 = 125
    with tools 15 and 16 dropped since: 94."""
    _, requests = agent_run(RollingDrop(keep_tools=2, repos_threshold=120, max_positions=200),
                            14)
    assert [r.repos_tokens for r in requests] == [0] * 7 + [80, 0, 94, 0, 108, 115, 122]
    # keep 12: nothing dropped; turn 6 holds 14 + 6 x 15 + 15 = 119 tokens, no gap to close,
    # and 119 + 5 new tokens pass 120
    with pytest.raises(ContextOverflow, match=r"^akv: context reaches position 124 \(active "
                       r"119\), past the limit of 120$"):
        agent_run(RollingDrop(keep_tools=12, repos_threshold=100, max_positions=120), 12)
    # keep 0, repos at 50: from turn 3 on every turn repositions, to 14 + 5k active entries;
    # turn 12 appends 5 + 21 tokens from position 69, so the context reaches 95 > 90 before
    # its repos can help
    with pytest.raises(ContextOverflow, match=r"^akv: context reaches position 95 \(active "
                       r"74\), past the limit of 90$"):
        agent_run(RollingDrop(keep_tools=0, repos_threshold=50, max_positions=90), 20)


def test_rolling_drop_with_k0_drops_each_tool_at_its_own_boundary():
    histories, requests = agent_run(RollingDrop(keep_tools=0, repos_threshold=10**6,
                                                max_positions=10**6), 5)
    ops = parse_history(requests[-1].cache, len(histories[-1]))
    assert ops.drops == {3: (3,), 5: (5,), 7: (7,), 9: (9,)}


def test_rolling_drop_reports_overflow_and_rejects_a_shrinking_history():
    policy = RollingDrop(keep_tools=12, repos_threshold=100, max_positions=120)
    with pytest.raises(ContextOverflow, match="past the limit of 120"):
        agent_run(policy, 12)
    p = RollingDrop()
    p.next_request([msg("system", 4), msg("user", 4), msg("assistant", 4)], 4)
    with pytest.raises(ValueError, match="shrank"):
        p.next_request([msg("system", 4), msg("user", 4)], 4)


# ----------------------------------------------------------------------------- summarising


def test_scaled_paper_settings():
    assert Scale(4096).factor == 1 / 32
    s, te, akv = standard(), text_engineering(), make_policy("akv")
    assert (s.threshold, te.threshold) == (3072, 1536)
    assert (s.keep_recent_tokens, s.reserve_tokens, s.summary_tokens) == (625, 512, 128)
    assert (akv.keep_tools, akv.repos_threshold, akv.max_positions) == (12, 3072, 4096)
    paper = standard(Scale(131_072))
    assert (paper.threshold, paper.keep_recent_tokens, paper.reserve_tokens) == (
        98_304, 20_000, 16_384
    )
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("lru")


def test_summarize_compacts_at_the_threshold_and_keeps_system_and_recent_messages():
    pol = Summarize(100, keep_recent_tokens=30, reserve_tokens=40, summary_tokens=8,
                    summary_prompt_tokens=6, name="std")
    history = [msg("system", 10, 9), msg("developer", 5, 8), msg("user", 15, 4)]
    for k in range(4):  # 30 + 4 x (8 + 9) = 98 tokens
        history += [msg("assistant", 8, 20 + k), msg("tool", 9, 40 + k)]
    assert sum(m.num_tokens for m in history) == 98
    req = pol.next_request(history, 5)  # below the threshold: everything, no ops
    assert req == Request(tuple(m.tokens for m in history), None, 5)
    history.append(msg("assistant", 2, 60))  # 100 tokens: compaction is due
    req = pol.next_request(history, 5)
    assert req.kind == "summary" and req.max_new_tokens == 8 and req.cache is None
    # kept: the newest messages worth >= 30 tokens, [asst 8, tool 9, asst 8, tool 9, asst 2],
    # reach 36 at index 7, an assistant message, so the cut is 7; the user task (index 2)
    # is summarised, the system and developer messages are kept
    assert req.segments[0] == pol.summary_prompt and req.segments[2] == pol.summary_instruction
    assert len(req.segments[0]) + len(req.segments[2]) == 6
    assert req.segments[1] == tuple(t for m in history[2:7] for t in m.tokens)
    with pytest.raises(RuntimeError, match="observe"):
        pol.next_request(history, 5)
    pol.observe(req, [100 + i for i in range(8)])
    assert pol.compactions == 1
    req = pol.next_request(history, 5)
    summary = tuple(100 + i for i in range(8))
    assert req.kind == "turn"
    assert req.segments == (history[0].tokens, history[1].tokens, summary,
                            *(m.tokens for m in history[7:]))
    assert sum(m.num_tokens for m in history[7:]) >= 30
    assert req.prompt_tokens == 15 + 8 + 36


def test_summarize_never_starts_the_kept_part_with_a_tool_result_and_chains_summaries():
    pol = Summarize(60, keep_recent_tokens=10, reserve_tokens=40, summary_tokens=4,
                    summary_prompt_tokens=2)
    history = [msg("system", 5), msg("user", 5)]
    for k in range(5):  # 10 + 5 x 12 = 70 tokens
        history += [msg("assistant", 2, 20 + k), msg("tool", 10, 40 + k)]
    req = pol.next_request(history, 3)
    assert req.kind == "summary"
    # 10 recent tokens end inside the last tool response (index 11); the cut moves back to
    # its assistant message (index 10)
    assert req.segments[1] == tuple(t for m in history[1:10] for t in m.tokens)
    pol.observe(req, [7, 7, 7, 7])
    assert pol.next_request(history, 3).segments[2:] == (history[10].tokens, history[11].tokens)
    for k in range(5):
        history += [msg("assistant", 2, 50 + k), msg("tool", 10, 70 + k)]
    req = pol.next_request(history, 3)
    assert req.kind == "summary"
    # the second summary covers the first one plus the messages compacted since
    assert req.segments[1] == (7, 7, 7, 7) + tuple(t for m in history[10:20] for t in m.tokens)
    pol.observe(req, [8, 8, 8, 8])
    assert pol.compactions == 2
    assert pol.next_request(history, 3).segments == (
        history[0].tokens, (8, 8, 8, 8), history[20].tokens, history[21].tokens
    )


def test_text_engineering_compacts_more_often_than_standard():
    spec = TrajectorySpec()
    traj = make_trajectory(0, 0, spec)
    counts = {}
    for name in ("standard", "text_engineering"):
        pol = make_policy(name, Scale(spec.context))
        history = traj.initial_history()
        for turn in traj.turns:
            while True:
                req = pol.next_request(history, turn.output_tokens)
                assert req.prompt_tokens + req.max_new_tokens <= spec.context
                pol.observe(req, (5,) * req.max_new_tokens)
                if req.kind == "turn":
                    break
            history += [Message("assistant", turn.assistant), Message("tool", turn.tool)]
        counts[name] = pol.compactions
    assert counts["standard"] >= 1
    assert counts["text_engineering"] > counts["standard"]


def test_generated_trajectories_fit_every_policy():
    spec = TrajectorySpec()
    kinds: dict[str, set[str]] = {name: set() for name in POLICIES}
    for i in range(4):
        traj = make_trajectory(7, i, spec)
        assert make_trajectory(7, i, spec) == traj  # seeded
        assert 15 <= len(traj.turns) <= spec.max_turns
        assert all(20 <= t.output_tokens <= 200 and 100 <= len(t.tool) <= 2000
                   for t in traj.turns)
        for name in POLICIES:
            pol = make_policy(name, Scale(spec.context))
            history = traj.initial_history()
            for turn in traj.turns:
                # Every request a turn takes (a summary first, for the compacting policies)
                # stays inside the position limit with its answer.
                while True:
                    req = pol.next_request(history, turn.output_tokens)
                    ops = parse_history(req.cache, len(req.segments))
                    tl = timeline([len(s) for s in req.segments], ops)
                    assert tl.max_position < spec.context
                    assert tl.next_pos + req.max_new_tokens <= spec.context
                    kinds[name].add(req.kind)
                    pol.observe(req, (5,) * req.max_new_tokens)
                    if req.kind == "turn":
                        assert req.max_new_tokens == turn.output_tokens
                        break
                history += [Message("assistant", turn.assistant), Message("tool", turn.tool)]
    # the compacting policies did compact on these trajectories: their summary requests
    # were checked too, not only their turns
    assert kinds == {"akv": {"turn"}, "standard": {"turn", "summary"},
                     "text_engineering": {"turn", "summary"}}
    # long enough that Standard must summarise, on average
    mean = sum(make_trajectory(7, i, spec).num_tokens for i in range(8)) / 8
    assert mean > Scale(spec.context).tokens(PAPER_STANDARD_THRESHOLD)
