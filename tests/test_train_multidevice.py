"""Data + tensor parallel training on 8 host devices: a dp=2, tp=2 mesh gives the
single-device loss, gradient and updated params.

Run in its own process (the device count is fixed when jax starts):

    pytest -m multidevice tests/test_train_multidevice.py
"""

from __future__ import annotations

import os
import sys

# Must precede the first jax import of this process (see test_sharding_multidevice.py).
_FLAG = "--xla_force_host_platform_device_count=8"
if "jax" not in sys.modules and _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from akv_jax.cache.ops import parse_history  # noqa: E402
from akv_jax.model.params import make_mesh, seeded_params  # noqa: E402
from akv_jax.model.presets import tiny_config  # noqa: E402
from akv_jax.train.example import TrainTrajectory  # noqa: E402
from akv_jax.train.loss import loss  # noqa: E402
from akv_jax.train.optim import OptimConfig  # noqa: E402
from akv_jax.train.pack import PackShape, pack, stack  # noqa: E402
from akv_jax.train.step import (  # noqa: E402
    init_state,
    make_train_step,
    shard_batch,
    shard_state,
)

pytestmark = pytest.mark.multidevice

SHAPE = PackShape(max_tokens=64, page_size=8, block_q=8, max_segments=8, max_trajectories=2)
# Adam's eps well above the sharded/unsharded gradient rounding (~1e-9): with the default
# 1e-8 a parameter whose gradient is ~0 takes a sign-like step of either sign, so the
# params would differ by ~lr there however exact the parallel gradient is.
OPTIM = OptimConfig(lr=1e-2, warmup_steps=1, total_steps=10, eps=1e-4)
# Sharded and unsharded runs differ only in how XLA splits the sums across devices.
ATOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
    if jax.device_count() < 8:
        pytest.fail(f"needs {_FLAG} before jax starts: run this file in its own process")


def batch_of(rng, packs: int):
    out = []
    for _ in range(packs):
        trajs = []
        for _ in range(2):
            lens = rng.integers(3, 12, size=3)
            segs = [rng.integers(0, 512, n).tolist() for n in lens]
            h = parse_history({"drop": {"1": [0]}, "reposition": [1]}, 3)
            trajs.append(TrainTrajectory(segs, h, [rng.random(n) < 0.7 for n in lens]))
        out.append(pack(trajs, SHAPE))
    return stack(out)


def test_dp2_tp2_equals_single_device():
    cfg = tiny_config()
    params = seeded_params(cfg, 0)
    batch = batch_of(np.random.default_rng(0), 4)
    mesh = make_mesh(2, jax.devices()[:4])
    assert dict(mesh.shape) == {"data": 2, "tensor": 2}

    vg = jax.jit(jax.value_and_grad(lambda p, b: loss(p, cfg, b, SHAPE)))
    want_loss, want_grad = vg(params, batch)
    one = init_state(params, OPTIM)
    sharded = shard_state(one, cfg, OPTIM, mesh)
    sb = shard_batch(batch, mesh)
    assert sharded.trainable.layers.wq.sharding.spec[2] == "tensor"
    assert sb.tokens.sharding.spec[0] == "data"
    got_loss, got_grad = vg(sharded.trainable, sb)
    np.testing.assert_allclose(float(got_loss), float(want_loss), atol=ATOL, rtol=0)
    for a, b in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=1e-4)

    step = make_train_step(cfg, SHAPE, OPTIM, donate=False)
    for _ in range(2):
        one, m1 = step(one, batch)
        sharded, m2 = step(sharded, sb)
        for k in ("loss", "grad_norm", "tokens", "lr"):
            np.testing.assert_allclose(float(m2[k]), float(m1[k]), atol=ATOL, rtol=1e-5)
    assert sharded.trainable.layers.w_up.sharding.spec[2] == "tensor"
    for a, b in zip(
        jax.tree.leaves(sharded.trainable), jax.tree.leaves(one.trainable), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=1e-4)


def test_batch_must_split_over_data():
    mesh = make_mesh(2, jax.devices()[:4])
    with pytest.raises(ValueError, match="batch of 3 packs does not split over data=2"):
        shard_batch(batch_of(np.random.default_rng(1), 3), mesh)


def test_cli_trains_on_a_dp_tp_mesh_with_the_single_device_losses(tmp_path, capsys):
    """``python -m akv_jax.train --dp 2 --tp 2``: the log's losses are the one-device run's,
    and a mesh the process cannot hold or a batch that does not split is one line, exit 2."""
    from akv_jax.train import cli
    from akv_jax.train.sources import chat_records, write_jsonl
    from akv_jax.train.synthetic import agent_chats
    from converters.loading import TINY_TOKENIZERS

    tok = TINY_TOKENIZERS["tiny"](512)
    recs = list(chat_records(agent_chats(0, 6, turns=2, lines=2), tok, keep_tools=1,
                             repos_threshold=300))
    write_jsonl(tmp_path / "train.jsonl", recs[:4])
    write_jsonl(tmp_path / "eval.jsonl", recs[4:])
    run = ["--model-path", "tiny", "--steps", "2", "--lr", "1e-3", "--batch", "2",
           "--max-tokens", "448", "--max-segments", "16", "--max-trajectories", "1",
           "--max-versions", "4", "--no-progress", "--compile-cache-dir", "none",
           "--data", str(tmp_path / "train.jsonl"),
           "--eval-data", str(tmp_path / "eval.jsonl")]  # fmt: skip

    def losses(out: str, *mesh: str) -> list[dict]:
        assert cli.main([*run, "--out", str(tmp_path / out), *mesh]) == 0
        log = cli.read_log(tmp_path / out / cli.LOG_NAME)
        return [{k: v for k, v in e.items() if k != "tokens_per_s"} for e in log]

    one, mesh = losses("one"), losses("mesh", "--dp", "2", "--tp", "2")
    assert [sorted(e) for e in one] == [sorted(e) for e in mesh]
    for a, b in zip(one, mesh, strict=True):
        for k, v in a.items():
            np.testing.assert_allclose(b[k], v, rtol=1e-5, atol=1e-6, err_msg=k)

    capsys.readouterr()
    for flags, error in ((["--dp", "2", "--tp", "8"], "needs 16 devices; this process has 8"),
                         (["--dp", "4"], "--batch 2 does not split over --dp 4")):  # fmt: skip
        assert cli.main([*run, "--out", str(tmp_path / "bad"), *flags]) == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert error in err and len(err.strip().splitlines()) == 1, err
