"""One-pass restore vs op-by-op replay vs a plain causal prefill of the same tokens.

A 24-segment history with 12 drops and 2 repositions on a small random model (CPU, float32;
``--backend auto`` is the chunked jnp attention on the CPU). Every path is compiled first;
each is then timed several times and the medians are reported, with ratios measured in this
same run.

    python bench/restore.py [--runs 7] [--out bench/results/restore.json]

The JSON goes to ``--out`` if given, else to a temporary file (its path is printed), so a run
never overwrites the tracked result unless asked to.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import jax
import numpy as np
from common import interleaved_medians

from akv_jax.cache.core import CacheOps, restore
from akv_jax.cache.ops import OpHistory, parse_history
from akv_jax.model.config import ModelConfig, RopeConfig
from akv_jax.model.params import seeded_params

SMALL = ModelConfig(
    arch="qwen3",
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=768,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    rope=RopeConfig(theta=1e6),
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def agent_history(rng: np.random.Generator, n: int = 24):
    """Alternating short 'reasoning' and long 'tool response' segments; 12 tool responses
    dropped (rolling window), repositions at two boundaries after middle drops."""
    lens = [
        int(rng.integers(16, 40)) if s % 2 == 0 else int(rng.integers(60, 110)) for s in range(n)
    ]
    segs = [rng.integers(0, SMALL.vocab_size, size=m).tolist() for m in lens]
    tools = [s for s in range(n) if s % 2 == 1]
    drops: dict[str, list[int]] = {}
    for seg in tools[:12]:  # each of the first 12 tool responses is dropped 4 segments on
        b = min(seg + 4, n - 1)
        drops.setdefault(str(b), []).append(seg)
    return segs, parse_history({"drop": drops, "reposition": [11, 19]}, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--block-q", type=int, default=32)
    ap.add_argument("--backend", default="auto", choices=["auto", "reference", "pallas"])
    ap.add_argument("--out", type=Path, default=None,
                    help="results JSON (default: a temporary file, printed)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    segs, hist = agent_history(rng)
    T = sum(map(len, segs))
    capacity = ((T + 255) // 256) * 256
    params = seeded_params(SMALL, 0)
    ops = CacheOps(SMALL, backend=args.backend, block_q=args.block_q)
    flat = [t for s in segs for t in s]

    def one_pass():
        lg, st = restore(
            params,
            SMALL,
            segs,
            hist,
            max_tokens=capacity,
            block_q=args.block_q,
            backend=args.backend,
        )
        jax.block_until_ready((lg, st))

    def op_by_op():
        lg, st = ops.run(params, ops.empty(capacity), segs, hist)
        jax.block_until_ready((lg, st))

    def plain():
        lg, st = restore(
            params,
            SMALL,
            [flat],
            OpHistory.empty(1),
            max_tokens=capacity,
            block_q=args.block_q,
            backend=args.backend,
        )
        jax.block_until_ready((lg, st))

    med = interleaved_medians(dict(one_pass=one_pass, op_by_op=op_by_op, plain=plain), args.runs)
    t_one, t_ops, t_plain = med["one_pass"], med["op_by_op"], med["plain"]
    result = dict(
        model=dataclasses.asdict(SMALL),
        tokens=T,
        segments=len(segs),
        drops=sum(len(v) for v in hist.drops.values()),
        repositions=len(hist.repos),
        block_q=args.block_q,
        attention_backend=args.backend,
        runs=args.runs,
        backend=jax.default_backend(),
        median_s=dict(one_pass=t_one, op_by_op=t_ops, plain_prefill=t_plain),
        one_pass_speedup_vs_op_by_op=t_ops / t_one,
        one_pass_over_plain_prefill=t_one / t_plain,
    )
    out = args.out or Path(tempfile.mkstemp(prefix="restore-", suffix=".json")[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["median_s"]), f"tokens={T}")
    print(f"results: {out}")
    print(
        f"restore: one-pass {t_ops / t_one:.2f}x faster than op-by-op, "
        f"{t_one / t_plain:.2f}x of plain prefill"
    )


if __name__ == "__main__":
    main()
