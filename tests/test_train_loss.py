"""The one-pass training loss over packed op histories against its oracles.

* the op-by-op run (append / drop / repos per segment, :func:`op_by_op_token_losses`): per
  target losses equal at 1e-5 and ``jax.grad`` equal;
* the float64 numpy dense reference of the op semantics (its own logits, its own CE);
* finite differences of the one-pass loss itself (central, along random directions and on
  single coordinates);
* packing leaks nothing across trajectories (perturbing one leaves the other's losses
  bit-identical).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ops_cases import classify, random_history

from akv_jax.cache.dense_reference import DenseModel
from akv_jax.cache.ops import parse_history
from akv_jax.model.params import seeded_params
from akv_jax.model.presets import tiny_config
from akv_jax.train.example import TrainTrajectory
from akv_jax.train.loss import loss, op_by_op_token_losses, token_losses
from akv_jax.train.pack import PackShape, pack

SHAPE = PackShape(
    max_tokens=160, page_size=8, block_q=8, max_segments=16, max_trajectories=3, max_versions=6
)
CAPACITY = 64  # of the op-by-op oracle's state: one compiled op set for every trajectory


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config()
    return cfg, seeded_params(cfg, 0)


def random_trajectory(rng: np.random.Generator, n_max: int = 5, len_max: int = 10):
    segs, h = random_history(rng, n_max=n_max, len_max=len_max)
    # about half the tokens are targets, whole segments off now and then (a user turn)
    masks = [(rng.random(len(s)) < 0.6) & (rng.random() < 0.8) for s in segs]
    return TrainTrajectory(segs, h, masks)


def random_pack(rng, count: int):
    trajs = [random_trajectory(rng) for _ in range(count)]
    return trajs, pack(trajs, SHAPE)


@functools.cache
def _jit_rows(cfg):
    return jax.jit(lambda p, ex: token_losses(p, cfg, ex, SHAPE))


@functools.cache
def _jit_value_and_grad(cfg):
    return jax.jit(jax.value_and_grad(lambda p, ex: loss(p, cfg, ex, SHAPE)))


def op_by_op(params, cfg, traj):
    return op_by_op_token_losses(
        params, cfg, traj, block_q=8, page_size=8, capacity=CAPACITY, segment_pad=16
    )


def rows_of(ex, i: int) -> np.ndarray:
    """Rows of trajectory i whose target is in the trajectory (all but its last row)."""
    rows = np.nonzero(ex.row_trajectory == i)[0]
    return rows[:-1]


def test_one_pass_equals_op_by_op_and_dense(tiny):
    cfg, params = tiny
    dm = DenseModel(params, cfg)
    rng = np.random.default_rng(0)
    kinds = set()
    for _ in range(4):
        trajs, ex = random_pack(rng, 3)
        got = np.asarray(_jit_rows(cfg)(params, ex))
        for i, t in enumerate(trajs):
            kinds |= classify(t.history)
            want = np.asarray(op_by_op(params, cfg, t))
            np.testing.assert_allclose(got[rows_of(ex, i)], want, atol=1e-5, rtol=0)
            # float64 dense reference: its own logits and its own log-softmax
            logits, _ = dm.run(t.segments, t.history)
            tok = np.concatenate(t.segments)
            lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
            ce = lse[:-1] - logits[np.arange(len(tok) - 1), tok[1:]]
            m = np.concatenate(t.loss_mask)[1:].astype(float)
            np.testing.assert_allclose(got[rows_of(ex, i)], m * ce, atol=1e-5, rtol=0)
        assert not got[ex.weights == 0].any()
    assert {"drop_first", "middle_drop_then_repos", "several_repos"} <= kinds, kinds


def _op_by_op_mean(params, cfg, trajs):
    rows = [op_by_op(params, cfg, t) for t in trajs]
    w = sum(float(np.concatenate(t.loss_mask)[1:].sum()) for t in trajs)
    return sum(r.sum() for r in rows) / w


def test_grad_equals_op_by_op_grad(tiny):
    cfg, params = tiny
    rng = np.random.default_rng(1)
    trajs, ex = random_pack(rng, 2)
    assert any(t.history.drops for t in trajs) and any(t.history.repos for t in trajs)
    l1, g1 = _jit_value_and_grad(cfg)(params, ex)
    l2, g2 = jax.value_and_grad(lambda p: _op_by_op_mean(p, cfg, trajs))(params)
    np.testing.assert_allclose(float(l1), float(l2), atol=1e-5, rtol=0)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g2), strict=True
    ):
        scale = float(jnp.abs(b).max())
        assert scale > 0, path
        np.testing.assert_allclose(
            np.asarray(a),
            np.asarray(b),
            atol=1e-5 * max(scale, 1.0),
            rtol=1e-4,
            err_msg=jax.tree_util.keystr(path),
        )


def test_grad_matches_finite_differences(tiny):
    cfg, params = tiny
    rng = np.random.default_rng(2)
    trajs, ex = random_pack(rng, 2)
    vg = _jit_value_and_grad(cfg)
    _, g = vg(params, ex)

    def f(p):
        return vg(p, ex)[0]

    leaves, treedef = jax.tree.flatten(params)
    g_leaves = jax.tree.leaves(g)

    def shifted(direction, h):
        return jax.tree.unflatten(
            treedef, [x + h * d for x, d in zip(leaves, direction, strict=True)]
        )

    def central(direction, h=1e-2):
        # Richardson on two central differences: error O(h^4), f32 rounding ~1e-6 / h
        d1 = (f(shifted(direction, h)) - f(shifted(direction, -h))) / (2 * h)
        d2 = (f(shifted(direction, h / 2)) - f(shifted(direction, -h / 2))) / h
        return float((4 * d2 - d1) / 3)

    # unit directions over every parameter, half along the gradient and half random (a
    # purely random one is nearly orthogonal to it: a derivative too small to check in f32)
    gnorm = np.sqrt(sum(float((x**2).sum()) for x in g_leaves))
    for k in range(2):
        r = [rng.standard_normal(x.shape).astype(np.float32) for x in leaves]
        rnorm = np.sqrt(sum(float((x**2).sum()) for x in r))
        d = [np.asarray(gl) / gnorm + ri / rnorm for gl, ri in zip(g_leaves, r, strict=True)]
        norm = np.sqrt(sum(float((x**2).sum()) for x in d))
        d = [x / norm for x in d]
        want = sum(float((gl * di).sum()) for gl, di in zip(g_leaves, d, strict=True))
        np.testing.assert_allclose(central(d), want, rtol=2e-3, atol=2e-5, err_msg=f"dir {k}")
    # single coordinates: the largest gradient entry of a few leaves, the step sized to the
    # derivative so f32 rounding (~1e-6 / h) stays well under the relative tolerance
    for name, leaf_i in (("wq", 1), ("w_down", 10), ("embed", 0)):
        gi = np.asarray(g_leaves[leaf_i])
        idx = np.unravel_index(np.abs(gi).argmax(), gi.shape)
        d = [np.zeros(x.shape, np.float32) for x in leaves]
        d[leaf_i][idx] = 1.0
        h = float(np.clip(1e-3 / abs(gi[idx]), 1e-3, 0.05))
        np.testing.assert_allclose(central(d, h=h), gi[idx], rtol=2e-3, atol=2e-5, err_msg=name)


def test_no_attention_across_trajectories(tiny):
    cfg, params = tiny
    rng = np.random.default_rng(3)
    a, b, c = (random_trajectory(rng) for _ in range(3))
    fn = _jit_rows(cfg)
    base = pack([a, b, c], SHAPE)
    got = np.asarray(fn(params, base))
    # b's tokens replaced (same lengths, so the rows of a and c stay where they are), and its
    # ops changed: a's and c's losses are bit-identical
    b2 = TrainTrajectory(
        [rng.integers(0, 512, len(s)).tolist() for s in b.segments],
        parse_history({"drop": {"0": [0]}, "reposition": [0]}, len(b.segments)),
        b.loss_mask,
    )
    other = np.asarray(fn(params, pack([a, b2, c], SHAPE)))
    for i in (0, 2):
        rows = base.row_trajectory == i
        np.testing.assert_array_equal(got[rows], other[rows])
    assert not np.array_equal(got[base.row_trajectory == 1], other[base.row_trajectory == 1])
