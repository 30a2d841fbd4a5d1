"""Decode-step time and attention time against the fraction of KV still active (equal batch).

    python bench/decode_attention.py [--configs tiny smollm2] [--batch 8] [--context 4096]
                                     [--fractions 1 0.75 0.5 0.25 0.125] [--repeats 15]

Paper reference (A.4.1): at equal batch, dropping old tool KV cut full-attention time by 59.8%
and the whole decode step by 16%.

Setup. ``batch`` sequences, each with a ``context``-token paged view (page size 16), decode one
token each: the query sits at the last position and attends causally to its whole view, in
which a fraction ``1 - f`` of the pages holds only dropped tokens (invisible; spread evenly
through the middle of the history, the first and last pages always active, as with a rolling
drop of old tool responses). Random weights: ``tiny`` is the server's ``--model-path tiny``
(2 layers, hidden 48, 4,096 positions); ``smollm2`` has SmolLM2-135M's shapes (30 layers, 9/3
heads of 64, hidden 576), where attention over 4K tokens is a real share of a step.

Timed, each jit-compiled (compile excluded), median of ``repeats`` runs:

* ``attention``: one layer's segment-batch attention call alone, as the engine calls it for a
  decode step (``block_q=1``): the implementation :mod:`akv_jax.pallas.dispatch` picks for
  ``--attention-backend auto`` on this backend;
* ``step``: the engine's whole decode step (:func:`akv_jax.model.forward.forward` over the
  paged pool, KV write included, logits of every row), with that attention;
* the same two with ``visible pages only``: the page table holds just the pages with an
  active token (the view a page-skipping kernel reads; same outputs, checked), i.e. what the
  work costs when invisible pages are skipped rather than masked.

On the CPU, ``auto`` is the chunked jnp attention (:mod:`akv_jax.pallas.chunked`), which, like
the Pallas kernels on GPU/TPU, reads only the visible pages :mod:`akv_jax.pallas.plan` gives it;
the ``reference`` row is the jnp reference, which *masks* invisible slots and still reads every
page, so its time does not fall with the active fraction. (The Pallas kernels run on the CPU only
in interpret mode, for tests.)
The script says which one it measured. Results: bench/results/decode_attention.json and
decode_attention.png; the last line printed is a summary.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import git_head, interleaved_medians

from akv_jax.model.config import ModelConfig, RopeConfig
from akv_jax.model.forward import KVPool, KVWrites, forward
from akv_jax.model.params import seeded_params
from akv_jax.model.presets import tiny_config
from akv_jax.model.rope import rope_table_for
from akv_jax.pallas.dispatch import make_attention_fn
from akv_jax.pallas.metadata import SegmentSpec, bucket, build_segment_batch

RESULTS = Path(__file__).resolve().parent / "results"
PAGE_SIZE = 16


def smollm2_shape() -> ModelConfig:
    """SmolLM2-135M's shapes (weights are random here: only the timing matters)."""
    return ModelConfig(
        arch="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=100000.0),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )


CONFIGS = {"tiny": tiny_config, "smollm2": smollm2_shape}


def visible_pages(num_pages: int, fraction: float) -> np.ndarray:
    """[num_pages] bool: ``round(fraction * num_pages)`` active pages, first and last always,
    the rest spread evenly (dropped pages sit between kept ones, as after rolling drops)."""
    n = max(2, round(fraction * num_pages)) if num_pages > 1 else 1
    idx = np.unique(np.round(np.linspace(0, num_pages - 1, n)).astype(int))
    out = np.zeros(num_pages, bool)
    out[idx] = True
    return out


def make_batch(batch: int, context: int, fraction: float, compact: bool):
    """(SegmentBatch, slots [B], positions [B]) for one decode step of every sequence.

    Sequence b owns pages ``b * P .. b * P + P - 1``. With ``compact`` the page table lists only
    the active pages (what a page-skipping kernel reads)."""
    P = context // PAGE_SIZE
    vis_pages = visible_pages(P, fraction)
    specs, slots, positions = [], [], []
    for b in range(batch):
        pages = b * P + np.arange(P)
        slot_vis = np.repeat(vis_pages, PAGE_SIZE)
        if compact:
            pages = pages[vis_pages]
            slot_vis = np.ones(len(pages) * PAGE_SIZE, bool)
        specs.append(
            SegmentSpec(
                q_start=b,
                q_len=1,
                pages=pages.tolist(),
                kv_visible=slot_vis,
                causal_pos=len(slot_vis) - 1,
            )
        )
        slots.append((b * P + P - 1) * PAGE_SIZE + PAGE_SIZE - 1)  # the last slot: the query
        positions.append(context - 1)
    seg_batch = build_segment_batch(
        specs,
        page_size=PAGE_SIZE,
        block_q=1,
        num_blocks=bucket(batch, 8),
        num_segments=bucket(batch, 8),
        max_pages=len(specs[0].pages),
    )
    return seg_batch, np.asarray(slots, np.int32), np.asarray(positions, np.int32)


VARIANTS = (
    # (label, attention backend flag, page table of active pages only)
    ("auto", "auto", False),
    ("reference", "reference", False),
    ("visible_only", "reference", True),
)


def implementation_name(fn) -> str:
    """The function behind a (possibly partial) attention callable."""
    inner = getattr(fn, "func", fn)
    return getattr(inner, "__name__", repr(inner))


def measure(cfg_name: str, batch: int, context: int, fractions: list[float], repeats: int) -> dict:
    cfg = CONFIGS[cfg_name]()
    context = min(context, cfg.max_position_embeddings)
    params = seeded_params(cfg, 0)
    rope = rope_table_for(cfg)
    P = context // PAGE_SIZE
    total_pages = batch * P
    rng = np.random.default_rng(0)
    shape = (cfg.num_layers, total_pages, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim)
    state = {
        "kv": KVPool(
            k=jnp.asarray(rng.standard_normal(shape, np.float32)),
            v=jnp.asarray(rng.standard_normal(shape, np.float32)),
        )
    }
    k0 = state["kv"].k[0]
    v0 = state["kv"].v[0]
    T = bucket(batch, 8)
    q = jnp.asarray(rng.standard_normal((T, cfg.num_heads, cfg.head_dim), np.float32))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, T), jnp.int32)

    attn_fns, step_fns, names, outs = {}, {}, {}, {}
    for label, backend, compact in VARIANTS:
        attention = make_attention_fn(backend, block_q=1, sm_scale=cfg.head_dim**-0.5)
        names[label] = implementation_name(attention)
        attn_jit = jax.jit(attention)
        step_jit = jax.jit(
            functools.partial(forward, cfg=cfg, rope=rope, attention=attention),
            donate_argnames=("kv",),
        )
        for f in fractions:
            batch_md, slots, pos = make_batch(batch, context, f, compact)
            outs[label, f] = np.asarray(attn_jit(q, k0, v0, batch_md))[:batch]
            attn_fns[label, f] = functools.partial(
                lambda j, b: j(q, k0, v0, b).block_until_ready(), attn_jit, batch_md
            )
            sl = np.full(T, total_pages * PAGE_SIZE, np.int32)  # padding rows write nowhere
            sl[:batch] = slots
            qp = np.zeros(T, np.int32)
            qp[:batch] = pos
            writes = KVWrites(slots=jnp.asarray(sl[None]), positions=jnp.asarray(qp[None]))
            q_positions = jnp.asarray(qp)

            def step(j=step_jit, b=batch_md, w=writes, qp=q_positions):
                logits, state["kv"] = j(
                    params, tokens=tokens, q_positions=qp, kv=state["kv"], writes=w, batch=b
                )
                logits.block_until_ready()

            step_fns[label, f] = step
    attn_t = interleaved_medians(attn_fns, repeats)
    step_t = interleaved_medians(step_fns, max(3, repeats // 2))

    rows = []
    for f in fractions:
        row: dict = {"fraction": f, "active_pages": int(visible_pages(P, f).sum()), "pages": P}
        for label, _, _ in VARIANTS:
            row[f"attention_{label}_ms"] = 1e3 * attn_t[label, f]
            row[f"step_{label}_ms"] = 1e3 * step_t[label, f]
            # every variant must give the same attention output: they see the same keys
            row[f"max_abs_diff_{label}"] = float(
                np.max(np.abs(outs[label, f] - outs["reference", f]))
            )
        rows.append(row)
        print(
            f"  {cfg_name} f={f:<5} attention "
            + "  ".join(f"{lab} {row[f'attention_{lab}_ms']:8.3f}" for lab, _, _ in VARIANTS)
            + " ms | step "
            + "  ".join(f"{lab} {row[f'step_{lab}_ms']:8.2f}" for lab, _, _ in VARIANTS)
            + " ms",
            flush=True,
        )
    for row in rows:
        for label, _, _ in VARIANTS:
            for kind in ("attention", "step"):
                key = f"{kind}_{label}_ms"
                row[f"{kind}_{label}_change"] = row[key] / rows[0][key] - 1
    return {
        "config": cfg_name,
        "batch": batch,
        "context": context,
        "implementations": names,
        "rows": rows,
    }


SKIPPING = {
    "segment_attention_chunked",
    "segment_attention_gpu",
    "segment_attention_tpu",
    "attention",
}  # "attention": dispatch's wrapper around a Pallas kernel body


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        fr = [r["fraction"] for r in res["rows"]]
        names = res["implementations"]
        for key, label, style in (
            ("attention_auto_ms", f"attention, auto ({names['auto']})", "o-"),
            ("attention_reference_ms", "attention, reference (masks)", "o:"),
            ("attention_visible_only_ms", "attention, reference on active pages", "o--"),
            ("step_auto_ms", "decode step, auto", "s-"),
            ("step_reference_ms", "decode step, reference", "s:"),
        ):
            base = res["rows"][0][key]
            ax.plot(fr, [r[key] / base for r in res["rows"]], style, label=label)
        ax.plot(fr, fr, "-", color="lightgray", label="proportional to active KV")
        ax.set_xlabel("fraction of KV pages active")
        ax.set_ylabel("time / time at 100% active")
        ax.set_title(f"{res['config']}: batch {res['batch']}, context {res['context']}")
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["tiny", "smollm2"], choices=list(CONFIGS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.75, 0.5, 0.25, 0.125])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.fractions[0] != 1.0:
        args.fractions = [1.0, *args.fractions]
    results = [
        measure(c, args.batch, args.context, args.fractions, args.repeats) for c in args.configs
    ]
    auto = results[0]["implementations"]["auto"]
    skips = auto in SKIPPING
    note = (
        f"attention on {jax.default_backend()} with --attention-backend auto: {auto} ("
        + (
            "reads only the pages holding active tokens"
            if skips
            else "masks invisible slots and still reads every page"
        )
        + "); 'reference' masks; 'visible_only' is the reference given only the active pages"
    )
    print(note, flush=True)
    out = {
        "note": note,
        "auto_implementation": auto,
        "auto_skips_invisible_pages": skips,
        "paper": {"attention_change": -0.598, "step_change": -0.16},
        "results": results,
        "command": " ".join(["python", *sys.argv]),
        "git_head": git_head(),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "jax": jax.__version__,
            "backend": jax.default_backend(),
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_attention.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(results, args.out / "decode_attention.png")
    parts = []
    for res in results:
        r = min(res["rows"], key=lambda r: abs(r["fraction"] - 0.25))
        parts.append(
            f"{res['config']} at {r['fraction']:.0%} active KV: attention "
            f"{r['attention_auto_change']:+.0%} (reference {r['attention_reference_change']:+.0%}),"
            f" decode step {r['step_auto_change']:+.0%} (reference "
            f"{r['step_reference_change']:+.0%})"
        )
    print(
        f"decode_attention [{auto}, {'skips' if skips else 'masks'} invisible pages]: "
        + "; ".join(parts)
        + " -- paper: attention -59.8%, step -16%"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
