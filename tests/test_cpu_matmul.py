"""The XLA:CPU matmul kernels (akv_jax/kernels/cpu/matmul.cc: few rows; gemm.cc: many)
against float64 numpy; where the CPU projection backend (akv_jax/kernels/cpu/projection.py)
uses them; and the CPU device group's weight layouts, which give the plain forward's bits."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from akv_jax.kernels.cpu import matmul as cpu_matmul
from akv_jax.kernels.cpu.projection import CPU, PackedRef, PackedStack
from akv_jax.kernels.projection import Adapted
from akv_jax.model import presets
from akv_jax.model.causal import BLOCK_Q, PAGE_SIZE, one_segment_batch
from akv_jax.model.forward import KVPool, KVWrites, forward, make_model_attention
from akv_jax.model.params import init_params
from akv_jax.model.rope import rope_table_for
from akv_jax.serving.device_group import DeviceGroup, cpu_layout


def ffi_targets(jaxpr: str) -> set[str]:
    return set(re.findall(r"target_name=(\w+)", jaxpr))


def test_kernel_builds_here():
    assert cpu_matmul.available()


@pytest.mark.parametrize("rows", [2, 3, 5, 8, 9, 16])
@pytest.mark.parametrize("k,n", [(64, 96), (37, 70), (1, 33), (130, 16)])
def test_matches_float64(rows, k, n):
    """Row counts in one and two register tiles, column counts with a piece narrower than 32
    (70, 33, 16), and every thread's share of a few columns."""
    rng = np.random.default_rng(rows * 1000 + k + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64)
    got = np.asarray(jax.jit(cpu_matmul.matmul)(jnp.asarray(x), jnp.asarray(w)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    # w as [N, K] (a tied embedding as the output head)
    got = np.asarray(jax.jit(cpu_matmul.matmul_nt)(jnp.asarray(x), jnp.asarray(w.T)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("rows,k,n", [
    (17, 64, 96),     # two micro-panels of 6 rows and a short one; a short panel (64 cols)
    (29, 37, 70),     # a panel narrower than the 64 (AVX-512) or 16 (AVX2) columns
    (200, 130, 16),   # several row chunks (72 rows each), one narrow panel
    (40, 2100, 33),   # two slices of k: the second adds to the first's sums
    (20, 64, 66000),  # w packed in two parts (16 MiB at a time), the last one short
])
def test_gemm_matches_float64(rows, k, n):
    rng = np.random.default_rng(rows + k + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64)
    got = np.asarray(jax.jit(cpu_matmul.matmul)(jnp.asarray(x), jnp.asarray(w)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_rows_do_not_depend_on_the_batch():
    """Each output is one fused multiply-add chain in the order of k in both kernels: a row's
    bits are the same alone in a few-row call, among 16, or in a GEMM of 300 rows at any
    position."""
    rng = np.random.default_rng(7)
    k, n = 2100, 48
    x = jnp.asarray(rng.standard_normal((300, k)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32))
    mm = jax.jit(cpu_matmul.matmul)
    full = np.asarray(mm(x, w))
    np.testing.assert_array_equal(np.asarray(mm(x[:2], w)), full[:2])
    np.testing.assert_array_equal(np.asarray(mm(x[:16], w)), full[:16])
    np.testing.assert_array_equal(np.asarray(mm(x[290:], w)), full[290:])
    np.testing.assert_array_equal(np.asarray(mm(x[::-1], w)), full[::-1])


@pytest.mark.parametrize("live", [0, 1, 5, 6, 13, 100, 299, 300, 400, -3])
def test_gemm_skips_rows_past_live(live):
    """Rows from ``live`` on (a step's padding) come back zero, the rows before it the same
    bits as without ``live``, whether ``live`` ends inside a micro-panel, a chunk, or past
    the rows (clamped); the non-CPU lowering masks alike."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((300, 200)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((200, 80)).astype(np.float32))
    full = np.asarray(jax.jit(cpu_matmul.matmul)(x, w))
    got = np.asarray(jax.jit(cpu_matmul.matmul)(x, w, jnp.int32(live)))
    n = min(max(live, 0), 300)
    np.testing.assert_array_equal(got[:n], full[:n])
    np.testing.assert_array_equal(got[n:], 0)
    masked = np.asarray(jax.jit(cpu_matmul._masked_matmul)(x, w, jnp.full((1,), live)))
    np.testing.assert_allclose(masked, got, rtol=1e-5, atol=1e-4)


def sin_loss_grads(mm, x, w):
    """Gradients of sum(sin(mm(x, w))) with respect to x and w."""
    return jax.grad(lambda x, w: jnp.sum(jnp.sin(mm(x, w))), argnums=(0, 1))(x, w)


def test_gemm_gradient_with_live_rows():
    """Padding rows are constants: no gradient flows through them."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((80, 24)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((24, 40)).astype(np.float32))
    ref = lambda x, w: jnp.where(jnp.arange(80)[:, None] < 50, x @ w, 0)  # noqa: E731
    wx, ww = sin_loss_grads(ref, x, w)
    gx, gw = sin_loss_grads(lambda x, w: cpu_matmul.matmul(x, w, jnp.int32(50)), x, w)
    np.testing.assert_allclose(gx, wx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, ww, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(gx[50:], 0)


def test_gradient_is_the_matmuls():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 24)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((24, 40)).astype(np.float32))
    wx, ww = sin_loss_grads(jnp.matmul, x, w)
    gx, gw = sin_loss_grads(cpu_matmul.matmul, x, w)
    np.testing.assert_allclose(gx, wx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, ww, rtol=1e-5, atol=1e-5)
    gx, gwt = sin_loss_grads(cpu_matmul.matmul_nt, x, w.T)
    np.testing.assert_allclose(gx, wx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gwt, ww.T, rtol=1e-5, atol=1e-5)


# Gates across the activation's range, its exponential's clamps (|g| 87-88) and past them.
EDGE_GATES = [0.0, -0.0, 1e-8, -1e-8, 3.5, -3.5, 20.0, -20.0, 86.9, -86.9, 87.5, -87.5,
              88.5, -88.5, 100.0, -100.0, 1e30, -1e30]


def silu_times_product_f64(x, w, gate):
    g = np.asarray(gate, np.float64)
    with np.errstate(over="ignore"):
        silu = g / (1 + np.exp(-g))
    return silu * (np.asarray(x, np.float64) @ np.asarray(w, np.float64)), silu


def gated_inputs(rng, rows, k, n):
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    gate = (4 * rng.standard_normal((rows, n))).astype(np.float32)
    gate.flat[: len(EDGE_GATES)] = EDGE_GATES
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(gate)


@pytest.mark.parametrize("rows,k,n,live", [
    (3, 37, 70, None),     # few-row kernel; columns past the last whole vector
    (16, 64, 96, 11),      # few-row kernel, padding rows
    (64, 48, 80, 64),      # the GEMM; a panel narrower than its width
    (200, 130, 70, 150),   # several row chunks, padding rows inside one
    (40, 2100, 33, None),  # two slices of k before the epilogue
])
def test_gated_products_are_silu_times_the_product(rows, k, n, live):
    """``matmul_gated`` (SwiGLU's up projection with the activation as the kernels'
    epilogue) is silu(gate) * (x @ w) against float64, from gates of -1e30 to 1e30; rows
    past ``live`` are zero."""
    x, w, gate = gated_inputs(np.random.default_rng(rows + k + n), rows, k, n)
    live_ = None if live is None else jnp.int32(live)
    got = np.asarray(jax.jit(cpu_matmul.matmul_gated)(x, w, gate, live_), np.float64)
    want, silu = silu_times_product_f64(x, w, gate)
    m = rows if live is None else live
    err = np.abs(got[:m] - want[:m])
    bound = 1e-5 * np.abs(want[:m]) + 1e-5 * np.sqrt(k) * (np.abs(silu[:m]) + 1e-3)
    assert np.all(err <= bound), float(np.max(err / bound))
    np.testing.assert_array_equal(got[m:], 0)


def test_gated_rows_do_not_depend_on_the_kernel():
    """The few-row kernel and the GEMM (plain or from packed panels) share the activation's
    code as they share the sums: a row's bits are the same in any of them, at any
    position."""
    x, w, gate = gated_inputs(np.random.default_rng(11), 300, 600, 70)
    mm = jax.jit(cpu_matmul.matmul_gated)
    full = np.asarray(mm(x, w, gate))
    for rows in (slice(0, 2), slice(0, 16), slice(290, 300), slice(None, None, -1)):
        np.testing.assert_array_equal(np.asarray(mm(x[rows], w, gate[rows])), full[rows])
    panels = cpu_matmul.pack_panels(w[None])
    packed = jax.jit(lambda x, p, g: cpu_matmul.matmul_packed(x, p, jnp.int32(0), 70, None, g))
    assert ffi_targets(str(jax.make_jaxpr(packed)(x, panels, gate))) == {
        cpu_matmul.TARGET_GEMM_PACKED_EPILOGUE}
    np.testing.assert_array_equal(np.asarray(packed(x, panels, gate)), full)
    for rows in (slice(0, 1), slice(0, 4), slice(284, 300)):  # a decode step's few rows
        np.testing.assert_array_equal(np.asarray(packed(x[rows], panels, gate[rows])),
                                      full[rows])
    live = jnp.int32(123)
    got = np.asarray(cpu_matmul.matmul_packed(x, panels, jnp.int32(0), 70, live, gate))
    np.testing.assert_array_equal(got[:123], full[:123])
    np.testing.assert_array_equal(got[123:], 0)


@pytest.mark.parametrize("rows,live", [(4, None), (80, 50)])
def test_gated_gradient_is_the_reference(rows, live):
    """The gated product's VJP (training through the kernels) against jax.grad of
    silu(gate) * (x @ w); padding rows get none."""
    x, w, gate = gated_inputs(np.random.default_rng(rows), rows, 24, 40)
    gate = gate / 100  # inside the activation's curved part (EDGE_GATES / 100)
    live_ = None if live is None else jnp.int32(live)
    m = rows if live is None else live
    mask = (jnp.arange(rows) < m)[:, None]

    def loss(f):
        return jax.grad(lambda x, w, g: jnp.sum(jnp.sin(f(x, w, g))), argnums=(0, 1, 2))

    want = loss(lambda x, w, g: jnp.where(mask, jax.nn.silu(g) * (x @ w), 0))(x, w, gate)
    got = loss(lambda x, w, g: cpu_matmul.matmul_gated(x, w, g, live_))(x, w, gate)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[0][m:], 0)
    np.testing.assert_array_equal(got[2][m:], 0)


EQS = [  # every projection form of the model (forward.py)
    ("td,dhk->thk", (12,), (12, 3, 16)),
    ("thk,hkd->td", (3, 16), (3, 16, 20)),
    ("td,df->tf", (20,), (20, 48)),
    ("tf,fd->td", (48,), (48, 20)),
]


@pytest.mark.parametrize("eq,x_in,w_shape", EQS, ids=[e[0] for e in EQS])
def test_project_takes_kernels_for_float32_rows(eq, x_in, w_shape):
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal(w_shape).astype(np.float32))
    for rows, dtype, target in ((8, jnp.float32, cpu_matmul.TARGET),
                                (2, jnp.float32, cpu_matmul.TARGET),
                                (1, jnp.float32, cpu_matmul.TARGET),
                                (32, jnp.float32, cpu_matmul.TARGET_GEMM),
                                (cpu_matmul.MIN_GEMM_ROWS, jnp.float32, cpu_matmul.TARGET_GEMM),
                                (8, jnp.bfloat16, None)):
        x = jnp.asarray(rng.standard_normal((rows, *x_in)).astype(np.float32), dtype)
        wd = w.astype(dtype)
        jaxpr = str(jax.make_jaxpr(lambda x, w: CPU(eq, x, w))(x, wd))
        assert ffi_targets(jaxpr) == ({target} if target else set()), (rows, dtype)
        got = CPU(eq, x, wd)
        want = np.einsum(eq, np.asarray(x, np.float64), np.asarray(wd, np.float64))
        tol = 1e-5 if dtype == jnp.float32 else 5e-2
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol,
                                   atol=tol * np.sqrt(np.prod(x_in)))


@pytest.mark.parametrize("tied", [True, False])
def test_output_head_takes_kernel_for_decode_rows(tied):
    """The vocabulary projection of 1 or 8 float32 rows runs the few-row kernel (tied: the
    embedding as [V, D]); of 32 rows the GEMM (untied) or XLA's matmul (tied: past the
    few-row kernel); all equal the one-row products."""
    import dataclasses

    from akv_jax.model.forward import lm_logits
    from akv_jax.model.presets import tiny_config

    cfg = dataclasses.replace(tiny_config(), tie_word_embeddings=tied)
    params = init_params(cfg, jax.random.PRNGKey(0))
    assert (params.lm_head is None) == tied
    few = cpu_matmul.TARGET_NT if tied else cpu_matmul.TARGET
    for rows, target in ((1, few), (8, few),
                         (32, None if tied else cpu_matmul.TARGET_GEMM)):
        x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, cfg.hidden_size)),
                        jnp.float32)
        jaxpr = str(jax.make_jaxpr(lambda x: lm_logits(params, cfg, x))(x))
        assert ffi_targets(jaxpr) == ({target} if target else set()), rows
        got = lm_logits(params, cfg, x)
        # One row at a time.
        want = jax.vmap(lambda r: lm_logits(params, cfg, r[None])[0])(x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_project_zeroes_rows_past_live_on_every_path():
    """Padding rows past ``live`` are zero whichever path a projection takes (the GEMM, the
    few-row kernel, a plain einsum, a LoRA-adapted weight), so that paths agree on every row
    (a merged adapter against its unmerged form, as training compares them)."""
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((20, 48)).astype(np.float32))
    a = jnp.asarray(rng.standard_normal((20, 2)).astype(np.float32))
    b = jnp.asarray(rng.standard_normal((2, 48)).astype(np.float32))
    for rows, live in [(70, 41), (12, 5)]:  # the GEMM, the few-row kernel
        x = jnp.asarray(rng.standard_normal((rows, 20)).astype(np.float32))
        kern = np.asarray(CPU("td,df->tf", x, w, jnp.int32(live)))
        plain = np.asarray(CPU("td,df->tf", x, w))
        np.testing.assert_array_equal(kern[live:], 0)
        np.testing.assert_array_equal(kern[:live], plain[:live])
        ein = np.asarray(CPU("td,df->tf", x, w.astype(jnp.bfloat16), jnp.int32(live)))
        np.testing.assert_array_equal(ein[live:], 0)
        ad = np.asarray(CPU("td,df->tf", x, Adapted(w, a, b, 0.5), jnp.int32(live)))
        np.testing.assert_array_equal(ad[live:], 0)
        np.testing.assert_allclose(ad[:live], (x @ w + 0.5 * (x @ a) @ b)[:live],
                                   rtol=1e-4, atol=1e-4)


def test_project_gated_on_every_path():
    """The MLP's gated product takes the gated kernels where the plain one takes a kernel
    (from a plain or a packed weight: a packed one's at every row count), XLA's silu
    elsewhere (bfloat16, a LoRA-adapted weight); each is silu(gate) * (x @ w),
    zero past ``live``."""
    rng = np.random.default_rng(8)
    w = jnp.asarray(rng.standard_normal((20, 48)).astype(np.float32))
    a = jnp.asarray(rng.standard_normal((20, 2)).astype(np.float32))
    b = jnp.asarray(rng.standard_normal((2, 48)).astype(np.float32))
    packed = PackedRef(cpu_matmul.pack_panels(w[None]), jnp.int32(0), w.shape)
    g, p = cpu_matmul.TARGET_GEMM_GATED, cpu_matmul.TARGET_GEMM_PACKED_EPILOGUE
    for rows, live, weight, target in [
        (70, 41, w, g), (70, 41, packed, p), (12, 5, w, cpu_matmul.TARGET_GATED),
        (12, 5, packed, p), (32, 20, w, g),
        (70, 41, w.astype(jnp.bfloat16), None), (70, 41, Adapted(w, a, b, 0.5), None),
    ]:
        x = jnp.asarray(rng.standard_normal((rows, 20)).astype(np.float32))
        gate = jnp.asarray(rng.standard_normal((rows, 48)).astype(np.float32))
        live_ = jnp.int32(live)
        f = lambda x, gate: CPU.gated(x, weight, gate, live_)  # noqa: E731, B023
        targets = ffi_targets(str(jax.make_jaxpr(f)(x, gate)))
        assert (target in targets) if target else not (targets & {g, p, cpu_matmul.TARGET_GATED})
        got = np.asarray(f(x, gate), np.float64)
        full = w + 0.5 * a @ b if isinstance(weight, Adapted) else w
        want, _ = silu_times_product_f64(x, full, gate)
        tol = 5e-2 if getattr(weight, "dtype", None) == jnp.bfloat16 else 1e-4
        np.testing.assert_allclose(got[:live], want[:live], rtol=tol, atol=tol)
        np.testing.assert_array_equal(got[live:], 0)


@pytest.mark.parametrize("rows,k,n,live", [(64, 48, 80, 64), (100, 576, 200, 77),
                                           (128, 32, 16, 0), (70, 300, 64, 70),
                                           (1, 576, 200, 1), (4, 300, 64, 3), (16, 48, 80, 16)])
def test_packed_gemm_is_the_gemm(rows, k, n, live):
    """The GEMM from panels packed ahead (any layer of the stack, N not a multiple of the
    panel width, padding rows) returns the bits the plain weight's kernel does (the GEMM's,
    or the few-row kernel's for a decode step's 1-16 rows), and the packing unpacks to the
    weight (what the lowering off the CPU multiplies by)."""
    rng = np.random.default_rng(7)
    w = jnp.asarray(rng.standard_normal((3, k, n)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
    panels = cpu_matmul.pack_panels(w)
    assert panels.shape[1:] == (-(-n // cpu_matmul.panel_width()), k, cpu_matmul.panel_width())
    live_ = jnp.int32(live)
    packed = jax.jit(lambda x, p, layer: cpu_matmul.matmul_packed(x, p, layer, n, live_))
    assert ffi_targets(str(jax.make_jaxpr(packed)(x, panels, jnp.int32(0)))) == {
        cpu_matmul.TARGET_GEMM_PACKED}
    for layer in range(3):
        np.testing.assert_array_equal(
            np.asarray(cpu_matmul.unpack_panels(panels, jnp.int32(layer), n)), w[layer])
        got = np.asarray(packed(x, panels, jnp.int32(layer)))
        np.testing.assert_array_equal(got, cpu_matmul.matmul(x, w[layer], live_))
        want = np.asarray(x, np.float64) @ np.asarray(w[layer], np.float64)
        np.testing.assert_allclose(got[:live], want[:live], rtol=1e-5, atol=1e-5 * np.sqrt(k))
        np.testing.assert_array_equal(got[live:], 0)


@pytest.mark.parametrize("rows,k,n,live", [(64, 48, 80, 64), (100, 576, 200, 77),
                                           (70, 300, 64, 0)])
def test_packed_gemm_adds_the_residual(rows, k, n, live):
    """The packed GEMM's residual epilogue is bit for bit the add after the product
    (``residual + x @ w``, rows past ``live``: ``residual + 0``, so -0 becomes +0 as in
    XLA's add)."""
    rng = np.random.default_rng(9)
    w = jnp.asarray(rng.standard_normal((2, k, n)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
    r = rng.standard_normal((rows, n)).astype(np.float32)
    r[-1, :3] = [-0.0, 1e30, -1e-30]
    r = jnp.asarray(r)
    panels = cpu_matmul.pack_panels(w)
    live_ = jnp.int32(live)
    fused = jax.jit(lambda x, p, r: cpu_matmul.matmul_packed(x, p, jnp.int32(1), n, live_,
                                                             residual=r))
    assert ffi_targets(str(jax.make_jaxpr(fused)(x, panels, r))) == {
        cpu_matmul.TARGET_GEMM_PACKED_EPILOGUE}
    want = np.asarray(jax.jit(lambda x, p, r: r + cpu_matmul.matmul_packed(
        x, p, jnp.int32(1), n, live_))(x, panels, r))
    got = np.asarray(fused(x, panels, r))
    np.testing.assert_array_equal(got, want)
    assert not np.signbit(got[-1, 0])  # -0 + 0 is +0
    with pytest.raises(ValueError, match="not both"):
        cpu_matmul.matmul_packed(x, panels, jnp.int32(1), n, live_, gate=r, residual=r)


ARCHS = {"llama": lambda: presets.tiny_config("llama"), "gpt_oss": presets.tiny_gpt_oss_config,
         "qwen3_moe": presets.tiny_qwen3_moe_config,
         "minimax_m2": presets.tiny_minimax_m2_config}


def one_sequence_step(cfg, n: int, t: int, block_q: int, pages: int = 8):
    """(tokens, positions, writes, batch) of a step of ``n`` new tokens padded to ``t`` rows
    (rows ``n..``: padding, written nowhere) over an empty pool of ``pages`` pages."""
    tokens = np.zeros(t, np.int32)
    tokens[:n] = np.random.default_rng(n).integers(1, cfg.vocab_size - 1, n)
    pos = np.arange(t, dtype=np.int32)
    slots = np.where(pos < n, pos, pages * PAGE_SIZE).astype(np.int32)
    writes = KVWrites(slots=slots[None], positions=pos[None])
    return tokens, pos, writes, one_segment_batch(0, n, block_q, pages)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_cpu_layout_gives_the_plain_forwards_bits(arch):
    """The CPU device group's one layout (the stacks with their projections packed for the
    kernels, read in place by the layer scan at every row count) gives the bits of the plain
    forward over the stacks as loaded, for models whose layer kinds alternate (GPT-OSS's
    windows; Qwen3-MoE's dense and MoE layers, where a dense layer's row in its stack is not
    its index); through the group's own step, logits and KV alike."""
    cfg = ARCHS[arch]()
    params = init_params(cfg, jax.random.key(3))
    layout = cpu_layout(cfg, params)
    packed = {n for n, v in vars(layout.layers).items() if isinstance(v, PackedStack)}
    assert packed == ({"wq", "wk", "wv", "wo"} if arch in ("gpt_oss", "minimax_m2")
                      else {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"})
    rope = rope_table_for(cfg)
    # 90 tokens in a 128-row prefill (15 rows of logits: the head's few-row kernel); decode
    # steps of 1 and 4 rows.
    for n, t, block_q, rows in ((90, 128, BLOCK_Q, np.arange(0, 90, 6)), (1, 1, 1, None),
                                (4, 4, 1, None)):
        tokens, pos, writes, batch = one_sequence_step(cfg, n, t, block_q)
        attention = make_model_attention(cfg, "auto", block_q)

        @jax.jit
        def run(params, tokens=tokens, pos=pos, writes=writes, batch=batch, attention=attention,
                rows=rows):
            kv = KVPool.zeros(cfg, 8, PAGE_SIZE)
            return forward(params, cfg, jnp.asarray(tokens), jnp.asarray(pos), kv, writes,
                           batch, rope, attention, logits_rows=rows)

        want_logits, want_kv = run(params)
        targets = ffi_targets(str(jax.make_jaxpr(run)(layout)))
        # every projection reads the packed stacks, a decode step's few rows too; packed, the
        # output projection without a bias (all but GPT-OSS's) carries its residual add, a
        # dense MLP's up projection its activation (Qwen3-MoE's dense layers too)
        assert cpu_matmul.TARGET_GEMM_PACKED in targets
        assert (cpu_matmul.TARGET_GEMM_PACKED_EPILOGUE in targets) == (arch != "gpt_oss")
        if block_q > 1:
            # only an MoE router's product (a plain weight of E columns, on the kernels for
            # bit for bit) takes the plain GEMM
            moe = arch in ("gpt_oss", "qwen3_moe", "minimax_m2")
            assert (cpu_matmul.TARGET_GEMM in targets) == moe
            plain = ffi_targets(str(jax.make_jaxpr(run)(params)))
            assert (cpu_matmul.TARGET_GEMM_GATED in plain) == (arch in ("llama", "qwen3_moe"))
        got_logits, got_kv = run(layout)
        np.testing.assert_array_equal(np.asarray(got_logits), np.asarray(want_logits))
        np.testing.assert_array_equal(np.asarray(got_kv.k), np.asarray(want_kv.k))
        np.testing.assert_array_equal(np.asarray(got_kv.v), np.asarray(want_kv.v))

        group = DeviceGroup(cfg, params, 8, PAGE_SIZE, jnp.float32)
        step_rows = np.arange(n) if rows is None else rows
        out = group.forward(tokens, pos, writes, batch, rope, attention, step_rows)
        np.testing.assert_array_equal(np.asarray(out.logits),
                                      np.asarray(want_logits)[: len(step_rows)])
        np.testing.assert_array_equal(np.asarray(group.kv.k), np.asarray(want_kv.k))
