"""MXFP4 expert weights (converters/mxfp4.py) against a per-element reading of the format."""

import numpy as np
import pytest
from mxfp4_reference import E2M1, naive_dequantize

from converters import mxfp4


def test_the_table_is_e2m1():
    assert [E2M1[c] for c in range(16)] == mxfp4.FP4_VALUES.tolist()


def test_dequantize_reads_the_released_layout():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 2, 16), dtype=np.uint8)
    scales = rng.integers(117, 137, (3, 5, 2), dtype=np.uint8)
    got = mxfp4.dequantize(blocks, scales)
    assert got.shape == (3, 64, 5) and got.dtype == np.float32
    np.testing.assert_array_equal(got, naive_dequantize(blocks, scales))


def test_quantize_round_trips_representable_weights_and_bounds_the_rest():
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (2, 4, 3, 16), dtype=np.uint8)
    scales = rng.integers(120, 134, (2, 4, 3), dtype=np.uint8)
    exact = mxfp4.dequantize(blocks, scales)
    np.testing.assert_array_equal(mxfp4.dequantize(*mxfp4.quantize(exact)), exact)
    w = rng.normal(0, 0.05, (2, 64, 6)).astype(np.float32)
    b, s = mxfp4.quantize(w)
    assert b.shape == (2, 6, 2, 16) and s.shape == (2, 6, 2)
    back = mxfp4.dequantize(b, s)
    # The block scale 2^s puts the peak within (3, 6] * 2^s; e2m1 steps are at most 2 (4 -> 6),
    # so rounding errs by at most 2^s < peak / 3 (and the peak itself by at most 2^s / 2).
    peak = np.abs(w).reshape(2, 2, 32, 6).max(axis=2, keepdims=True)
    err = np.abs(back - w).reshape(2, 2, 32, 6)
    assert np.all(err < peak / 3)
    assert np.all(err.max(axis=2, keepdims=True) > 0)  # it did round (a real test of the bound)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(np.zeros((1, 30, 2), np.float32))
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.dequantize(np.zeros((1, 2, 3, 16), np.uint8), np.zeros((1, 2, 4), np.uint8))
