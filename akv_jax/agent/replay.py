"""Replay of agent trajectories against a running server (``POST /generate``, streamed).

Protocol (the paper's Table 2, A.1.4): each trajectory's turns run one after another; every
turn sends the request its policy builds from the full history, generates exactly the recorded
output budget (temperature 0, ``ignore_eos``), keeps the generated tokens as the next turn's
assistant message and appends the recorded tool response (tools are never re-run).
Summarising policies send their summary requests in line, as the agent would.

A *cell* runs ``concurrency`` workers for a fixed measurement window. Worker w starts its first
trajectory part-way, at turn ``(w + 0.5) / concurrency`` of its length, so the workers are at
different phases as in a long-running service (without this they would all compact at once).
The turns before that point are played offline with the recorded assistant messages (the
policy sees the same history shape) and the first request, a cold prefill of that history, is
a ramp request sent before the window opens and not measured. When a trajectory ends the
worker takes the next one from the seeded sequence, from its first turn. Requests *sent*
inside the window are measured to completion; throughputs count tokens that *arrive* inside
the window (output) and prompt tokens of requests whose first token arrives inside it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Sequence

import httpx
import numpy as np

from akv_jax.agent.cost import RATES, Usage, cost_usd, total_usage
from akv_jax.agent.messages import Message, Request, synthetic_tokens
from akv_jax.agent.policies import Policy
from akv_jax.agent.trajectory import Trajectory


@dataclasses.dataclass
class Record:
    """One request as the client saw it (times from ``time.perf_counter``)."""

    method: str
    worker: int
    trajectory: int
    turn: int
    kind: str
    measured: bool
    t_send: float
    t_first: float = float("nan")
    t_end: float = float("nan")
    token_times: list[float] = dataclasses.field(default_factory=list)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    active_tokens: int = 0
    completion_tokens: int = 0
    repos_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def latency(self) -> float:
        return self.t_end - self.t_send

    @property
    def ttft(self) -> float:
        return self.t_first - self.t_send

    @property
    def tpot(self) -> float | None:
        if self.completion_tokens < 2:
            return None
        return (self.t_end - self.t_first) / (self.completion_tokens - 1)

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.cached_tokens, self.completion_tokens,
                     self.repos_tokens)


async def send(client: httpx.AsyncClient, req: Request, rec: Record) -> Record:
    """Stream one request, filling ``rec`` (raises on HTTP or stream errors)."""
    body = req.generate_body(stream=True)
    rec.repos_tokens = req.repos_tokens
    async with client.stream("POST", "/generate", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {resp.status_code}: {text[:500]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                raise RuntimeError(f"stream error: {ev['error']}")
            now = time.perf_counter()
            ids = ev.get("output_ids") or []
            if ids and rec.t_first != rec.t_first:  # NaN: first token
                rec.t_first = now
            rec.token_times.extend([now] * len(ids))
            rec.output_ids.extend(int(t) for t in ids)
            meta = ev.get("meta_info") or {}
            if "prompt_tokens" in meta:
                rec.prompt_tokens = int(meta["prompt_tokens"])
                rec.cached_tokens = int(meta.get("cached_tokens") or 0)
                rec.active_tokens = int(meta.get("active_tokens") or 0)
                rec.completion_tokens = int(meta["completion_tokens"])
                rec.finish_reason = meta.get("finish_reason")
    rec.t_end = time.perf_counter()
    if rec.finish_reason != "length" or rec.completion_tokens != req.max_new_tokens:
        raise RuntimeError(
            f"request ended with {rec.finish_reason!r} after {rec.completion_tokens} of "
            f"{req.max_new_tokens} tokens"
        )
    return rec


def fast_forward(policy: Policy, traj: Trajectory, turns: int, vocab_size: int) -> list[Message]:
    """History after ``turns`` turns played offline with the recorded assistant messages;
    summary requests are answered with synthetic summaries of the requested length."""
    history = traj.initial_history()
    for k in range(turns):
        turn = traj.turns[k]
        while True:
            req = policy.next_request(history, turn.output_tokens)
            if req.kind == "turn":
                break
            policy.observe(req, synthetic_tokens(f"summary/{traj.index}/{k}",
                                                 req.max_new_tokens, vocab_size))
        history += [Message("assistant", turn.assistant), Message("tool", turn.tool)]
    return history


async def play_turns(
    client: httpx.AsyncClient,
    policy: Policy,
    traj: Trajectory,
    history: list[Message],
    first_turn: int,
    *,
    last_turn: int | None = None,
    worker: int = 0,
    measured: Callable[[float], bool] = lambda t: True,
    stop: Callable[[], bool] = lambda: False,
    records: list[Record] | None = None,
) -> bool:
    """Play turns ``[first_turn, last_turn)`` live, extending ``history`` in place.

    Returns False when a request failed (its record carries the error; the trajectory is
    abandoned, as a harness would on a server error) or ``stop()`` cut it short."""
    records = records if records is not None else []
    end = len(traj.turns) if last_turn is None else last_turn
    for k in range(first_turn, end):
        turn = traj.turns[k]
        while True:
            if stop():
                return False
            req = policy.next_request(history, turn.output_tokens)
            t = time.perf_counter()
            rec = Record(policy.name, worker, traj.index, k, req.kind, measured(t), t)
            records.append(rec)
            try:
                await send(client, req, rec)
            except (RuntimeError, httpx.HTTPError) as e:
                rec.error = f"{type(e).__name__}: {e}"
                return False
            policy.observe(req, rec.output_ids)
            if req.kind == "turn":
                break
        history += [Message("assistant", tuple(rec.output_ids)), Message("tool", turn.tool)]
    return True


async def run_trajectory(
    client: httpx.AsyncClient,
    policy: Policy,
    traj: Trajectory,
    *,
    start_turn: int = 0,
    vocab_size: int = 512,
) -> list[Record]:
    """Replay ``traj`` from ``start_turn`` (earlier turns fast-forwarded offline)."""
    history = fast_forward(policy, traj, start_turn, vocab_size)
    records: list[Record] = []
    await play_turns(client, policy, traj, history, start_turn, records=records)
    return records


@dataclasses.dataclass
class Cell:
    method: str
    concurrency: int
    window_s: float
    t0: float
    t1: float
    records: list[Record]
    server_delta: dict[str, float] = dataclasses.field(default_factory=dict)


async def run_cell(
    base_url: str,
    make_policy: Callable[[], Policy],
    trajectories: Iterator[Trajectory],
    concurrency: int,
    window_s: float,
    *,
    vocab_size: int = 512,
    timeout_s: float = 600.0,
) -> Cell:
    """``concurrency`` workers replaying for ``window_s`` seconds after a ramp (module doc)."""
    records: list[Record] = []
    window: dict[str, float] = {}
    ramp_done = asyncio.Event()
    ramp_left = [concurrency]

    def in_window(t: float) -> bool:
        return "t0" in window and window["t0"] <= t < window["t1"]

    def stop() -> bool:
        return "t1" in window and time.perf_counter() >= window["t1"]

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:

        async def worker(w: int) -> None:
            traj = next(trajectories)
            start = int((w + 0.5) / concurrency * len(traj.turns))
            policy = make_policy()
            history = fast_forward(policy, traj, start, vocab_size)
            # The ramp request (a cold prefill of the fast-forwarded history) is not measured.
            ok = await play_turns(client, policy, traj, history, start, last_turn=start + 1,
                                  worker=w, measured=lambda t: False, records=records)
            ramp_left[0] -= 1
            if ramp_left[0] == 0:
                now = time.perf_counter()
                window.update(t0=now, t1=now + window_s)
                ramp_done.set()
            await ramp_done.wait()
            if ok:
                await play_turns(client, policy, traj, history, start + 1, worker=w,
                                 measured=in_window, stop=stop, records=records)
            while not stop():
                traj = next(trajectories)
                await play_turns(client, make_policy(), traj, traj.initial_history(), 0,
                                 worker=w, measured=in_window, stop=stop, records=records)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    methods = {r.method for r in records}
    return Cell(methods.pop() if len(methods) == 1 else "?", concurrency, window_s,
                window["t0"], window["t1"], records)


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, float), q)) if len(xs) else float("nan")


def _mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs)) if len(xs) else float("nan")


def _in_window(cell: Cell, t: float) -> bool:
    return cell.t0 <= t < cell.t1


def summarize(cells: Cell | Sequence[Cell], cost_model: str = "GPT-OSS-120B") -> dict[str, object]:
    """Metrics of one cell, or of repeats of one (method, concurrency) pooled: latency
    statistics over every measured request, throughputs as tokens in the windows over their
    total length. Latencies in seconds, TPOT in ms, throughputs in tokens/s."""
    cells = [cells] if isinstance(cells, Cell) else list(cells)
    cell = cells[0]
    every = [(c, r) for c in cells for r in c.records]
    meas = [r for _, r in every if r.measured and r.error is None]
    errors = [r.error for _, r in every if r.measured and r.error is not None]
    turns = [r for r in meas if r.kind == "turn"]
    w = sum(c.t1 - c.t0 for c in cells)
    out_tokens = sum(sum(_in_window(c, t) for t in r.token_times) for c, r in every)
    agent_out = sum(
        sum(_in_window(c, t) for t in r.token_times) for c, r in every if r.kind == "turn"
    )
    in_tokens = sum(r.prompt_tokens for c, r in every if _in_window(c, r.t_first))
    usage = total_usage(r.usage() for r in meas)
    tpots = [x for x in (r.tpot for r in meas) if x is not None]
    prompt = sum(r.prompt_tokens for r in meas)
    server: dict[str, float] = {}
    for c in cells:
        for k, v in c.server_delta.items():
            server[k] = server.get(k, 0) + v
    return {
        "method": cell.method,
        "concurrency": cell.concurrency,
        "window_s": round(w, 3),
        "repeats": len(cells),
        "requests": len(meas),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "turn_requests": len(turns),
        "summary_requests": len(meas) - len(turns),
        "latency_mean_s": _mean([r.latency for r in meas]),
        "latency_p50_s": _pct([r.latency for r in meas], 50),
        "latency_p95_s": _pct([r.latency for r in meas], 95),
        "turn_latency_p95_s": _pct([r.latency for r in turns], 95),
        "ttft_mean_s": _mean([r.ttft for r in meas]),
        "ttft_p95_s": _pct([r.ttft for r in meas], 95),
        "tpot_mean_ms": 1000 * _mean(tpots),
        "output_throughput": out_tokens / w,
        "agent_output_throughput": agent_out / w,
        "input_throughput": in_tokens / w,
        "cache_hit_rate": usage.cached_tokens / prompt if prompt else float("nan"),
        "prompt_tokens_mean": _mean([r.prompt_tokens for r in meas]),
        "active_tokens_mean": _mean([r.active_tokens for r in meas]),
        "usage": dataclasses.asdict(usage),
        "cost_model": cost_model,
        "cost_usd": cost_usd(usage, cost_model),
        "cost_per_turn_usd": cost_usd(usage, cost_model) / len(turns) if turns else float("nan"),
        "cost_per_turn_usd_by_model": {
            m: (cost_usd(usage, m) / len(turns) if turns else float("nan")) for m in RATES
        },
        "server": server,
    }
