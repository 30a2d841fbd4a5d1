"""Issue 14: params loaded straight into their tensor-parallel shardings, on 8 host devices.

``load_model(..., placement=mesh)`` must give bitwise the params of the old path (load onto
one device, then ``shard_params``), and no device may ever hold a whole sharded param on the
way: every transfer is watched. Run in its own process:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest -m multidevice \
        tests/test_sharded_load_multidevice.py
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

_FLAG = "--xla_force_host_platform_device_count=8"
if "jax" not in sys.modules and _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from akv_jax.model.params import leaf_shardings, make_mesh, shard_params  # noqa: E402
from akv_jax.serving.executor import load_placement  # noqa: E402
from converters.convert import convert_to_checkpoint  # noqa: E402
from converters.loading import load_model  # noqa: E402
from converters.sources import open_hf_dir  # noqa: E402

pytestmark = pytest.mark.multidevice

MXFP4_DIR = Path(__file__).parent / "fixtures" / "tiny_gpt_oss_mxfp4"


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
    if jax.device_count() < 8:
        pytest.fail(f"needs {_FLAG} before jax starts: run this file in its own process")


@pytest.fixture(scope="module")
def orbax_dirs(tmp_path_factory):
    """The MXFP4 fixture converted to orbax folders: dense experts, and packed ones."""
    root = tmp_path_factory.mktemp("orbax")
    out = {}
    for packed in (False, True):
        out[packed] = convert_to_checkpoint(
            open_hf_dir(MXFP4_DIR), root / f"packed{packed}", "float32", progress=False,
            keep_packed=packed,
        )
    return out


def _sharded_shapes(params, cfg, mesh) -> set[tuple[int, ...]]:
    """Global shapes of the params that ``mesh`` really splits."""
    flat = zip(jax.tree.leaves(params), jax.tree.leaves(leaf_shardings(params, cfg, mesh)),
               strict=True)
    return {tuple(x.shape) for x, s in flat if any(a is not None for a in s.spec)}


class _Watch:
    """Records every array of a sharded param's full shape handed to one device."""

    def __init__(self, monkeypatch, shapes):
        self.shapes, self.whole, self.callbacks = shapes, [], 0
        put, asarray, array = jax.device_put, jnp.asarray, jnp.array
        from_callback = jax.make_array_from_callback

        def single(target) -> bool:
            if target is None or isinstance(target, jax.Device):
                return True
            return isinstance(target, jax.sharding.Sharding) and len(target.device_set) == 1

        def whole(x) -> bool:
            return tuple(getattr(x, "shape", ())) in self.shapes

        def watched_put(x, device=None, *a, **k):
            for leaf, tgt in _pairs(x, device):
                if whole(leaf) and single(tgt):
                    self.whole.append(("device_put", leaf.shape))
            return put(x, device, *a, **k)

        def watched_asarray(x, *a, **k):
            if whole(x):
                self.whole.append(("asarray", x.shape))
            return asarray(x, *a, **k)

        def watched_array(x, *a, **k):
            if whole(x):
                self.whole.append(("array", x.shape))
            return array(x, *a, **k)

        def watched_from_callback(shape, sharding, cb, *a, **k):
            def checked(index):
                piece = cb(index)
                self.callbacks += 1
                if tuple(shape) in self.shapes and piece.shape == tuple(shape):
                    if not sharding.is_fully_replicated:
                        self.whole.append(("callback", tuple(shape)))
                return piece

            return from_callback(shape, sharding, checked, *a, **k)

        monkeypatch.setattr(jax, "device_put", watched_put)
        monkeypatch.setattr(jnp, "asarray", watched_asarray)
        monkeypatch.setattr(jnp, "array", watched_array)
        monkeypatch.setattr(jax, "make_array_from_callback", watched_from_callback)


def _pairs(x, target):
    leaves = jax.tree.leaves(x)
    if target is None or isinstance(target, (jax.Device, jax.sharding.Sharding)):
        return [(leaf, target) for leaf in leaves]
    return list(zip(leaves, jax.tree.leaves(target), strict=False))


def _assert_same(new, old):
    fn, tn = jax.tree_util.tree_flatten_with_path(new)
    fo, to = jax.tree_util.tree_flatten_with_path(old)
    assert tn == to
    for (path, a), (_, b) in zip(fn, fo, strict=True):
        where = jax.tree_util.keystr(path)
        assert isinstance(a, jax.Array), where
        assert a.sharding == b.sharding, where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        np.testing.assert_array_equal(
            np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=where
        )
        # every device holds exactly its own shard, nothing more
        want = a.sharding.shard_shape(a.shape)
        assert {s.data.shape for s in a.addressable_shards} == {want}, where


CASES = [
    ("tiny-gpt-oss", "bfloat16", "dense"),
    ("fixture", "float32", "dense"),
    ("fixture", "bfloat16", "mxfp4"),
    ("orbax-dense", "bfloat16", "dense"),
    ("orbax-dense", "float32", "mxfp4"),  # quantised on the host, then placed
    ("orbax-packed", "bfloat16", "mxfp4"),  # restored by orbax into the shardings
    ("orbax-packed", "float32", "dense"),  # dequantised on the host, then placed
]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_sharded_load_equals_load_then_shard(case, tp, orbax_dirs, monkeypatch):
    name, dtype, fmt = case
    src = {"fixture": MXFP4_DIR, "orbax-dense": orbax_dirs[False],
           "orbax-packed": orbax_dirs[True]}.get(name, name)
    mesh = make_mesh(tp, jax.devices()[:tp])
    old = load_model(src, dtype, moe_weight_format=fmt)
    want = shard_params(old.params, old.cfg, mesh)
    shapes = _sharded_shapes(want, old.cfg, mesh)
    assert shapes  # the mesh really splits something (heads, FFN / expert width)
    del old
    gc.collect()
    before = {id(x) for x in jax.live_arrays()}

    watch = _Watch(monkeypatch, shapes)
    got = load_model(src, dtype, moe_weight_format=fmt, placement=mesh)
    monkeypatch.undo()
    assert watch.whole == [], f"a whole sharded param went to one device: {watch.whole}"
    # nothing left behind either: no new single-device array of a sharded param's shape
    gc.collect()
    stray = [x.shape for x in jax.live_arrays() if id(x) not in before
             and len(x.sharding.device_set) == 1 and tuple(x.shape) in shapes]
    assert stray == []
    _assert_same(got.params, want)  # (after: its shard views are single-device arrays)
    if fmt == "mxfp4":
        assert got.params.layers.expert_gate.blocks.dtype == np.uint8


def test_host_placement_is_numpy_in_the_serving_dtype():
    m = load_model(MXFP4_DIR, "bfloat16", moe_weight_format="mxfp4", placement="host")
    leaves = jax.tree.leaves(m.params)
    assert all(isinstance(x, np.ndarray) for x in leaves)
    assert {str(x.dtype) for x in leaves} == {"bfloat16", "uint8"}


def test_served_tokens_at_tp2_and_disaggregated_equal_tp1():
    """The server's way (``load_placement``): loaded into the tp 2 mesh (the group then moves
    nothing), or on the host with one placement per ``--disaggregate 2,2`` group; the same
    tokens and log-probs as tp 1."""
    from engine_cases import random_requests, run

    from akv_jax.serving.engine import Engine

    kw = dict(max_total_tokens=512, page_size=8, attention_backend="reference")
    one = load_model("tiny")
    reqs = random_requests(np.random.default_rng(14), 2, vocab=one.cfg.vocab_size)
    want = run(Engine(one, **kw), reqs, concurrent=True)

    placement = load_placement(2, None)
    tp2 = load_model("tiny", placement=placement)
    eng = Engine(tp2, tp=2, **kw)
    assert eng.executor.prefill.params.layers.wq is tp2.params.layers.wq  # placed once
    host = load_model("tiny", placement=load_placement(1, (2, 2)))
    dis = Engine(host, disaggregate=(2, 2), **kw)
    for group, ids in ((dis.executor.prefill, {0, 1}), (dis.executor.decode, {2, 3})):
        assert {d.id for d in group.params.layers.wq.devices()} == ids
        assert group.params.layers.wq.addressable_shards[0].data.shape[2] == one.cfg.num_heads // 2
    for e in (eng, dis):
        got = run(e, reqs, concurrent=True)
        assert [g[0] for g in got] == [w[0] for w in want]
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a[1], b[1], atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["gguf", "default"])
def test_sharded_load_gguf_and_default(which, default_model_cache, monkeypatch):
    """The embedded default (SmolLM2-135M) at tp 2, from its GGUF file (converted in memory)
    and from the converted folder (orbax restores into the shardings): as load-then-shard."""
    from converters.loading import default_gguf_path

    src = default_gguf_path() if which == "gguf" else None
    mesh = make_mesh(2, jax.devices()[:2])
    old = load_model(src, "bfloat16")
    want = shard_params(old.params, old.cfg, mesh)
    shapes = _sharded_shapes(want, old.cfg, mesh)
    del old
    watch = _Watch(monkeypatch, shapes)
    got = load_model(src, "bfloat16", placement=mesh)
    monkeypatch.undo()
    assert shapes and watch.whole == []
    _assert_same(got.params, want)
