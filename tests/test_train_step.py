"""The training step, its optimiser recipe, checkpoints and the serving export.

* one step equals optax's own clip + AdamW applied to ``jax.grad`` of the loss;
* accumulation over k equal micro-batches equals one step on that batch;
* LoRA-only steps leave the base params untouched;
* a run killed after a few steps and resumed from its checkpoint (state, optimiser, grain
  iterator) continues with the same losses, bit for bit;
* the export (LoRA merged) loads through ``load_model`` (what ``--model-path`` uses) and
  computes the trained model.
"""

from __future__ import annotations

import functools

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from akv_jax.cache.ops import parse_history
from akv_jax.model.params import seeded_params
from akv_jax.model.presets import tiny_config
from akv_jax.model.tokenizer import ChatTokenizer
from akv_jax.train.checkpoint import TrainCheckpointer, export_for_serving, serving_params
from akv_jax.train.example import TrainTrajectory
from akv_jax.train.lora import init_lora, merge
from akv_jax.train.loss import loss, pack_logits
from akv_jax.train.optim import OptimConfig, schedule
from akv_jax.train.pack import PackedExample, PackShape, pack, stack
from akv_jax.train.step import init_state, make_train_step
from converters.loading import load_model

SHAPE = PackShape(max_tokens=64, page_size=8, block_q=8, max_segments=8, max_trajectories=2)
OPTIM = OptimConfig(lr=1e-2, warmup_steps=2, total_steps=10, clip_norm=0.5)
# accumulating over 2 micro-batches: the other tests share its compiled steps (full and LoRA)
ACCUM = OptimConfig(lr=1e-2, warmup_steps=2, total_steps=10, clip_norm=0.5, accum_steps=2)


def trajectory(rng):
    lens = rng.integers(3, 10, size=3)
    segs = [rng.integers(0, 512, n).tolist() for n in lens]
    h = parse_history({"drop": {"1": [0]}, "reposition": [int(rng.integers(0, 3))]}, 3)
    return TrainTrajectory(segs, h, [rng.random(n) < 0.7 for n in lens])


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config()
    rng = np.random.default_rng(0)
    packs = [pack([trajectory(rng), trajectory(rng)], SHAPE) for _ in range(6)]
    return cfg, seeded_params(cfg, 0), packs


@functools.cache
def step_fn(cfg, optim):
    return make_train_step(cfg, SHAPE, optim, donate=False)


def test_steps_are_optax_adamw_on_the_loss_gradient(setup):
    cfg, params, packs = setup
    batch = stack(packs[:2])
    vg = jax.jit(jax.value_and_grad(lambda p: loss(p, cfg, batch, SHAPE)))
    tx = optax.chain(
        optax.clip_by_global_norm(0.5),
        optax.adamw(
            schedule(OPTIM),
            weight_decay=OPTIM.weight_decay,
            mask=lambda t: jax.tree.map(lambda x: x.ndim >= 2, t),
        ),
    )

    @jax.jit
    def manual(grads, opt, p):
        updates, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt

    state, want, opt = init_state(params, OPTIM), params, tx.init(params)
    # two steps: the warmup's first learning rate is 0, so the first update moves nothing
    for i, lr in enumerate((0.0, OPTIM.lr / 2)):
        state, m = step_fn(cfg, OPTIM)(state, batch)
        value, grads = vg(want)
        noise = jax.tree.map(lambda g: np.abs(np.asarray(g)) < 1e-4 * np.abs(np.asarray(g)).max(),
                             grads)
        want, opt = manual(grads, opt, want)
        np.testing.assert_allclose(float(m["loss"]), float(value), rtol=1e-6)
        np.testing.assert_allclose(float(m["grad_norm"]), float(optax.tree.norm(grads)), rtol=1e-5)
        assert float(m["lr"]) == pytest.approx(lr)  # linear warmup from 0
        assert int(state.step) == i + 1
    assert float(m["tokens"]) == float(batch.weights.sum())
    assert int(m["rows"]) == int((batch.row_trajectory >= 0).sum())
    moved = 0.0
    for a, b, p, tiny in zip(
        jax.tree.leaves(state.trainable),
        jax.tree.leaves(want),
        jax.tree.leaves(params),
        jax.tree.leaves(noise),
        strict=True,
    ):
        # Adam divides a gradient by its own size: where it is a cancellation's residue (under
        # 1e-4 of its leaf's largest), the step's and this separately compiled gradient round
        # it differently and the update may differ by up to the learning rate.
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(np.where(tiny, b, a), b, atol=1e-6)
        assert np.all(np.abs(a - b)[tiny] <= 2 * OPTIM.lr)
        moved = max(moved, float(jnp.abs(a - p).max()))
    assert moved > 1e-3


def test_accumulation_of_equal_micro_batches_is_one_step(setup):
    cfg, params, packs = setup
    batch = stack(packs[:2])
    assert {**ACCUM.__dict__, "accum_steps": 1} == OPTIM.__dict__
    plain, acc = init_state(params, OPTIM), init_state(params, ACCUM)
    for _ in range(2):  # two updates (the first at learning rate 0)
        plain = step_fn(cfg, OPTIM)(plain, batch)[0]
        acc = step_fn(cfg, ACCUM)(acc, batch)[0]
        # no update until the 2nd micro-batch
        for a, b in zip(jax.tree.leaves(acc.trainable), jax.tree.leaves(params), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        acc = step_fn(cfg, ACCUM)(acc, batch)[0]
    for a, b in zip(jax.tree.leaves(acc.trainable), jax.tree.leaves(plain.trainable), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_lora_steps_leave_the_base_alone(setup):
    cfg, params, packs = setup
    lora = init_lora(params, rank=2, seed=0)
    state = init_state(lora, ACCUM, frozen=params)
    batch = stack(packs[:2])
    for _ in range(4):
        state, m = step_fn(cfg, ACCUM)(state, batch)
    for a, b in zip(jax.tree.leaves(state.frozen), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.abs(state.trainable.wq.b).max()) > 0  # b moved off its zero init
    merged = serving_params(state)
    want = merge(params, state.trainable)
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _iterator(packs):
    ds = grain.MapDataset.source([p.to_dict() for p in packs]).shuffle(seed=7).repeat().batch(2)
    return iter(ds.to_iter_dataset())


def _run(step, params, packs, optim, steps, ckpt=None, save_at=None, resume=False, lora=False):
    """A training loop built from scratch (as a new process would, but for the compiled
    ``step``): losses of ``steps`` steps; saves at ``save_at``; ``resume`` starts from the
    checkpoint's latest step."""
    trainable = init_lora(params, rank=2, seed=0) if lora else params
    state = init_state(trainable, optim, frozen=params if lora else None)
    it = _iterator(packs)
    start = 0
    if resume:
        state = ckpt.restore(state, it)
        start = int(state.step)
    losses = []
    for i in range(start, steps):
        batch = PackedExample.from_dict(next(it))
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        if ckpt is not None and i + 1 == save_at:
            ckpt.save(i + 1, state, it)
            return losses, state
    return losses, state


@pytest.mark.parametrize("lora", [False, True])
def test_kill_and_resume_reproduces_the_losses(setup, tmp_path, lora):
    cfg, params, packs = setup
    optim = ACCUM
    step = step_fn(cfg, optim)
    full, _ = _run(step, params, packs, optim, 7, lora=lora)
    with TrainCheckpointer(tmp_path / "ckpt") as ck:  # stopped mid-accumulation, at step 3
        first, _ = _run(step, params, packs, optim, 7, ckpt=ck, save_at=3, lora=lora)
    with TrainCheckpointer(tmp_path / "ckpt") as ck:
        assert ck.latest_step() == 3
        rest, _ = _run(step, params, packs, optim, 7, ckpt=ck, resume=True, lora=lora)
    assert len(first) == 3 and len(rest) == 4
    assert first + rest == full
    assert len(set(full)) == len(full)  # the losses do move (a real curve, not a constant)


def test_export_loads_as_a_servable_model(setup, tmp_path):
    cfg, params, packs = setup
    state = init_state(init_lora(params, rank=2, seed=1, b_std=0.05), OPTIM, frozen=params)
    tok = ChatTokenizer.byte_level_chatml(cfg.vocab_size)
    out = export_for_serving(tmp_path / "model", cfg, state, tokenizer=tok)
    m = load_model(out, "float32")
    assert m.cfg == cfg and m.tokenizer is not None
    want = merge(params, state.trainable)
    for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    f = jax.jit(lambda p, ex: pack_logits(p, cfg, ex, SHAPE))
    np.testing.assert_array_equal(np.asarray(f(m.params, packs[0])), np.asarray(f(want, packs[0])))
    with pytest.raises(FileExistsError, match="not empty"):
        export_for_serving(out, cfg, state)
