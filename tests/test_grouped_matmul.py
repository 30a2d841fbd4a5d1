"""The tiled grouped matmul (CPU path of the MoE experts) against jax.lax.ragged_dot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from akv_jax.pallas.grouped_matmul import grouped_matmul


@pytest.mark.parametrize("sizes, tile", [
    ([5, 0, 17, 3, 0, 9], 8),        # empty groups inside and between tiles
    ([0, 0, 40], 16),                # everything in the last group
    ([1] * 12, 4),                   # a group per row: many pairs per tile
    ([33, 31], 32),                  # boundaries just off the tile edges
    ([7, 0, 0], 8),                  # rows past sum(sizes) come out zero
])
def test_tiled_equals_ragged_dot(sizes, tile):
    rng = np.random.default_rng(len(sizes) * tile)
    M = max(sum(sizes), 10)
    x = jnp.asarray(rng.normal(size=(M, 12)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(len(sizes), 12, 5)), jnp.float32)
    g = jnp.asarray(sizes, jnp.int32)
    want = jax.lax.ragged_dot(x, w, g)
    got = jax.jit(lambda x, w, g: grouped_matmul(x, w, g, impl="tiled", tile=tile))(x, w, g)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    if sum(sizes) < M:
        assert not np.asarray(got)[sum(sizes):].any()


def test_tiled_does_no_dense_product_over_every_group():
    """The compiled CPU program multiplies [tile, K] @ [K, N] per pair, never the
    [M, G*K] spread that XLA:CPU makes of ragged_dot."""
    x, w = jnp.ones((64, 32)), jnp.ones((8, 32, 16))
    g = jnp.full((8,), 8, jnp.int32)
    hlo = jax.jit(lambda x, w, g: grouped_matmul(x, w, g, impl="tiled", tile=16)).lower(
        x, w, g).as_text()
    assert "ragged" not in hlo
    assert "tensor<64x256xf32>" not in hlo  # [M, G*K]
