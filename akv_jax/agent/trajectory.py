"""Seeded synthetic agent trajectories (token ids only) for replay benchmarks and tests.

A trajectory is what a replay needs from a recorded agent run: the system prompt, the task,
and per turn the recorded output budget (reasoning + tool call) and the recorded tool response.
The replay generates the assistant messages itself (greedy, ``ignore_eos``, exactly the
recorded budget) and feeds back the recorded tool responses, as in the paper's Table 2 protocol.

Distributions (all lengths in tokens, drawn from ``random.Random(f"{seed}/{index}")``), the
issue's: tool responses of 100-2,000 tokens, reasoning of 20-200 tokens, tens of turns:

* system prompt: ``system_tokens`` fixed ids shared by every trajectory (one harness);
* task: log-uniform in ``task_range``;
* per turn, output budget (reasoning + tool call): log-uniform in ``output_range`` (20-200,
  mean 78);
* per turn, tool response: log-uniform in ``tool_range`` (100-2,000, mean 634), so tool
  responses hold ~89% of a trajectory, as in coding and search agents;
* number of turns: ``max_turns`` (40), unless AKV's active context (every message except
  tool responses older than the ``keep_tools`` most recent) would pass ``active_cap`` of the
  position limit first (it does not at the default 32,768 positions).

With the defaults (``context`` 32,768, the replay's scale of the paper's 131,072 positions,
1/4): ~28K tokens per trajectory; AKV keeps the 12 latest tool responses (~7.6K tokens) and
all reasoning, 8.0K active tokens per request on average; Standard summarises at 24,576
tokens about once per trajectory (11.9K prompt tokens per request on average). The paper
likewise replays the tasks with the longest trajectories.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator

from akv_jax.agent.messages import Message, synthetic_tokens
from akv_jax.agent.policies import REPLAY_SCALE


@dataclasses.dataclass(frozen=True)
class TrajectorySpec:
    vocab_size: int = 512
    context: int = REPLAY_SCALE.context  # the replay's window (1/4 of the paper's)
    system_tokens: int = 48
    task_range: tuple[int, int] = (16, 64)
    output_range: tuple[int, int] = (20, 200)
    tool_range: tuple[int, int] = (100, 2000)
    max_turns: int = 40
    min_turns: int = 4
    keep_tools: int = 12
    active_cap: float = 0.75


@dataclasses.dataclass(frozen=True)
class Turn:
    output_tokens: int  # recorded output budget of the assistant message
    tool: tuple[int, ...]  # recorded tool response that follows it
    assistant: tuple[int, ...]  # a recorded assistant message (used when no server answers)


@dataclasses.dataclass(frozen=True)
class Trajectory:
    index: int
    system: tuple[int, ...]
    task: tuple[int, ...]
    turns: tuple[Turn, ...]

    def initial_history(self) -> list[Message]:
        return [Message("system", self.system), Message("user", self.task)]

    @property
    def num_tokens(self) -> int:
        """Tokens of the full unsummarised history (recorded assistant messages)."""
        body = sum(len(t.tool) + len(t.assistant) for t in self.turns)
        return len(self.system) + len(self.task) + body


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def make_trajectory(seed: int, index: int, spec: TrajectorySpec = TrajectorySpec()) -> Trajectory:
    rng = random.Random(f"{seed}/{index}")
    system = synthetic_tokens(f"system/{seed}", spec.system_tokens, spec.vocab_size)
    task = synthetic_tokens(rng.random(), _log_uniform(rng, *spec.task_range), spec.vocab_size)
    cap = spec.active_cap * spec.context
    fixed = len(system) + len(task)
    reasoning = 0
    tools: list[int] = []
    turns: list[Turn] = []
    while len(turns) < spec.max_turns:
        n_out = _log_uniform(rng, *spec.output_range)
        n_tool = _log_uniform(rng, *spec.tool_range)
        kept = sum(tools[-spec.keep_tools:]) if spec.keep_tools else 0
        if fixed + reasoning + kept + n_out + n_tool > cap:
            break
        turns.append(Turn(
            output_tokens=n_out,
            tool=synthetic_tokens(rng.random(), n_tool, spec.vocab_size),
            assistant=synthetic_tokens(rng.random(), n_out, spec.vocab_size),
        ))
        reasoning += n_out
        tools.append(n_tool)
    if len(turns) < spec.min_turns:
        raise ValueError(f"spec leaves only {len(turns)} turns inside the context cap")
    return Trajectory(index, system, task, tuple(turns))


def trajectories(seed: int, spec: TrajectorySpec = TrajectorySpec()) -> Iterator[Trajectory]:
    """The endless seeded sequence: trajectory i is ``make_trajectory(seed, i)``."""
    i = 0
    while True:
        yield make_trajectory(seed, i, spec)
        i += 1
