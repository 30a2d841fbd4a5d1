"""Where a serving step's time goes: host scheduling, packing, transfers, forward, sampling.

    PYTHONPATH=. python bench/profile_engine.py [--model default|tiny|PATH] [--steps 32]

Drives :class:`akv_jax.serving.engine.Engine` (the server's scheduler, planner, executor and
sampler) through three scenarios: decode at batch 1 and batch 8 (256-token prompts) and a cold
2,000-token prefill. Every stage is timed by wrapping the function that does it, and the
forward is made synchronous (``block_until_ready``) so its time is the device's:

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
