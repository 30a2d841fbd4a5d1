"""Few-row matrix products on XLA:CPU (``cpu_matmul.cc``, an XLA FFI call): decode steps.

A decode step of 2-16 rows streams every weight once, so its projections should cost what a
1-row step's do (XLA's matrix-vector product runs at the memory's speed); XLA:CPU's small-GEMM
path is compute-bound there instead (SmolLM2's MLP weights: 11.9 ms at 1 row, 22.0 ms at 8).
The kernel reads each weight once in sequential blocks of rows, for up to 8 rows of ``x`` in
registers. :func:`few_row_matmul` is used by :func:`akv_jax.model.forward.project` on the CPU
only (``jax.lax.platform_dependent``: a GPU or TPU lowering, deviceless ones included, keeps
the einsum), float32, 2-16 rows, outside a tensor-parallel mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from akv_jax.pallas import cpu_ffi

TARGET = "akv_cpu_matmul"
TARGET_NT = "akv_cpu_matmul_nt"
MAX_ROWS = 16  # decode buckets 8 and 16; prefill rows start at 64


def available() -> bool:
    """Whether the kernels are built and registered with XLA:CPU (builds them on first call)."""
    return (cpu_ffi.register("cpu_matmul.cc", TARGET, "AkvCpuMatmul")
            and cpu_ffi.register("cpu_matmul.cc", TARGET_NT, "AkvCpuMatmulNT"))


def applies(x: jax.Array, w: jax.Array) -> bool:
    """Whether ``x [M, K] @ w [K, N]`` takes the kernel: float32, 2..MAX_ROWS rows (1 row
    is XLA's matrix-vector product, already at the memory's speed), no tensor-parallel mesh
    (an FFI call GSPMD cannot partition), and the kernel built."""
    mesh = jax.sharding.get_abstract_mesh()
    return (
        x.ndim == 2 and w.ndim == 2
        and 2 <= x.shape[0] <= MAX_ROWS
        and x.dtype == w.dtype == jnp.float32
        and (mesh.empty or all(n == 1 for n in mesh.shape.values()))
        and available()
    )


def _require() -> None:
    if not available():
        raise RuntimeError("the CPU few-row matmul kernel is not available (see its warning)")


@jax.custom_vjp
def few_row_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` for ``x [M, K]``, ``w [K, N]``: the kernel where the lowering is for the CPU,
    the matmul elsewhere. Call it only where :func:`applies`. Differentiable (the backward
    pass is plain matmuls)."""
    _require()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype),
                            vmap_method="sequential")
    return jax.lax.platform_dependent(x, w, cpu=call, default=jnp.matmul)


def _fwd(x, w):
    return few_row_matmul(x, w), (x, w)


def _bwd(res, g):
    x, w = res
    return g @ w.T, x.T @ g


few_row_matmul.defvjp(_fwd, _bwd)


@jax.custom_vjp
def few_row_matmul_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w.T`` for ``x [M, K]``, ``w [N, K]`` (a tied embedding as the output head), as
    :func:`few_row_matmul`."""
    _require()
    call = jax.ffi.ffi_call(TARGET_NT, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), x.dtype),
                            vmap_method="sequential")
    return jax.lax.platform_dependent(x, w, cpu=call, default=lambda x, w: x @ w.T)


def _fwd_nt(x, w):
    return few_row_matmul_nt(x, w), (x, w)


def _bwd_nt(res, g):
    x, w = res
    return g @ w, g.T @ x


few_row_matmul_nt.defvjp(_fwd_nt, _bwd_nt)
