"""Where a serving step's time goes: host scheduling, packing, transfers, forward, sampling.

    PYTHONPATH=. python bench/profile_engine.py [--model default|tiny|PATH] [--steps 32]
                                                [--agent-turns 4] [--drops]

Drives :class:`akv_jax.serving.engine.Engine` (the server's scheduler, planner, executor and
sampler) through three scenarios: decode at batch 1 and batch 8 (256-token prompts) and a cold
2,000-token prefill; with ``--agent-turns`` also ``bench/peers.py``'s agent workload (four
conversations at once, each turn a ~300-token tool output and 32 new tokens, the next turn
submitted as soon as the last ends; ``--drops`` with its cache operations), reported by step
kind with the prefill forwards' row counts. Every stage is timed by wrapping the function
that does it, and the forward is made synchronous (``block_until_ready``) so its time is
the device's:

====================  ==============================================================
plan                  ``Planner.plan`` / ``Planner.decode_pass`` (host)
pack                  ``Executor.run`` outside the forward: flattening passes, padded
                      numpy arrays, ``build_segment_batch`` (host)
h2d                   ``jnp.asarray`` of the step's inputs (host -> device)
forward               the jitted step (``DeviceGroup.forward``), waited for
logits->host          ``np.asarray`` of the logits rows
sample                ``sampler.sample`` per row (host)
other                 the rest of ``Engine.step`` (queues, events, cache bookkeeping)
====================  ==============================================================

Prints the per-step medians (ms) of each stage per scenario, and of the process's CPU time
per step (all threads; on a shared machine the wall times carry other processes' load).
Synchronous forwards remove the overlap the real server gets from asynchronous dispatch,
which is the point: each stage is seen alone.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np
from peers import Sizes, random_ids  # bench/peers.py: the agent workload's sizes, ids

import akv_jax.serving.device_group as device_group
import akv_jax.serving.engine as engine_mod
import akv_jax.serving.executor as executor_mod
from akv_jax.cache.ops import parse_history
from akv_jax.serving.engine import Engine
from akv_jax.serving.types import GenerateRequest, SamplingParams
from converters.loading import load_model

STAGES = ("plan", "pack", "h2d", "forward", "logits->host", "sample", "other")


class Timers:
    def __init__(self):
        self.step: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.depth = 0

    @contextmanager
    def stage(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.step[name] += time.perf_counter() - t0

    def wrap(self, owner, attr: str, name: str):
        fn = getattr(owner, attr)
        timers = self

        def wrapped(*a, **k):
            with timers.stage(name):
                return fn(*a, **k)

        setattr(owner, attr, wrapped)


def instrument(t: Timers) -> None:
    """Wrap the stages' functions (module globals and methods) with timers."""
    t.wrap(engine_mod.Planner, "plan", "plan")
    t.wrap(engine_mod.Planner, "decode_pass", "plan")
    t.wrap(engine_mod, "sample", "sample")
    t.wrap(executor_mod, "build_segment_batch", "pack_batch")

    real_asarray = jnp.asarray

    def asarray(x, *a, **k):
        with t.stage("h2d"):
            return real_asarray(x, *a, **k)

    # The modules that move step inputs to the device call jnp.asarray through these names.
    for mod in (executor_mod, device_group, sys.modules["akv_jax.pallas.metadata"]):
        mod.jnp = _Proxy(mod.jnp, asarray)

    real_forward = device_group.DeviceGroup.forward

    def forward(self, *a, **k):
        t0 = time.perf_counter()
        h0 = t.step["h2d"]
        out = jax.block_until_ready(real_forward(self, *a, **k))
        t.step["forward"] += time.perf_counter() - t0 - (t.step["h2d"] - h0)
        return out

    device_group.DeviceGroup.forward = forward
    t.wrap(executor_mod.Executor, "run", "run")

    real_prefill, real_decode = executor_mod.Executor.run_prefill, executor_mod.Executor.run_decode

    def run_prefill(self, slices):
        t.step["prefill_rows"] += sum(len(sl.tokens) for _, sl in slices)
        return real_prefill(self, slices)

    def run_decode(self, work):
        t.step["decode_rows"] += len(work)
        return real_decode(self, work)

    executor_mod.Executor.run_prefill = run_prefill
    executor_mod.Executor.run_decode = run_decode

    real_np_asarray = np.asarray

    class _Np:
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def asarray(x, *a, **k):
            if isinstance(x, jax.Array):
                with t.stage("logits->host"):
                    return real_np_asarray(x, *a, **k)
            return real_np_asarray(x, *a, **k)

    engine_mod.np = _Np()


class _Proxy:
    """A module stand-in whose ``asarray`` is timed; everything else passes through."""

    def __init__(self, mod, asarray):
        self._mod, self.asarray = mod, asarray

    def __getattr__(self, name):
        return getattr(self._mod, name)


def _cpu() -> float:
    """CPU seconds of this process, all threads: robust to other processes' load."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_scenario(eng: Engine, t: Timers, prompts: list[list[int]], new: int) -> list[dict]:
    eng.flush_cache()
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(GenerateRequest(f"r{i}", [p], parse_history(None, 1), sp))
    rows = []
    while eng.has_work():
        t.step.clear()
        t0, c0 = time.perf_counter(), _cpu()
        eng.step()
        total = time.perf_counter() - t0
        cpu = _cpu() - c0
        s = dict(t.step)
        row = {
            "plan": s.get("plan", 0.0),
            "pack": s.get("run", 0.0) - s.get("forward", 0.0) - s.get("h2d", 0.0),
            "h2d": s.get("h2d", 0.0),
            "forward": s.get("forward", 0.0),
            "logits->host": s.get("logits->host", 0.0),
            "sample": s.get("sample", 0.0),
        }
        row["other"] = total - sum(row.values())
        row["total"] = total
        row["cpu"] = cpu
        rows.append(row)
    return rows


def run_agent(eng: Engine, t: Timers, turns: int, drops: bool, seed: int) -> tuple[float, list]:
    """peers.py's agent workload in process: its segments and cache operations, greedy."""
    rng = np.random.default_rng(seed)
    sz = Sizes(turns=turns)
    system = random_ids(rng, sz.system)
    convs = []
    for _ in range(sz.conversations):
        task = random_ids(rng, sz.task)
        tools = [random_ids(rng, int(rng.integers(sz.tool - 50, sz.tool + 51)))
                 for _ in range(turns)]
        convs.append({"segs": [system, task], "tools": tools, "turn": 0, "out": []})
    sp = SamplingParams(max_new_tokens=sz.agent_new, ignore_eos=True)
    by_rid: dict[str, dict] = {}

    def submit(c: dict) -> None:
        j = c["turn"]
        c["segs"] = [*c["segs"], c["tools"][j]]
        ops = ({"drop": {str(2 + 2 * i): [2 + 2 * (i - 1)] for i in range(1, j + 1)}}
               if drops and j >= 1 else None)
        rid = f"a{len(by_rid)}"
        by_rid[rid], c["out"] = c, []
        eng.add_request(GenerateRequest(rid, c["segs"], parse_history(ops, len(c["segs"])), sp))

    eng.flush_cache()
    for c in convs:
        submit(c)
    steps = []
    t0 = time.perf_counter()
    while eng.has_work():
        t.step.clear()
        s0 = time.perf_counter()
        events = eng.step()
        steps.append((time.perf_counter() - s0, dict(t.step)))
        for ev in events:
            c = by_rid[ev.rid]
            c["out"].append(ev.token_id)
            if ev.finished:
                if ev.error:
                    raise RuntimeError(ev.error)
                c["segs"] = [*c["segs"], c["out"]]
                c["turn"] += 1
                if c["turn"] < turns:
                    submit(c)
    return time.perf_counter() - t0, steps


def report_agent(wall: float, steps: list) -> None:
    pre = [(dt, s) for dt, s in steps if s.get("prefill_rows")]
    dec = [(dt, s) for dt, s in steps if not s.get("prefill_rows")]
    print(f"agent wall {wall:.2f} s, {len(steps)} steps")
    for name, group in (("with a prefill forward", pre), ("decode only", dec)):
        if not group:
            continue
        rows = sorted(int(s.get("prefill_rows", 0)) for _, s in group)
        dec_rows = sorted({int(s.get("decode_rows", 0)) for _, s in group})
        print(f"  steps {name:22s} {len(group):4d}  {sum(dt for dt, _ in group):7.2f} s, "
              f"median {statistics.median(dt for dt, _ in group) * 1e3:7.1f} ms; "
              f"decode rows {dec_rows}" + (f"; prefill rows {rows}" if name[0] == "w" else ""))


def report(name: str, rows: list[dict]) -> None:
    med = {k: statistics.median(r[k] for r in rows) * 1e3 for k in (*STAGES, "total", "cpu")}
    parts = ", ".join(f"{k} {med[k]:.2f}" for k in STAGES)
    print(
        f"{name:22s} steps {len(rows):3d}  total {med['total']:8.2f} ms "
        f"(process CPU {med['cpu']:.2f} ms): {parts}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--steps", type=int, default=32, help="decode tokens per request")
    ap.add_argument("--prefill", type=int, default=2000)
    ap.add_argument("--agent-turns", type=int, default=0,
                    help="also peers.py's agent workload with this many turns (0: skip)")
    ap.add_argument("--drops", action="store_true", help="the agent workload with its drops")
    args = ap.parse_args(argv)
    model = load_model(None if args.model == "default" else args.model, "float32")
    eng = Engine(model, max_total_tokens=16384, max_running=16)
    t = Timers()
    instrument(t)
    rng = np.random.default_rng(0)
    V = model.cfg.vocab_size

    def prompts(b, n):
        return rng.integers(100, V - 100, (b, n)).tolist()

    cases = [("decode batch 1", 1, 256), ("decode batch 8", 8, 256)]
    for name, b, n in cases:
        run_scenario(eng, t, prompts(b, n), 4)  # compile
        rows = run_scenario(eng, t, prompts(b, n), args.steps)
        report(f"{name} (prefill)", rows[:1])
        report(name, rows[1:])
    run_scenario(eng, t, prompts(1, args.prefill), 1)  # compile
    for n in (args.prefill, args.prefill + 100):
        run_scenario(eng, t, prompts(1, n), 1)  # compile this length's shape
        rows = [run_scenario(eng, t, prompts(1, n), 1)[0] for _ in range(3)]
        report(f"prefill {n} cold", rows)
    if args.agent_turns:
        run_agent(eng, t, 3, args.drops, seed=99)  # compile its step shapes
        report_agent(*run_agent(eng, t, args.agent_turns, args.drops, seed=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
