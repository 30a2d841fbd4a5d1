"""The GPT-OSS, Qwen3-MoE and MiniMax-M2 layers: grouped matmuls (ragged_dot) against a dense
all-experts einsum.

    python bench/moe.py [--tokens 64 256] [--scale 4] [--repeats 7] [--dtype bfloat16]
                        [--minimax-scale 8] [--families gpt_oss qwen3_moe minimax_m2]

Shapes are GPT-OSS-20B's MLP (hidden 2880, expert width 2880, 32 experts, top-4) divided by
``--scale`` in the two widths (rounded down to a multiple of 32, an MXFP4 block; the expert
count and top-k stay: they set the work ratio), so a layer fits this machine. Each variant is
one jit-compiled function of the same router and expert weights:

* **grouped** (``akv_jax.model.moe.moe_mlp``, what the model runs): the T*k (token, expert)
  pairs sorted by expert, three grouped matmuls (``akv_jax.pallas.grouped_matmul``: XLA's
  ``ragged_dot`` on GPU / TPU, a tiled scan on the CPU);
* **XLA ragged_dot** on this machine's backend, for the record (on the CPU XLA spreads it
  into a dense product over every expert, which is why the CPU path is the tiled scan);
* **dense all-experts** (the baseline): every token through every expert with one einsum per
  projection, outputs weighted by the routing weights (zero for experts not chosen).

Reported per token count: the median wall time of ``--repeats`` runs after a compile run,
tokens/s of each and their ratio, and the max difference of the two outputs (they compute
the same function). Memory: the bytes the expert weights take on the device dequantised to
``--dtype`` against the released MXFP4 layout (uint8 blocks + scales, ``converters/mxfp4``)
placed on the device the same way. (Serving with packed experts, ``--moe-weight-format
mxfp4``, is not built yet: this is the layout's footprint, not a serving run.)

The same comparison runs for the Qwen3-MoE router and experts (softmax over all experts in
float32, top-k renormalised, ``silu(gate) * up``, no biases) at Qwen3-30B-A3B's MLP shape
(hidden 2048, expert width 768, 128 experts, top-8; the two widths divided by ``--scale``):
one line per token count prefixed ``qwen3_moe``, then its summary line; and for MiniMax-M2's
layer (sigmoid router with ``e_score_correction_bias``, ``silu(gate) * up`` experts, no biases)
at MiniMax-M2's shapes (hidden 3072, expert width 1536, 256 experts, top-8) with both widths
divided by ``--minimax-scale`` (256 experts make the dense baseline 32x the routed work),
prefixed ``minimax_m2``. ``--families gpt_oss`` skips both.

Results go to bench/results/moe.json (all runs kept; the other families under their names);
the last line printed is the GPT-OSS summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from common import git_head, median_seconds

from akv_jax.model.moe import clamped_swiglu, moe_mlp, route, route_sigmoid, route_softmax_topk
from akv_jax.model.presets import tiny_config
from akv_jax.pallas import grouped_matmul as gmm
from converters import mxfp4

HERE = Path(__file__).resolve().parent
GPT_OSS_20B = dict(hidden=2880, expert_width=2880, experts=32, top_k=4)
QWEN3_30B_A3B = dict(hidden=2048, expert_width=768, experts=128, top_k=8)
MINIMAX_M2 = dict(hidden=3072, expert_width=1536, experts=256, top_k=8)


def make_layer(cfg, rng: np.random.Generator, dtype) -> SimpleNamespace:
    """Router and expert weights of one MoE layer (random, at realistic scales)."""
    D, F, E = cfg.hidden_size, cfg.expert_width, cfg.num_experts

    def w(*shape, fan_in):
        return jnp.asarray(rng.normal(0, fan_in**-0.5, shape), dtype)

    if cfg.arch in ("qwen3_moe", "minimax_m2"):  # no biases (MiniMax: a choice-only one)
        return SimpleNamespace(
            router=w(D, E, fan_in=D), router_bias=None,
            router_score_bias=(jnp.asarray(rng.normal(0, 0.1, E), dtype)
                               if cfg.sigmoid_router else None),
            expert_gate=w(E, D, F, fan_in=D), expert_gate_bias=None,
            expert_up=w(E, D, F, fan_in=D), expert_up_bias=None,
            expert_down=w(E, F, D, fan_in=F), expert_down_bias=None,
        )
    return SimpleNamespace(
        router=w(D, E, fan_in=D), router_bias=w(E, fan_in=1),
        expert_gate=w(E, D, F, fan_in=D), expert_gate_bias=w(E, F, fan_in=F),
        expert_up=w(E, D, F, fan_in=D), expert_up_bias=w(E, F, fan_in=F),
        expert_down=w(E, F, D, fan_in=F), expert_down_bias=w(E, D, fan_in=D),
    )


def dense_all_experts(cfg, lp, h: jax.Array) -> jax.Array:
    """Every token through every expert; the routing weights pick the k that count."""
    if cfg.arch in ("qwen3_moe", "minimax_m2"):
        return _dense_all_experts_swiglu(cfg, lp, h)
    experts, weights = route(cfg, lp, jnp.einsum("td,de->te", h, lp.router))
    dense_w = jnp.zeros((h.shape[0], cfg.num_experts), jnp.float32)
    dense_w = dense_w.at[jnp.arange(h.shape[0])[:, None], experts].set(weights)
    gate = jnp.einsum("td,edf->tef", h, lp.expert_gate) + lp.expert_gate_bias
    up = jnp.einsum("td,edf->tef", h, lp.expert_up) + lp.expert_up_bias
    act = clamped_swiglu(cfg, gate, up).astype(h.dtype)
    out = jnp.einsum("tef,efd->ted", act, lp.expert_down) + lp.expert_down_bias
    return jnp.einsum("ted,te->td", out, dense_w.astype(out.dtype)).astype(h.dtype)


def _dense_all_experts_swiglu(cfg, lp, h: jax.Array) -> jax.Array:
    """Qwen3-MoE's and MiniMax-M2's layer (plain SwiGLU experts, no biases), all experts."""
    router = route_sigmoid if cfg.sigmoid_router else route_softmax_topk
    experts, weights = router(cfg, lp, jnp.einsum("td,de->te", h, lp.router))
    dense_w = jnp.zeros((h.shape[0], cfg.num_experts), jnp.float32)
    dense_w = dense_w.at[jnp.arange(h.shape[0])[:, None], experts].set(weights)
    gate = jnp.einsum("td,edf->tef", h, lp.expert_gate)
    act = (jax.nn.silu(gate) * jnp.einsum("td,edf->tef", h, lp.expert_up)).astype(h.dtype)
    out = jnp.einsum("tef,efd->ted", act, lp.expert_down)
    return jnp.einsum("ted,te->td", out, dense_w.astype(out.dtype)).astype(h.dtype)


def _with_xla_ragged_dot(cfg, lp, h: jax.Array) -> jax.Array:
    """moe_mlp with XLA's ragged_dot as the grouped matmul, whatever the backend."""
    import akv_jax.model.moe as moe

    real = moe.grouped_matmul
    moe.grouped_matmul = lambda x, w, g: gmm.grouped_matmul(x, w, g, impl="ragged_dot")
    try:  # only while tracing: jit keeps the traced program
        return moe.moe_mlp(cfg, lp, h)
    finally:
        moe.grouped_matmul = real


def timed(fn, *args, repeats: int) -> float:
    """Median seconds of ``fn(*args)`` after a compile call."""
    return median_seconds(lambda: jax.block_until_ready(fn(*args)), repeats)


def expert_bytes(lp, dtype) -> tuple[int, int]:
    """(dequantised bytes, packed MXFP4 bytes) of the layer's expert matrices on the device."""
    dense = packed = 0
    for w in (lp.expert_gate, lp.expert_up, lp.expert_down):  # [E, in, out]
        dense += jax.device_put(w.astype(dtype)).nbytes
        blocks, scales = mxfp4.quantize(np.asarray(w, np.float32))
        packed += jax.device_put(blocks).nbytes + jax.device_put(scales).nbytes
    return dense, packed


def run_rows(cfg, lp, tokens, rng, dtype, repeats: int, prefix: str) -> list[dict]:
    """Grouped, XLA ragged_dot and dense all-experts timings of one layer per token count."""
    grouped = jax.jit(lambda h: moe_mlp(cfg, lp, h))
    xla = jax.jit(lambda h: _with_xla_ragged_dot(cfg, lp, h))
    dense = jax.jit(lambda h: dense_all_experts(cfg, lp, h))
    rows = []
    for T in tokens:
        h = jnp.asarray(rng.normal(0, 1, (T, cfg.hidden_size)), dtype)
        ref = dense(h).astype(jnp.float32)
        diff = float(jnp.max(jnp.abs(grouped(h).astype(jnp.float32) - ref)))
        t_grouped = timed(grouped, h, repeats=repeats)
        t_xla = timed(xla, h, repeats=repeats)
        t_dense = timed(dense, h, repeats=repeats)
        rows.append(dict(tokens=T, grouped_s=t_grouped, xla_ragged_dot_s=t_xla, dense_s=t_dense,
                         grouped_tok_s=T / t_grouped, dense_tok_s=T / t_dense,
                         ratio=t_dense / t_grouped, xla_ragged_dot_ratio=t_dense / t_xla,
                         max_abs_diff=diff))
        print(f"{prefix}T={T:5d}: grouped {T / t_grouped:8.1f} tok/s, XLA ragged_dot "
              f"{T / t_xla:8.1f}, dense all-experts {T / t_dense:8.1f}: grouped "
              f"{t_dense / t_grouped:.2f}x, ragged_dot {t_dense / t_xla:.2f}x of dense; "
              f"max |diff| {diff:.2e}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256])
    p.add_argument("--scale", type=int, default=4, help="divide GPT-OSS-20B's widths by this")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--minimax-scale", type=int, default=8,
                   help="divide MiniMax-M2's widths by this")
    p.add_argument("--families", nargs="+", default=["gpt_oss", "qwen3_moe", "minimax_m2"],
                   choices=["gpt_oss", "qwen3_moe", "minimax_m2"],
                   help="gpt_oss always runs (last line)")
    p.add_argument("--out", default=str(HERE / "results" / "moe.json"))
    args = p.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    # A multiple of 32, as MXFP4 blocks need (2880 = 90 blocks).
    width = GPT_OSS_20B["hidden"] // args.scale // mxfp4.BLOCK * mxfp4.BLOCK
    cfg = dataclasses.replace(
        tiny_config("gpt_oss"), hidden_size=width, intermediate_size=width,
        num_experts=GPT_OSS_20B["experts"], num_experts_per_tok=GPT_OSS_20B["top_k"],
    )
    rng = np.random.default_rng(0)
    lp = make_layer(cfg, rng, dtype)
    rows = run_rows(cfg, lp, args.tokens, rng, dtype, args.repeats, prefix="")
    others = {}
    for family, shape, scale, router, extra in (
        ("qwen3_moe", QWEN3_30B_A3B, args.scale, "softmax", dict(norm_topk_prob=True)),
        ("minimax_m2", MINIMAX_M2, args.minimax_scale, "sigmoid", {}),
    ):
        if family not in args.families:
            continue
        fcfg = dataclasses.replace(
            tiny_config(family), hidden_size=shape["hidden"] // scale,
            intermediate_size=shape["expert_width"] // scale, moe_intermediate_size=None,
            num_experts=shape["experts"], num_experts_per_tok=shape["top_k"], **extra,
        )
        frows = run_rows(fcfg, make_layer(fcfg, rng, dtype), args.tokens, rng, dtype,
                         args.repeats, prefix=f"{family} ")
        fratio = statistics.median(r["ratio"] for r in frows)
        others[family] = dict(
            shape=dict(hidden=fcfg.hidden_size, expert_width=fcfg.expert_width,
                       experts=fcfg.num_experts, top_k=fcfg.num_experts_per_tok),
            runs=frows, median_ratio=fratio,
        )
        print(f"{family}: ragged_dot {fratio:.2f}x of dense all-experts tokens/s "
              f"({fcfg.num_experts} experts top-{fcfg.num_experts_per_tok}, {router} router)")
    dense_b, packed_b = expert_bytes(lp, dtype)
    ratio = statistics.median(r["ratio"] for r in rows)
    mem = packed_b / dense_b
    result = dict(
        time=time.strftime("%Y-%m-%d %H:%M:%S"), git=git_head(), device=str(jax.devices()[0]),
        load_average=os.getloadavg()[0], settings=vars(args),
        shape=dict(hidden=width, expert_width=width, experts=cfg.num_experts,
                   top_k=cfg.num_experts_per_tok),
        runs=rows, median_ratio=ratio,
        expert_bytes=dict(dequantised=dense_b, packed_mxfp4=packed_b, ratio=mem),
    )
    result.update(others)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    history = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps([*history, result], indent=1) + "\n")
    print(f"expert weights: {dense_b / 2**20:.1f} MiB as {args.dtype}, "
          f"{packed_b / 2**20:.1f} MiB packed MXFP4")
    print(f"moe: ragged_dot {ratio:.2f}x of dense all-experts tokens/s, "
          f"packed MXFP4 experts {mem:.2f}x of dequantised memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
