"""Prefill and decode throughput of the serving engine at tensor-parallel degrees 1/2/4/8.

Runs on 8 forced host CPU devices (the script sets XLA_FLAGS before importing jax). They all
share this machine's two cores, so tp > 1 measures the partitioning overhead, not a speed-up:
on real accelerators each device brings its own compute and bandwidth.

    python bench/tp.py [--requests 8] [--prompt 256] [--new 32] [--runs 3]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from akv_jax.cache.ops import OpHistory  # noqa: E402
from akv_jax.model.config import ModelConfig, RopeConfig  # noqa: E402
from akv_jax.model.params import seeded_params  # noqa: E402
from akv_jax.serving.engine import Engine  # noqa: E402
from akv_jax.serving.types import GenerateRequest, SamplingParams  # noqa: E402

# kv heads 8, q heads 16, ffn 1024: every degree up to 8 shards heads and the FFN.
CFG = ModelConfig(
    arch="llama",
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    num_layers=4,
    num_heads=16,
    num_kv_heads=8,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope=RopeConfig(theta=10000.0),
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def one_run(eng: Engine, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) for one batch of requests."""
    eng.flush_cache()
    for i, p in enumerate(prompts):
        eng.add_request(
            GenerateRequest(
                f"r{i}",
                [p],
                OpHistory.empty(1),
                SamplingParams(max_new_tokens=new, ignore_eos=True),
            )
        )
    t0 = time.perf_counter()
    eng.step()  # all prompts fit one prefill step (prefill_chunk is large)
    t1 = time.perf_counter()
    n_dec = 0
    while eng.has_work():
        n_dec += len(eng.step())
    t2 = time.perf_counter()
    return sum(map(len, prompts)) / (t1 - t0), n_dec / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="bench/results/tp.json")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CFG.vocab_size, args.prompt).tolist() for _ in range(args.requests)]
    model = SimpleNamespace(cfg=CFG, params=seeded_params(CFG, 0), tokenizer=None)
    results = {}
    for tp in (1, 2, 4, 8):
        eng = Engine(
            model,
            max_total_tokens=16384,
            page_size=16,
            tp=tp,
            prefill_chunk=1 << 20,
            max_running=args.requests,
        )
        one_run(eng, prompts, args.new)  # compile
        runs = [one_run(eng, prompts, args.new) for _ in range(args.runs)]
        results[tp] = dict(
            prefill_tok_s=statistics.median(r[0] for r in runs),
            decode_tok_s=statistics.median(r[1] for r in runs),
        )
        print(
            f"tp={tp}: prefill {results[tp]['prefill_tok_s']:.0f} tok/s, "
            f"decode {results[tp]['decode_tok_s']:.1f} tok/s",
            flush=True,
        )
    out = dict(
        devices=[str(d) for d in jax.devices()],
        requests=args.requests,
        prompt=args.prompt,
        new_tokens=args.new,
        runs=args.runs,
        note="8 host CPU devices sharing 2 cores",
        results=results,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    base = results[1]
    print(
        "tp: "
        + ", ".join(
            f"tp{tp} prefill {r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x "
            f"decode {r['decode_tok_s'] / base['decode_tok_s']:.2f}x"
            for tp, r in results.items()
        )
        + " (vs tp1; CPU devices share 2 cores)"
    )


if __name__ == "__main__":
    main()
