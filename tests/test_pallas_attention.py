"""Segment-batch attention: jnp reference vs a dense numpy oracle, and both Pallas kernel
bodies (GPU/Triton and TPU/Mosaic, run in interpret mode on the CPU) vs the reference.

Every case fills the slots no segment may attend (spare pages, the tail of partial pages,
dropped slots) with NaN, so any stray read shows up as NaN in the output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pallas_cases as cases
import pytest
from pallas_cases import assert_close, case_of_kind, dense_oracle

from akv_jax.model.causal import greedy_generate
from akv_jax.model.params import init_params
from akv_jax.model.presets import tiny_config
from akv_jax.pallas import plan as plan_lib
from akv_jax.pallas.dispatch import make_attention_fn, resolve_backend
from akv_jax.pallas.metadata import SegmentSpec, build_segment_batch
from akv_jax.pallas.reference import segment_attention_reference
from akv_jax.pallas.segment_attention_gpu import segment_attention_gpu
from akv_jax.pallas.segment_attention_tpu import segment_attention_tpu

BODIES = {"gpu": segment_attention_gpu, "tpu": segment_attention_tpu}


# ---------------------------------------------------------------- reference vs numpy oracle


@pytest.mark.parametrize("kind", ["decode", "prefill", "restore"])
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "sinks+window"])
def test_reference_matches_dense_oracle(kind, extras):
    case = case_of_kind(kind, page_size=16)
    q, k, v, batch = cases.materialize(
        case, np.random.default_rng(1), num_kv_heads=2, group=3, head_dim=16
    )
    sinks = jnp.linspace(-1.0, 2.0, 6) if extras else None
    window = 33 if extras else None
    scale = 16**-0.5
    got = segment_attention_reference(
        q, k, v, batch, block_q=case.block_q, sm_scale=scale, sinks=sinks, sliding_window=window
    )
    want = dense_oracle(q, k, v, case.specs, 16, scale, sinks=sinks, window=window)
    assert_close(got, want, jnp.float32)


def test_reference_fully_masked_rows_are_zero():
    specs = [SegmentSpec(q_start=0, q_len=3, pages=[1], kv_visible=np.zeros(8, bool),
                         causal_pos=5)]
    batch = build_segment_batch(specs, page_size=8, block_q=4)
    q = jnp.ones((4, 2, 8))
    k = jnp.full((2, 8, 1, 8), jnp.nan)
    out = segment_attention_reference(q, k, k, batch, block_q=4, sm_scale=1.0)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


# ------------------------------------------------------------------- kernels vs reference

# (kind, group, page_size, dtype): every kind meets GQA groups 1, 3, 4, 8 and page sizes
# 1, 16, 64 somewhere, and both dtypes. Each case is one interpret-mode compile (seconds), so
# the TPU body, which has fewer users on the CPU, gets a subset.
KERNEL_CASES = [
    ("decode", 1, 16, jnp.float32),
    ("decode", 8, 1, jnp.float32),
    ("decode", 3, 64, jnp.bfloat16),
    ("prefill", 4, 16, jnp.float32),
    ("prefill", 1, 64, jnp.float32),
    ("prefill", 8, 16, jnp.bfloat16),
    ("restore", 3, 16, jnp.float32),
    ("restore", 4, 1, jnp.float32),
    ("restore", 8, 64, jnp.float32),
    ("restore", 1, 16, jnp.bfloat16),
]
TPU_CASES = [KERNEL_CASES[i] for i in (0, 2, 5, 6)]
_REFERENCE_CACHE: dict = {}


def _case_id(c):
    kind, g, ps, dt = c
    return f"{kind}-g{g}-ps{ps}-{jnp.dtype(dt).name}"


def _check_kernel(body, kind, group, page_size, dtype, head_dim=16, kernel_kw=None, **kw):
    case = case_of_kind(kind, page_size=page_size)
    q, k, v, batch = cases.materialize(
        case, np.random.default_rng(2), num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype
    )
    scale = head_dim**-0.5
    key = (kind, group, page_size, jnp.dtype(dtype).name, head_dim, tuple(sorted(kw)))
    if key not in _REFERENCE_CACHE:  # both bodies check against the same reference run
        _REFERENCE_CACHE[key] = segment_attention_reference(
            q, k, v, batch, block_q=case.block_q, sm_scale=scale, **kw
        )
    got = BODIES[body](
        q, k, v, batch, block_q=case.block_q, sm_scale=scale, interpret=True, **kw,
        **(kernel_kw or {}),
    )
    assert got.dtype == q.dtype and got.shape == q.shape
    assert_close(got, _REFERENCE_CACHE[key], dtype)
    if kind == "decode":  # the blind request
        np.testing.assert_array_equal(np.asarray(got[len(case.specs) - 1], np.float32), 0.0)


@pytest.mark.parametrize(
    "kind,group,page_size,dtype", KERNEL_CASES, ids=[_case_id(c) for c in KERNEL_CASES]
)
def test_gpu_kernel_matches_reference(kind, group, page_size, dtype):
    _check_kernel("gpu", kind, group, page_size, dtype)


@pytest.mark.parametrize(
    "kind,group,page_size,dtype", TPU_CASES, ids=[_case_id(c) for c in TPU_CASES]
)
def test_tpu_kernel_matches_reference(kind, group, page_size, dtype):
    _check_kernel("tpu", kind, group, page_size, dtype)


SINKS = jnp.asarray([0.5, -1.0, 2.0, 0.0, 1.5, -0.5, 3.0, 1.0])


@pytest.mark.parametrize("body,kind", [("gpu", "decode"), ("gpu", "restore"), ("tpu", "restore")])
def test_kernel_sinks_window_odd_head_dim(body, kind):
    """Sinks (an extra softmax term) and a sliding window, with a head dim of 24 (padded to 32
    lanes by the GPU body). The TPU body also cuts its 16-row blocks into tiles of 8 rows."""
    kernel_kw = {"max_tile_rows": 32} if body == "tpu" else None
    _check_kernel(body, kind, 4, 16, jnp.float32, head_dim=24, sinks=SINKS, sliding_window=29,
                  kernel_kw=kernel_kw)


def test_gpu_kernel_float32_head_dim_128_tiles():
    """float32 at head dim 128 takes 32-row tiles (64-row ones spill on sm_90: akv_jax.aot), so a
    64-row block is two tiles; same result as the reference."""
    _check_kernel("gpu", "restore", 4, 16, jnp.float32, head_dim=128)


def test_gpu_kernel_without_split():
    """The other tests' shapes get split-K by default (few programs); here one split."""
    case = case_of_kind("prefill", page_size=16)
    q, k, v, batch = cases.materialize(
        case, np.random.default_rng(3), num_kv_heads=2, group=4, head_dim=16
    )
    ref = segment_attention_reference(q, k, v, batch, block_q=case.block_q, sm_scale=0.25)
    got = segment_attention_gpu(
        q, k, v, batch, block_q=case.block_q, sm_scale=0.25, kv_splits=1, keys_per_step=16,
        interpret=True,
    )
    assert_close(got, ref, jnp.float32)


def test_gpu_kernel_full_tiles_give_a_decode_row_a_prefill_rows_bits():
    """``full_tiles`` (a deterministic attention): a decode step's one row, alone in its
    tile, has the bits of the same row in a 12-row prefill block over the same view, holes
    included; the view's pages start mid-list. Also within 1e-5 of the reference."""
    rng = np.random.default_rng(0)
    ps, hkv, group, dh = 8, 2, 3, 16
    k, v = (jnp.asarray(rng.standard_normal((40, ps, hkv, dh)), jnp.float32) for _ in "kv")
    q = jnp.asarray(rng.standard_normal((16, hkv * group, dh)), jnp.float32)
    pages = list(range(3, 26))  # 184 slots
    vis = np.ones(180, bool)
    vis[40:46] = vis[162:168] = False

    def run(spec, block_q, full_tiles=True):
        batch = build_segment_batch([spec], page_size=ps, block_q=block_q)
        return np.asarray(segment_attention_gpu(
            q, k, v, batch, block_q=block_q, sm_scale=0.25, kv_splits=1,
            full_tiles=full_tiles, interpret=True))

    prefill = run(SegmentSpec(0, 12, pages, vis, 168), 16)
    ref = segment_attention_reference(q, k, v, build_segment_batch(
        [SegmentSpec(0, 12, pages, vis, 168)], page_size=ps, block_q=16), block_q=16,
        sm_scale=0.25)
    np.testing.assert_allclose(prefill[:12], np.asarray(ref)[:12], atol=1e-5)
    for r in (0, 5, 11):
        decode = run(SegmentSpec(r, 1, pages, vis[: 169 + r], 168 + r), 1)
        np.testing.assert_array_equal(decode[r].view(np.int32), prefill[r].view(np.int32))


@pytest.mark.parametrize("body", ["gpu", "tpu"])
def test_kernel_512_rows(body):
    """The largest case: a 512-token prefill (8 blocks of 64 rows, cut into tiles)."""
    _check_kernel(body, "long", 4, 16, jnp.float32)


# -------------------------------------------------------------------------- page skipping


def test_plan_reads_only_visible_pages():
    """Each block's page range holds exactly the visible pages its rows can reach."""
    ps = 16
    case = case_of_kind("decode", page_size=ps)
    batch = case.batch()
    blocks = plan_lib.blocks_of(batch)
    plan = plan_lib.plan_pages(batch, blocks, page_size=ps)
    lo, hi, pages = map(np.asarray, (plan.lo, plan.hi, plan.pages))
    for b, spec in enumerate(case.specs):
        vis_pages = [
            p for i, p in enumerate(spec.pages) if spec.kv_visible[i * ps : (i + 1) * ps].any()
        ]
        assert lo[b] == 0 and hi[b] == len(vis_pages)
        assert pages[b, : hi[b]].tolist() == vis_pages
    # With half the spans dropped, the kernel reads fewer pages than the views hold.
    assert hi[: len(case.specs)].sum() < sum(len(s.pages) for s in case.specs)


def test_plan_sliding_window_and_causal_cut():
    ps = 8
    specs = [SegmentSpec(q_start=0, q_len=4, pages=list(range(10)),
                         kv_visible=np.ones(80, bool), causal_pos=40)]
    batch = build_segment_batch(specs, page_size=ps, block_q=4)
    plan = plan_lib.plan_pages(batch, plan_lib.blocks_of(batch), page_size=ps,
                               sliding_window=20)
    # Rows see slots 21..40 (first row) up to 24..43 (last row): pages 2..5.
    assert int(plan.lo[0]) == 2 and int(plan.hi[0]) == 6


def test_plan_window_counts_visible_slots():
    """A drop inside the window makes it reach further back: rows 60..63 with W = 20 and
    slots 44..55 dropped see 20 visible slots starting at 29..32 (not 41..44), so pages 3..
    are read; page 6 (48..55, all dropped) is skipped like any dropped page."""
    ps = 8
    vis = np.ones(80, bool)
    vis[44:56] = False
    specs = [SegmentSpec(q_start=0, q_len=4, pages=list(range(10)), kv_visible=vis,
                         causal_pos=60)]
    batch = build_segment_batch(specs, page_size=ps, block_q=4)
    blocks = plan_lib.blocks_of(batch)
    starts = plan_lib.row_window_starts(batch, blocks, 4, 20)
    assert np.asarray(starts)[0].tolist() == [29, 30, 31, 32]
    plan = plan_lib.plan_pages(batch, blocks, page_size=ps, sliding_window=20)
    # Compacted visible pages: 0 1 2 3 4 5 7 8 9; the block reads 3 4 5 7.
    assert int(plan.lo[0]) == 3 and int(plan.hi[0]) == 7
    assert np.asarray(plan.pages)[0, 3:7].tolist() == [3, 4, 5, 7]


# ------------------------------------------ sliding window over visible entries (DESIGN §2.1)

WINDOW_BACKENDS = ["reference", "chunked", "cpu", "gpu", "tpu"]
# (page_size, group, window, sinks): windows of one entry (itself), smaller than most views,
# and larger than any view (= full attention); GQA groups 1, 3, 4.
WINDOW_CASES = [(4, 3, 7, True), (8, 4, 1, False), (4, 1, 1000, True)]


def _attend(backend, q, k, v, batch, *, block_q, sm_scale, sinks, window):
    """The function under test, called the way the model calls it (sinks per call)."""
    if backend == "tpu":  # the TPU body, interpreted (no dispatch to it on the CPU)
        return segment_attention_tpu(q, k, v, batch, block_q=block_q, sm_scale=sm_scale,
                                     sinks=sinks, sliding_window=window, interpret=True)
    if backend == "cpu":  # the fused C++ kernel, called directly (not its fallback)
        from akv_jax.pallas.segment_attention_cpu import segment_attention_cpu

        return segment_attention_cpu(q, k, v, batch, block_q=block_q, sm_scale=sm_scale,
                                     sinks=sinks, sliding_window=window)
    if backend == "chunked":
        from akv_jax.pallas.chunked import segment_attention_chunked

        return segment_attention_chunked(q, k, v, batch, block_q=block_q, sm_scale=sm_scale,
                                         sinks=sinks, sliding_window=window, pages_per_chunk=2)
    # "pallas" on the CPU: the GPU body, interpreted
    fn = make_attention_fn("pallas" if backend == "gpu" else backend, block_q=block_q,
                           sm_scale=sm_scale, sliding_window=window)
    return fn(q, k, v, batch, sinks=sinks)


@pytest.mark.parametrize("page_size,group,window,with_sinks", WINDOW_CASES,
                         ids=[f"ps{c[0]}-g{c[1]}-w{c[2]}{'-sinks' if c[3] else ''}"
                              for c in WINDOW_CASES])
@pytest.mark.parametrize("backend", WINDOW_BACKENDS)
def test_window_counts_visible_entries(backend, page_size, group, window, with_sinks):
    """Every backend against the oracle on a mixed batch (decode rows and multi-row prefill
    segments) whose views hold invisible slots in the middle: dropped messages, single
    dropped entries and page padding. A sink is a softmax term, not an entry: it takes no
    room in the window and is there whatever was dropped."""
    case = cases.mixed_case(np.random.default_rng(page_size * 100 + window), num_segments=7,
                            page_size=page_size, block_q=8)
    q, k, v, batch = cases.materialize(
        case, np.random.default_rng(4), num_kv_heads=2, group=group, head_dim=16
    )
    sinks = jnp.linspace(-1.0, 2.0, 2 * group) if with_sinks else None
    got = _attend(backend, q, k, v, batch, block_q=case.block_q, sm_scale=0.25, sinks=sinks,
                  window=window)
    want = dense_oracle(q, k, v, case.specs, page_size, 0.25, sinks=sinks, window=window)
    assert_close(got, want, jnp.float32)


def test_window_starts_match_numpy():
    """plan.window_start on random mixed batches: the view index of the W-th most recent
    visible slot at or before each row (0 when no more than W are visible: nothing to cut),
    for every real row."""
    for seed in range(3):
        case = cases.mixed_case(np.random.default_rng(seed), num_segments=9, page_size=4,
                                block_q=4)
        batch = case.batch()
        blocks = plan_lib.blocks_of(batch)
        for window in (1, 3, 17):
            got = np.asarray(plan_lib.row_window_starts(batch, blocks, 4, window))
            b = 0
            for spec in case.specs:
                for i in range(spec.q_len):
                    idx = np.flatnonzero(spec.kv_visible[: spec.causal_pos + i + 1])
                    want = idx[-window] if len(idx) > window else 0
                    assert got[b + i // 4, i % 4] == want, (seed, window, spec, i)
                b += -(-spec.q_len // 4)


@pytest.mark.slow
@pytest.mark.parametrize("backend", WINDOW_BACKENDS)
def test_window_counts_visible_entries_sweep(backend):
    """More random batches and windows than CI runs (-m slow)."""
    for seed in range(4):
        for window in (2, 5, 40):
            case = cases.mixed_case(np.random.default_rng(1000 + seed), num_segments=12,
                                    page_size=8, block_q=16, max_rows=40)
            q, k, v, batch = cases.materialize(
                case, np.random.default_rng(seed), num_kv_heads=2, group=2, head_dim=16
            )
            sinks = jnp.asarray([0.3, -0.7, 1.1, 0.0])
            got = _attend(backend, q, k, v, batch, block_q=16, sm_scale=0.25, sinks=sinks,
                          window=window)
            want = dense_oracle(q, k, v, case.specs, 8, 0.25, sinks=sinks, window=window)
            assert_close(got, want, jnp.float32)


def test_window_without_invisible_slots_is_transformers_rule():
    """With every entry visible the window is transformers' ``q - W < k <= q`` in view
    slots (the rule before drops existed): the window starts and the reference agree."""
    ps, window = 8, 11
    rng = np.random.default_rng(6)
    specs = [  # a prefill after a cached prefix, a decode row, a segment from slot 0
        SegmentSpec(q_start=0, q_len=13, pages=[3, 4, 5, 6], kv_visible=np.ones(30, bool),
                    causal_pos=17),
        SegmentSpec(q_start=13, q_len=1, pages=[0, 1, 2], kv_visible=np.ones(21, bool),
                    causal_pos=20),
        SegmentSpec(q_start=14, q_len=9, pages=[7, 8], kv_visible=np.ones(9, bool),
                    causal_pos=0),
    ]
    case = cases.Case(specs, 24, 10, ps, block_q=4)
    batch = case.batch()
    blocks = plan_lib.blocks_of(batch)
    starts = np.asarray(plan_lib.row_window_starts(batch, blocks, 4, window))
    pos = np.asarray(blocks.kv_pos)[:, None] + np.arange(4)[None, :]
    real = np.asarray(blocks.q_len)[:, None] > np.arange(4)[None, :]
    np.testing.assert_array_equal(starts[real], np.maximum(pos - window + 1, 0)[real])

    q, k, v, _ = cases.materialize(case, rng, num_kv_heads=1, group=2, head_dim=8)
    got = segment_attention_reference(q, k, v, batch, block_q=4, sm_scale=0.5,
                                      sliding_window=window)
    # The slot rule, written as transformers' mask over each view.
    kk, vv, qq = (np.asarray(x, np.float64) for x in (k, v, q))
    want = np.zeros_like(qq)
    for spec in specs:
        keys = kk[spec.pages].reshape(-1, 1, 8)[: len(spec.kv_visible)]
        vals = vv[spec.pages].reshape(-1, 1, 8)[: len(spec.kv_visible)]
        for i in range(spec.q_len):
            c = spec.causal_pos + i
            j = np.arange(len(spec.kv_visible))
            sel = (c - window < j) & (j <= c)
            for h in range(2):
                logit = keys[sel, 0] @ qq[spec.q_start + i, h] * 0.5
                e = np.exp(logit - logit.max())
                want[spec.q_start + i, h] = e @ vals[sel, 0] / e.sum()
    assert_close(got, want, jnp.float32)


# ------------------------------------------------------------------------------ dispatch


def test_resolve_backend():
    assert resolve_backend("auto", "cpu") == ("reference", False)
    assert resolve_backend("auto", "gpu") == ("gpu", False)
    assert resolve_backend("auto", "tpu") == ("tpu", False)
    assert resolve_backend("pallas", "cpu") == ("gpu", True)
    assert resolve_backend("pallas", "tpu") == ("tpu", False)
    assert resolve_backend("reference", "gpu") == ("reference", False)
    with pytest.raises(ValueError):
        resolve_backend("triton", "cpu")


def test_dispatch_pallas_on_cpu_runs_the_kernel():
    case = case_of_kind("restore", page_size=16)
    q, k, v, batch = cases.materialize(
        case, np.random.default_rng(5), num_kv_heads=2, group=3, head_dim=16
    )
    ref_fn = make_attention_fn("reference", block_q=case.block_q, sm_scale=0.25)
    assert isinstance(ref_fn, functools.partial) and ref_fn.func is segment_attention_reference
    # "auto" on the CPU: the fused C++ kernel (tests/test_cpu_attention.py), whose fallback
    # is the chunked jnp path (no Pallas lowering here)
    auto_fn = make_attention_fn("auto", block_q=case.block_q, sm_scale=0.25, platform="cpu")
    ker_fn = make_attention_fn("pallas", block_q=case.block_q, sm_scale=0.25)
    assert_close(ker_fn(q, k, v, batch), ref_fn(q, k, v, batch), jnp.float32)
    assert_close(auto_fn(q, k, v, batch), ref_fn(q, k, v, batch), jnp.float32)


def test_every_backend_reads_one_layer_of_a_stacked_pool():
    """``layer=``: the pools hold every layer and attention reads that one in place; the
    answer equals the reference on that layer's pool alone (other layers hold other data)."""
    case = case_of_kind("restore", page_size=16)
    rng = np.random.default_rng(9)
    q, k, v, batch = cases.materialize(case, rng, num_kv_heads=2, group=3, head_dim=16)
    noise = [jnp.asarray(rng.standard_normal(k.shape), k.dtype) for _ in range(2)]
    k_all, v_all = jnp.stack([noise[0], k, noise[1]]), jnp.stack([noise[1], v, noise[0]])
    ref = segment_attention_reference(q, k, v, batch, block_q=case.block_q, sm_scale=0.25)
    for backend, platform in (("reference", None), ("auto", "cpu"), ("pallas", None)):
        fn = make_attention_fn(backend, block_q=case.block_q, sm_scale=0.25, platform=platform)
        assert_close(fn(q, k_all, v_all, batch, layer=jnp.int32(1)), ref, jnp.float32)


def test_every_backend_takes_sinks_per_call():
    """Sinks come with each call (a per-layer parameter) and the window is static: the
    dispatcher's functions, on a stacked pool, against the oracle."""
    case = case_of_kind("restore", page_size=16)
    rng = np.random.default_rng(10)
    q, k, v, batch = cases.materialize(case, rng, num_kv_heads=2, group=3, head_dim=16)
    k_all, v_all = jnp.stack([v, k]), jnp.stack([k, v])
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0, 1.5, -0.5])
    want = dense_oracle(q, k, v, case.specs, 16, 0.25, sinks=sinks, window=9)
    for backend, platform in (("reference", None), ("auto", "cpu"), ("pallas", None)):
        fn = make_attention_fn(backend, block_q=case.block_q, sm_scale=0.25, platform=platform,
                               sliding_window=9)
        got = fn(q, k_all, v_all, batch, layer=jnp.int32(1), sinks=sinks)
        assert_close(got, want, jnp.float32)


# --------------------------------------------------------------------------------- model


def test_model_greedy_with_pallas_backend():
    """The tiny model decodes the same tokens, with the same prompt logits, on the kernel."""
    cfg = tiny_config()
    params = init_params(cfg, jax.random.PRNGKey(0))
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size - 1, 45).tolist()
    logits_ref, toks_ref = greedy_generate(params, cfg, prompt, 5)
    logits_ker, toks_ker = greedy_generate(params, cfg, prompt, 5, attention_backend="pallas")
    assert toks_ker == toks_ref
    np.testing.assert_allclose(logits_ker, logits_ref, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------- chunked jnp path (CPU auto backend)


@pytest.mark.parametrize("kind", ["decode", "prefill", "restore", "long"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_chunked_matches_reference(kind, page_size):
    from akv_jax.pallas.chunked import segment_attention_chunked

    case = case_of_kind(kind, page_size=page_size)
    q, k, v, batch = cases.materialize(
        case, np.random.default_rng(2), num_kv_heads=2, group=4, head_dim=16
    )
    scale = 16**-0.5
    want = segment_attention_reference(q, k, v, batch, block_q=case.block_q, sm_scale=scale)
    got = segment_attention_chunked(
        q, k, v, batch, block_q=case.block_q, sm_scale=scale, pages_per_chunk=3
    )
    assert_close(got, want, jnp.float32)


def test_chunked_sinks_and_window_match_oracle():
    from akv_jax.pallas.chunked import segment_attention_chunked

    case = case_of_kind("restore", page_size=16)
    q, k, v, batch = cases.materialize(
        case, np.random.default_rng(1), num_kv_heads=2, group=3, head_dim=16
    )
    sinks = jnp.linspace(-1.0, 2.0, 6)
    got = segment_attention_chunked(
        q, k, v, batch, block_q=case.block_q, sm_scale=0.25, sinks=sinks, sliding_window=33
    )
    want = dense_oracle(q, k, v, case.specs, 16, 0.25, sinks=sinks, window=33)
    assert_close(got, want, jnp.float32)


def test_chunked_gathered_views_window_chunks_and_stale_buffers():
    """The many-row path gathers each segment's pages into buffers reused by the next
    segment: a long windowed segment whose block ranges start past page 0 and span several
    chunks (a chunk that would run past the view must not be clamped back over keys already
    counted), then a shorter segment over the same buffers (the first one's keys stay past
    its reach) with a dropped span, then a padding segment. Unused pool slots are NaN."""
    from akv_jax.pallas.chunked import segment_attention_chunked

    ps, Hkv, G, Dh, block_q = 4, 2, 3, 8, 4
    rng = np.random.default_rng(7)
    k, v = cases.poisoned_pools(rng, 40, ps, Hkv, Dh, poisoned_from=30)
    vis_b = np.ones(30, bool)
    vis_b[9:17] = False  # dropped span
    segs = [
        SegmentSpec(q_start=0, q_len=22, pages=list(range(0, 22)), kv_visible=np.ones(87, bool),
                    causal_pos=65),
        SegmentSpec(q_start=22, q_len=7, pages=list(range(22, 30)), kv_visible=vis_b,
                    causal_pos=23),
    ]
    batch = build_segment_batch(segs, page_size=ps, block_q=block_q, num_segments=4,
                                max_pages=22)  # the view fills its page table
    q = jnp.asarray(rng.standard_normal((32, Hkv * G, Dh)).astype(np.float32))
    sinks = jnp.linspace(-1.0, 1.0, Hkv * G)
    for w in (None, 5, 9, 13):  # window starts at odd and even pages
        want = segment_attention_reference(q, jnp.asarray(k), jnp.asarray(v), batch,
                                           block_q=block_q, sm_scale=0.3, sinks=sinks,
                                           sliding_window=w)
        got = segment_attention_chunked(q, jnp.asarray(k), jnp.asarray(v), batch,
                                        block_q=block_q, sm_scale=0.3, sinks=sinks,
                                        sliding_window=w, pages_per_chunk=2)
        assert_close(got[:29], want[:29], jnp.float32)
