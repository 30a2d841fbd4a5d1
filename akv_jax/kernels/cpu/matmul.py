"""Matrix products on XLA:CPU as XLA FFI calls, float32: decode steps' few rows
(``matmul.cc``) and prefill steps' many (``gemm.cc``).

A decode step of 1-16 rows streams every weight once, so its projections should cost what a
1-row step's do (XLA's matrix-vector product runs at the memory's speed); XLA:CPU's small-GEMM
path is compute-bound there instead (figures: ``docs/cpu-kernels.md``).
The few-row kernel reads each weight once in sequential blocks of rows, for up to 8 rows of
``x`` in registers. A prefill's many rows take a blocked GEMM (packed panels of ``w``,
register tiles of 6 x 64 with AVX-512, 6 x 16 with AVX2), from MIN_GEMM_ROWS up (decode
buckets past 16, every prefill bucket), at XLA's speed or better. Both sum every output the
same way (a chain of fused multiply-adds per slice of at most 256 ``k``, slices added in
order: more accurate than one chain over all of ``k``, and than XLA's slices of 512), so a
row's result is the same bits whichever kernel ran, however many rows the call had and
whatever the host's caches.

:func:`matmul_gated` and :func:`matmul_packed`'s ``gate`` and ``residual`` finish a product
in its kernel: SwiGLU's activation, a residual add (epilogues applied to each block of the
output as it is computed, where XLA made passes over the whole output of their own).

The CPU projection backend (:mod:`akv_jax.kernels.cpu.projection`) calls these where they
apply: float32, outside a tensor-parallel mesh, and on the CPU only
(``jax.lax.platform_dependent``: a GPU or TPU lowering, deviceless ones included, keeps the
matmul).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from akv_jax.kernels.cpu import ffi
from akv_jax.kernels.cpu.per_shard import unsharded
from akv_jax.kernels.projection import zero_past

TARGET = "akv_cpu_matmul"  # x [M, K] @ w [K, N], 1..MAX_ROWS rows
TARGET_NT = "akv_cpu_matmul_nt"  # x [M, K] @ w [N, K]^T, 1..MAX_ROWS rows
TARGET_GEMM = "akv_cpu_gemm"  # x [M, K] @ w [K, N], more rows
TARGET_GEMM_PACKED = "akv_cpu_gemm_packed"  # the same from w packed ahead (pack_panels)
# silu(gate) * (x @ w), SwiGLU's up projection with its activation as the epilogue (one
# pass where XLA read the gate and up outputs back). The kernels share the activation's
# code, so, as for the sums, a row's bits do not depend on which kernel ran.
TARGET_GATED = "akv_cpu_matmul_gated"
TARGET_GEMM_GATED = "akv_cpu_gemm_gated"
# From packed panels, with an epilogue: SwiGLU's activation or a residual add.
TARGET_GEMM_PACKED_EPILOGUE = "akv_cpu_gemm_packed_epilogue"
EPILOGUE_SILU_MUL, EPILOGUE_ADD = 1, 2  # gemm.cc's Epilogue
MAX_ROWS = 16  # the few-row kernel's: decode buckets 1 to 16
# Fewest rows for which a projection takes the GEMM: every row count takes one of the two
# kernels, whose sums agree, so a row's bits depend neither on the rows around it nor on
# the host's cache sizes (by which XLA's products block): docs/cpu-kernels.md.
MIN_GEMM_ROWS = MAX_ROWS + 1


def available() -> bool:
    """Whether the kernels are built and registered with XLA:CPU (builds them on first call)."""
    return (ffi.register("matmul.cc", TARGET, "AkvCpuMatmul")
            and ffi.register("matmul.cc", TARGET_NT, "AkvCpuMatmulNT")
            and ffi.register("gemm.cc", TARGET_GEMM, "AkvCpuGemm"))


def packs() -> bool:
    """Whether the GEMM of weights packed ahead of time (:func:`pack_panels`) is built and
    registered."""
    return available() and ffi.register("gemm.cc", TARGET_GEMM_PACKED,
                                            "AkvCpuGemmPacked")


def panel_width() -> int:
    """The GEMM's panel width NR (64 with AVX-512, 16 with AVX2): :func:`pack_panels`'s
    layout. Call it only where :func:`packs`."""
    nr = ffi.int_constant("gemm.cc", "AkvCpuGemmPanelWidth")
    if nr is None:
        raise RuntimeError("the CPU GEMM is not available (see its warning)")
    return nr


def pack_panels(w: jax.Array) -> jax.Array:
    """A stack of weights ``w`` [L, K, N] in the GEMM's packed layout [L, ceil(N / NR), K,
    NR] (panels of NR columns, each all of k, zero past N): what the GEMM copies every weight
    into on every call, done once (:func:`matmul_packed`). Exact (a copy)."""
    nr = panel_width()
    layers, k, n = w.shape
    p = -(-n // nr)
    w = jnp.pad(w, ((0, 0), (0, 0), (0, p * nr - n)))
    return w.reshape(layers, k, p, nr).transpose(0, 2, 1, 3)


def unpack_panels(panels: jax.Array, layer: jax.Array, n: int) -> jax.Array:
    """Layer ``layer`` of :func:`pack_panels`'s stack as the weight [K, N] it was."""
    _, p, k, nr = panels.shape
    w = jax.lax.dynamic_index_in_dim(panels, layer, keepdims=False)  # [P, K, NR]
    return w.transpose(1, 0, 2).reshape(k, p * nr)[:, :n]


def applies_packed(x: jax.Array, panels: jax.Array) -> bool:
    """Whether ``x [M, K]`` times a packed layer takes :func:`matmul_packed`: as
    :func:`applies`, at every row count (a panel is one sequential stream of all of ``k``, so
    a decode step's few rows read it at the memory's speed as the few-row kernel reads a
    plain weight), with the packed kernel built."""
    return (x.ndim == 2 and x.shape[0] >= 1 and panels.ndim == 4
            and x.dtype == panels.dtype == jnp.float32 and x.shape[1] == panels.shape[2]
            and unsharded() and packs())


def matmul_packed(x: jax.Array, panels: jax.Array, layer: jax.Array, n: int,
                  live: jax.Array | None = None, gate: jax.Array | None = None,
                  residual: jax.Array | None = None) -> jax.Array:
    """``x @ w`` [M, n] for ``w`` layer ``layer`` (int32 scalar) of a :func:`pack_panels`
    stack, the same bits as :func:`matmul` of ``w``: on the CPU the GEMM reads the layer's
    panels in the stack (a layer scan slices nothing), elsewhere the matmul of the unpacked
    layer. Rows from ``live`` on are zero. With ``gate`` [M, n]: ``silu(gate) * (x @ w)``,
    the bits of :func:`matmul_gated` (needs :func:`epilogues`); with ``residual`` [M, n]:
    ``residual + x @ w``, the bits of that add after the product (rows past ``live``:
    ``residual + 0``). Call it only where :func:`applies_packed`; inference only (no VJP:
    training takes :func:`matmul`)."""
    if gate is not None and residual is not None:
        raise ValueError("matmul_packed: a gate or a residual, not both")
    e = gate if gate is not None else residual
    _require(packed=True, epilogue=e is not None)
    layer1 = jnp.reshape(layer, (1,)).astype(jnp.int32)
    rows = _live_operand(x, live)
    out = jax.ShapeDtypeStruct((x.shape[0], n), x.dtype)
    if e is None:
        call = jax.ffi.ffi_call(TARGET_GEMM_PACKED, out, vmap_method="sequential")

        def unpacked(x, panels, layer1, rows):
            return _masked_matmul(x, unpack_panels(panels, layer1[0], n), rows)

        return jax.lax.platform_dependent(x, panels, layer1, rows, cpu=call, default=unpacked)
    kind = EPILOGUE_SILU_MUL if gate is not None else EPILOGUE_ADD
    call = jax.ffi.ffi_call(TARGET_GEMM_PACKED_EPILOGUE, out, vmap_method="sequential")

    def cpu(x, panels, layer1, e, rows):
        return call(x, panels, layer1, e, rows, epilogue=np.int64(kind))

    def unpacked_epilogue(x, panels, layer1, e, rows):
        w = unpack_panels(panels, layer1[0], n)
        if kind == EPILOGUE_SILU_MUL:
            return _masked_gated(x, w, e, rows)
        return e + _masked_matmul(x, w, rows)

    return jax.lax.platform_dependent(x, panels, layer1, e, rows, cpu=cpu,
                                      default=unpacked_epilogue)


def _takes_kernel(x: jax.Array, w: jax.Array, gemm: bool) -> bool:
    rows = x.shape[0] if x.ndim == 2 else 0
    return (
        x.ndim == 2 and w.ndim == 2
        and (1 <= rows <= MAX_ROWS or (gemm and rows >= MIN_GEMM_ROWS))
        and x.dtype == w.dtype == jnp.float32
        and unsharded()  # an FFI call GSPMD cannot partition
        and available()
    )


def applies(x: jax.Array, w: jax.Array) -> bool:
    """Whether ``x [M, K] @ w [K, N]`` takes a kernel: float32 (the few-row kernel up to
    MAX_ROWS rows, the GEMM from MIN_GEMM_ROWS), no tensor-parallel mesh (an FFI call GSPMD
    cannot partition), and the kernels built."""
    return _takes_kernel(x, w, gemm=True)


def applies_nt(x: jax.Array, w_nt: jax.Array) -> bool:
    """Whether ``x [M, K] @ w_nt [N, K]^T`` takes the kernel (a tied output head): as
    :func:`applies`, 1..MAX_ROWS rows only (a step's logits rows, one a request; training's
    many take XLA's product)."""
    return _takes_kernel(x, w_nt, gemm=False)


def _require(packed: bool = False, epilogue: bool = False) -> None:
    if not (epilogues() if epilogue else packs() if packed else available()):
        raise RuntimeError("the CPU matmul kernels are not available (see their warning)")


def matmul(x: jax.Array, w: jax.Array, live: jax.Array | None = None) -> jax.Array:
    """``x @ w`` for ``x [M, K]``, ``w [K, N]``: a kernel where the lowering is for the CPU,
    the matmul elsewhere. Call it only where :func:`applies`. Differentiable (the backward
    pass is plain matmuls).

    ``live`` (int32 scalar): rows from ``live`` on are a step's padding and come back zero,
    on every platform. The GEMM (more than MAX_ROWS rows) neither computes nor reads them;
    the few-row kernel computes all rows (decode buckets pad little) and they are masked."""
    y = _matmul(x, w, _live_operand(x, live))
    return zero_past(y, live) if x.shape[0] <= MAX_ROWS else y


def epilogues() -> bool:
    """Whether the products that finish their output in the kernel (:func:`matmul_gated`;
    :func:`matmul_packed` with a gate or a residual) are built and registered."""
    return (packs() and ffi.register("matmul.cc", TARGET_GATED, "AkvCpuMatmulGated")
            and ffi.register("gemm.cc", TARGET_GEMM_GATED, "AkvCpuGemmGated")
            and ffi.register("gemm.cc", TARGET_GEMM_PACKED_EPILOGUE,
                                 "AkvCpuGemmPackedEpilogue"))


def _live_operand(x: jax.Array, live: jax.Array | None) -> jax.Array:
    """The GEMMs' ``live`` operand, int32 [1]: ``live``, or all of ``x``'s rows."""
    if live is None:
        return jnp.full((1,), x.shape[0], jnp.int32)
    return jnp.reshape(live, (1,)).astype(jnp.int32)


@jax.custom_vjp
def _matmul(x: jax.Array, w: jax.Array, live: jax.Array) -> jax.Array:
    _require()
    if x.shape[0] <= MAX_ROWS:
        call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype),
                                vmap_method="sequential")
        return jax.lax.platform_dependent(x, w, cpu=call, default=jnp.matmul)
    call = jax.ffi.ffi_call(TARGET_GEMM,
                            jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype),
                            vmap_method="sequential")
    return jax.lax.platform_dependent(x, w, live, cpu=call, default=_masked_matmul)


def _masked_matmul(x: jax.Array, w: jax.Array, live: jax.Array) -> jax.Array:
    return zero_past(x @ w, live)


def _fwd(x, w, live):
    return _matmul(x, w, live), (x, w, live)


def _bwd(res, g):
    x, w, live = res
    if x.shape[0] > MAX_ROWS:  # padding rows are constant zeros
        g = zero_past(g, live)
    return g @ w.T, x.T @ g, None


_matmul.defvjp(_fwd, _bwd)


def applies_gated(x: jax.Array, w: jax.Array) -> bool:
    """Whether ``silu(gate) * (x @ w)`` takes a kernel (:func:`matmul_gated`): as
    :func:`applies`, and the gated kernels built."""
    return applies(x, w) and epilogues()


def matmul_gated(x: jax.Array, w: jax.Array, gate: jax.Array,
                 live: jax.Array | None = None) -> jax.Array:
    """``silu(gate) * (x @ w)`` for ``x [M, K]``, ``w [K, N]``, ``gate [M, N]`` (SwiGLU's
    up projection and activation), where :func:`applies_gated`: the product as
    :func:`matmul` sums it, the activation as the kernels' shared epilogue. Rows from
    ``live`` on are zero."""
    y = _matmul_gated(x, w, gate, _live_operand(x, live))
    return zero_past(y, live) if x.shape[0] <= MAX_ROWS else y


def _silu_times(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def _masked_gated(x: jax.Array, w: jax.Array, gate: jax.Array, live: jax.Array) -> jax.Array:
    return zero_past(_silu_times(gate, x @ w), live)


@jax.custom_vjp
def _matmul_gated(x: jax.Array, w: jax.Array, gate: jax.Array, live: jax.Array) -> jax.Array:
    _require(epilogue=True)
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype)
    if x.shape[0] <= MAX_ROWS:
        call = jax.ffi.ffi_call(TARGET_GATED, out, vmap_method="sequential")
        return jax.lax.platform_dependent(
            x, w, gate, cpu=call, default=lambda x, w, gate: _silu_times(gate, x @ w))
    call = jax.ffi.ffi_call(TARGET_GEMM_GATED, out, vmap_method="sequential")
    return jax.lax.platform_dependent(x, w, gate, live, cpu=call, default=_masked_gated)


def _fwd_gated(x, w, gate, live):
    return _matmul_gated(x, w, gate, live), (x, w, gate, live)


def _bwd_gated(res, g):
    x, w, gate, live = res
    if x.shape[0] > MAX_ROWS:  # padding rows are constant zeros
        g = zero_past(g, live)
    up = x @ w
    sig = jax.nn.sigmoid(gate)
    d_up = g * gate * sig
    d_gate = g * up * sig * (1 + gate * (1 - sig))  # silu'(a) = s(a) (1 + a (1 - s(a)))
    return d_up @ w.T, x.T @ d_up, d_gate, None


_matmul_gated.defvjp(_fwd_gated, _bwd_gated)


@jax.custom_vjp
def matmul_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w.T`` for ``x [M, K]``, ``w [N, K]`` (a tied embedding as the output head), as
    :func:`matmul`, where :func:`applies_nt`."""
    _require()
    call = jax.ffi.ffi_call(TARGET_NT, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), x.dtype),
                            vmap_method="sequential")
    return jax.lax.platform_dependent(x, w, cpu=call, default=lambda x, w: x @ w.T)


def _fwd_nt(x, w):
    return matmul_nt(x, w), (x, w)


def _bwd_nt(res, g):
    x, w = res
    return g @ w, g.T @ x


matmul_nt.defvjp(_fwd_nt, _bwd_nt)
