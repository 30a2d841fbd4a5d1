"""The fused XLA:CPU attention kernel (akv_jax/kernels/cpu/attention.cc) against the jnp
reference and the float64 numpy oracle, and the dispatcher's choice between it and the
chunked jnp path."""

from __future__ import annotations

import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pallas_cases as cases
import pytest
from pallas_cases import assert_close, case_of_kind, dense_oracle

from akv_jax.kernels.cpu import attention as cpu_attention
from akv_jax.kernels.cpu import ffi as cpu_ffi
from akv_jax.pallas.chunked import segment_attention_chunked
from akv_jax.pallas.dispatch import make_attention_fn
from akv_jax.pallas.metadata import SegmentSpec, build_segment_batch
from akv_jax.pallas.reference import segment_attention_reference
from akv_jax.pallas.segment_attention_cpu import segment_attention_cpu


def test_kernel_builds_here():
    """CI's machines have a C++ compiler: the kernel must build and register there, not fall
    back to the jnp path unnoticed."""
    assert shutil.which("g++") or shutil.which("c++"), "no C++ compiler on this machine"
    assert cpu_attention.available()


# Head dims 16 (one vector a row), 64 (SmolLM2, GPT-OSS) and 80 (not a power of two);
# groups 4 (decode rows fill one register tile) and 1.
@pytest.mark.parametrize("kind", ["decode", "prefill", "restore", "long"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_kernel_matches_reference(kind, page_size):
    case = case_of_kind(kind, page_size=page_size)
    for head_dim, group in ((16, 4), (64, 1), (80, 3)):
        q, k, v, batch = cases.materialize(
            case, np.random.default_rng(2), num_kv_heads=2, group=group, head_dim=head_dim
        )
        scale = head_dim**-0.5
        want = segment_attention_reference(q, k, v, batch, block_q=case.block_q, sm_scale=scale)
        fn = functools.partial(segment_attention_cpu, block_q=case.block_q, sm_scale=scale)
        got = jax.jit(fn)(q, k, v, batch)
        assert_close(got, want, jnp.float32)


@pytest.mark.parametrize("window", [None, 1, 5, 33])
def test_kernel_sinks_and_window_match_oracle(window):
    case = case_of_kind("restore", page_size=16)
    q, k, v, batch = cases.materialize(
        case, np.random.default_rng(1), num_kv_heads=2, group=3, head_dim=16
    )
    sinks = jnp.linspace(-1.0, 2.0, 6)
    got = segment_attention_cpu(q, k, v, batch, block_q=case.block_q, sm_scale=0.25,
                                sinks=sinks, sliding_window=window)
    want = dense_oracle(q, k, v, case.specs, 16, 0.25, sinks=sinks, window=window)
    assert_close(got, want, jnp.float32)


def test_kernel_unmasked_tiles_inside_a_window_match_oracle():
    """A window wider than a key tile plus a register tile's rows: the tiles that lie whole
    inside every row's window (and before the block's first row) take the kernel's unmasked
    path; the tiles at the window's far edge and on the diagonal stay masked. 512 rows in
    blocks of 64, SmolLM2's head dim and group (register tiles of 6 rows on AVX2)."""
    case = case_of_kind("long", page_size=16)
    q, k, v, batch = cases.materialize(
        case, np.random.default_rng(4), num_kv_heads=2, group=3, head_dim=64
    )
    sinks = jnp.linspace(-1.0, 2.0, 6)
    for window in (150, None):
        got = segment_attention_cpu(q, k, v, batch, block_q=case.block_q, sm_scale=0.125,
                                    sinks=sinks, sliding_window=window)
        want = dense_oracle(q, k, v, case.specs, 16, 0.125, sinks=sinks, window=window)
        assert_close(got, want, jnp.float32)


def test_kernel_tiles_nan_pool_and_padding_segments():
    """Views longer than one 128-key tile whose block ranges start past page 0 (window), a
    dropped span in the middle of a tile, a padding segment, pool slots outside every view
    holding NaN, and rows past a block's q_len: against the reference, on a stacked pool."""
    ps, Hkv, G, Dh, block_q = 4, 2, 3, 16, 8
    rng = np.random.default_rng(7)
    k, v = cases.poisoned_pools(rng, 120, ps, Hkv, Dh, poisoned_from=100)
    vis_b = np.ones(118, bool)
    vis_b[40:57] = False  # dropped span
    segs = [
        SegmentSpec(q_start=0, q_len=30, pages=list(range(0, 70)), kv_visible=np.ones(279, bool),
                    causal_pos=249),
        SegmentSpec(q_start=30, q_len=13, pages=list(range(70, 100)), kv_visible=vis_b,
                    causal_pos=105),
    ]
    batch = build_segment_batch(segs, page_size=ps, block_q=block_q, num_segments=4,
                                max_pages=80)
    q = jnp.asarray(rng.standard_normal((48, Hkv * G, Dh)).astype(np.float32))
    noise = jnp.asarray(rng.standard_normal(k.shape).astype(np.float32))
    k_all = jnp.stack([noise, jnp.asarray(k)])
    v_all = jnp.stack([noise, jnp.asarray(v)])
    sinks = jnp.linspace(-1.0, 1.0, Hkv * G)
    for w, s in ((None, None), (9, sinks), (130, None)):
        want = segment_attention_reference(q, jnp.asarray(k), jnp.asarray(v), batch,
                                           block_q=block_q, sm_scale=0.3, sinks=s,
                                           sliding_window=w)
        got = segment_attention_cpu(q, k_all, v_all, batch, block_q=block_q, sm_scale=0.3,
                                    sinks=s, sliding_window=w, layer=jnp.int32(1))
        assert_close(got[:43], want[:43], jnp.float32)
        assert not np.asarray(got[43:]).any(), "rows no block covers come out as zeros"


def test_kernel_chunks_fold_to_the_same_bits_however_shared_out():
    """One query token over a view of ~3,400 keys (four 1,024-key chunks, a dropped span
    across a chunk's edge, a window, sinks, a NaN pool outside the view). Alone it is fewer
    items than threads, so each chunk runs as an item of its own and the chunks fold
    afterwards; beside a second segment every chunk runs in one item. Both match the
    float64 oracle and each other bit for bit."""
    assert os.cpu_count() >= 2, "one core never splits a step: the test would prove nothing"
    ps, Hkv, G, Dh, block_q = 16, 1, 3, 16, 8
    rng = np.random.default_rng(11)
    k, v = cases.poisoned_pools(rng, 400, ps, Hkv, Dh, poisoned_from=300)
    n = 3400
    vis = np.ones(n, bool)
    vis[1000:1100] = False  # dropped, across the first chunk's end
    long = SegmentSpec(q_start=0, q_len=1, pages=list(range(0, 213)), kv_visible=vis,
                       causal_pos=n - 1)
    other = SegmentSpec(q_start=1, q_len=5, pages=list(range(213, 300)),
                        kv_visible=np.ones(1000, bool), causal_pos=995)
    q = jnp.asarray(rng.standard_normal((8, Hkv * G, Dh)).astype(np.float32))
    sinks = jnp.linspace(-1.0, 1.0, Hkv * G)
    for w, s in ((None, None), (2500, sinks)):
        outs = []
        for specs in ([long], [long, other]):
            batch = build_segment_batch(specs, page_size=ps, block_q=block_q, num_segments=2)
            got = segment_attention_cpu(q, jnp.asarray(k), jnp.asarray(v), batch,
                                        block_q=block_q, sm_scale=0.25, sinks=s,
                                        sliding_window=w)
            want = dense_oracle(q, k, v, specs, ps, 0.25, sinks=s, window=w)
            assert_close(got[: sum(sp.q_len for sp in specs)],
                          want[: sum(sp.q_len for sp in specs)], jnp.float32)
            outs.append(np.asarray(got[:1]))
        assert outs[0].tobytes() == outs[1].tobytes(), f"window {w}: bits depend on the split"


def _ffi_targets(fn, *args) -> str:
    # A new function each time: make_jaxpr caches traces by function and argument types.
    return str(jax.make_jaxpr(lambda *a: fn(*a))(*args))


def test_dispatch_auto_uses_kernel_and_falls_back(monkeypatch):
    """"auto" on the CPU runs the kernel for float32; bfloat16, or the kernel switched off,
    runs the chunked jnp path, with the same answer."""
    case = case_of_kind("prefill", page_size=16)
    q, k, v, batch = cases.materialize(
        case, np.random.default_rng(3), num_kv_heads=2, group=3, head_dim=16
    )
    fn = make_attention_fn("auto", block_q=case.block_q, sm_scale=0.25, platform="cpu")
    assert cpu_attention.TARGET in _ffi_targets(fn, q, k, v, batch)
    want = segment_attention_reference(q, k, v, batch, block_q=case.block_q, sm_scale=0.25)
    assert_close(fn(q, k, v, batch), want, jnp.float32)

    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    assert cpu_attention.TARGET not in _ffi_targets(fn, qb, kb, vb, batch)
    chunked = segment_attention_chunked(qb, kb, vb, batch, block_q=case.block_q,
                                        sm_scale=0.25)
    np.testing.assert_array_equal(np.asarray(fn(qb, kb, vb, batch), np.float32),
                                  np.asarray(chunked, np.float32))

    monkeypatch.setenv("AKV_JAX_CPU_KERNEL", "0")
    cpu_ffi.reset()
    try:
        assert not cpu_attention.available()
        assert cpu_attention.TARGET not in _ffi_targets(fn, q, k, v, batch)
        with pytest.raises(RuntimeError, match="not available"):
            segment_attention_cpu(q, k, v, batch, block_q=case.block_q, sm_scale=0.25)
    finally:
        monkeypatch.delenv("AKV_JAX_CPU_KERNEL")
        cpu_ffi.reset()
    assert cpu_attention.available()
