"""The fixed-tile Pallas matmul (``akv_jax/pallas/matmul.py``), interpreted on the CPU: its
products against the float64 product and its reference, and a row's bits independent of the
rows beside it (their number, the row's place, NaN in the others)."""

import jax.numpy as jnp
import numpy as np
import pytest

from akv_jax.pallas.matmul import (
    DEFAULT_TILES,
    GPU_FLOAT32_TILES,
    Tiles,
    default_tiles,
    fixed_tile_matmul,
    matmul_reference,
)

SMALL = Tiles(bm=8, bn=128, bk=128)  # small tiles: several of each in a small product


def operands(m: int, k: int, n: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype)


@pytest.mark.parametrize("m,k,n", [(1, 96, 200), (17, 256, 128), (30, 300, 130)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tiles", [SMALL, GPU_FLOAT32_TILES], ids=["small", "gpu_f32"])
def test_products_are_the_reference(m, k, n, dtype, tiles):
    x, w = operands(m, k, n, dtype)
    got = np.asarray(fixed_tile_matmul(x, w, tiles=tiles, out_dtype=jnp.float32,
                                       interpret=True), np.float64)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    ref = np.asarray(matmul_reference(x, w), np.float64)
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
    assert fixed_tile_matmul(x, w, tiles=SMALL, interpret=True).dtype == dtype


def test_a_row_keeps_its_bits_whatever_rows_are_beside_it():
    """Row 0 of ``x`` alone, then at other places in 5, 8, 20 and 37 rows whose other rows
    are random or NaN: the same float32 bits every time."""
    x, w = operands(37, 300, 260, jnp.float32, seed=1)
    row = x[:1]
    alone = np.asarray(fixed_tile_matmul(row, w, tiles=SMALL, interpret=True))
    rng = np.random.default_rng(2)
    for m in (5, 8, 20, 37):
        for place in sorted({0, m // 2, m - 1}):
            for poison in (False, True):
                others = np.asarray(x[:m]).copy()
                if poison:
                    others[:] = np.nan
                else:
                    others = rng.permutation(others)
                others[place] = np.asarray(row[0])
                got = np.asarray(fixed_tile_matmul(jnp.asarray(others), w, tiles=SMALL,
                                                   interpret=True))
                np.testing.assert_array_equal(got[place].view(np.int32),
                                              alone[0].view(np.int32))
                if poison:
                    assert np.isnan(np.delete(got, place, axis=0)).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_transposed_weight_is_read_in_place(dtype):
    """``transpose_w``: ``x @ w.T`` for ``w`` [N, K] (a tied embedding), against the float64
    product, the reference, and the same product of the transposed copy, bit for bit."""
    x, w = operands(19, 300, 260, dtype, seed=4)
    wt = jnp.asarray(np.asarray(w, np.float32).T, dtype)  # [N, K]
    got = fixed_tile_matmul(x, wt, tiles=SMALL, out_dtype=jnp.float32, transpose_w=True,
                            interpret=True)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)
    ref = matmul_reference(x, wt, transpose_w=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=tol, atol=tol)
    plain = fixed_tile_matmul(x, w, tiles=SMALL, out_dtype=jnp.float32, interpret=True)
    np.testing.assert_array_equal(np.asarray(got).view(np.int32),
                                  np.asarray(plain).view(np.int32))
    alone = fixed_tile_matmul(x[5:6], wt, tiles=SMALL, out_dtype=jnp.float32,
                              transpose_w=True, interpret=True)
    np.testing.assert_array_equal(np.asarray(alone)[0].view(np.int32),
                                  np.asarray(got)[5].view(np.int32))


def test_shapes_must_agree():
    x, w = operands(4, 64, 32, jnp.float32)
    with pytest.raises(ValueError, match="fixed_tile_matmul"):
        fixed_tile_matmul(x, w[:32], interpret=True)
    with pytest.raises(ValueError, match=r"\[32, 60\]\.T"):
        fixed_tile_matmul(x, w[:60].T, transpose_w=True, interpret=True)


def test_tiles_by_dtype_and_platform():
    """float32 on a GPU takes the smaller tiles (the larger spill registers on sm_80 and
    sm_90: tests/test_aot.py compiles them); everything else the default."""
    assert default_tiles(jnp.float32, "cuda") == GPU_FLOAT32_TILES
    assert default_tiles(jnp.bfloat16, "cuda") == DEFAULT_TILES
    assert default_tiles(jnp.float32, "tpu") == DEFAULT_TILES
