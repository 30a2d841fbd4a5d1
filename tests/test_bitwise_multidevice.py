"""Bit for bit across devices (issue 38): at ``--tp 2`` and ``--disaggregate 2,2`` on forced host
devices, a request with drops and repos keeps its float32 log-prob bits whatever runs beside
it or was cached, against itself alone on a fresh engine of the same topology (a topology's
bits are its own: a row-parallel product sums its shards across the mesh). What makes it hold:
under a tensor-parallel mesh the CPU kernels run on each device's shards
(``akv_jax/kernels/cpu/per_shard.py``, the attention per head shard), where XLA's products,
whose sums follow the number of rows, would run: the first test shows the pieces.

Run in its own process (XLA_FLAGS must be set before jax is imported):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest -m multidevice tests/
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise_cases import PROBES, bits, engine, same_as_alone, setup
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from akv_jax.kernels.cpu import matmul as cpu_matmul
from akv_jax.kernels.cpu.projection import CPU
from akv_jax.model.forward import attention_inputs, rope_scaled
from akv_jax.model.params import make_mesh
from akv_jax.model.rope import rope_table_for

pytestmark = pytest.mark.multidevice

ROWS = [(1, 7), (3, 60), (16, 40), (20, 56), (24, 50), (32, 56), (48, 100), (64, 10)]


@pytest.mark.skipif(not cpu_matmul.available(), reason="the CPU kernels are not built here")
def test_sharded_products_keep_a_rows_bits_at_every_row_count():
    """A column-parallel product (FFN up, split on its output) feeding a row-parallel one
    (FFN down, split on its contracted axis, partial sums added across the mesh) at TP 2, at
    widths where XLA's own products move a row's bits with the row count: each row's result
    in 1-64 rows equals its bits in 320."""
    mesh = make_mesh(2, jax.devices()[:2])
    rng = np.random.default_rng(0)
    d, f = 512, 1024
    up = jax.device_put(jnp.asarray(rng.standard_normal((d, f)) / 20, jnp.float32),
                        NamedSharding(mesh, P(None, "tensor")))
    down = jax.device_put(jnp.asarray(rng.standard_normal((f, d)) / 20, jnp.float32),
                          NamedSharding(mesh, P("tensor", None)))
    x = jnp.asarray(rng.standard_normal((320, d)), jnp.float32)

    @jax.jit
    def mlp(x, up, down):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            h = CPU("td,df->tf", x, up)
            return h, CPU("tf,fd->td", h, down), CPU.head(x, up, tied=False)

    whole = [np.asarray(a) for a in mlp(x, up, down)]
    for rows, off in ROWS:
        part = mlp(x[off : off + rows], up, down)
        for got, want in zip(part, whole, strict=True):
            np.testing.assert_array_equal(bits(got), bits(want[off : off + rows]),
                                          err_msg=f"{rows} rows")


def test_rotated_queries_and_keys_keep_a_rows_bits_at_tp2():
    """A layer's q and k, normed and rotated, on the tiny model's weights at TP 2: each row's
    bits at 1-64 rows equal its bits in 128 (XLA:CPU fused the rotation's multiply-adds by
    the row count here, on an AVX-512 host, before it rounded each product alone)."""
    group = engine(setup("qwen3", tp=2)).executor.prefill
    cfg, mesh = group.cfg, group.mesh
    lp = jax.tree.map(lambda a: a[0], group.params.layers)
    rope = rope_table_for(cfg)
    rng = np.random.default_rng(0)
    on_mesh = functools.partial(jax.device_put, device=NamedSharding(mesh, P()))
    x = on_mesh(jnp.asarray(rng.standard_normal((128, cfg.hidden_size)), jnp.float32))
    pos = on_mesh(jnp.arange(100, 228, dtype=jnp.int32))

    @jax.jit
    def q_and_k(x, pos, live):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            q, k, _ = attention_inputs(cfg, lp, x, pos, rope, live, group.projection)
            return q, rope_scaled(k, pos, rope, cfg.rope.attention_scaling())

    whole = [np.asarray(a) for a in q_and_k(x, pos, on_mesh(jnp.int32(128)))]
    for rows, live in [(1, 1), (8, 1), (8, 5), (64, 33)]:
        part = q_and_k(x[:rows], pos[:rows], on_mesh(jnp.int32(live)))
        for got, want in zip(part, whole, strict=True):
            np.testing.assert_array_equal(bits(got[:live]), bits(want[:live]),
                                          err_msg=f"{rows} rows")


SITUATIONS = ["amid 7 decoding when it arrives", "beside a long prompt in slices",
              "from the cache", "evicted, recomputed"]


@pytest.mark.parametrize("topology", [{"tp": 2}, {"disaggregate": (2, 2)}],
                         ids=["tp2", "disaggregate2,2"])
def test_a_request_keeps_its_bits_on_several_devices(topology):
    same_as_alone(setup("qwen3", **topology), PROBES["drops+repos"], SITUATIONS)


@pytest.mark.slow
@pytest.mark.parametrize("arch,backend", [
    ("gpt_oss", "auto"), ("qwen3_moe", "auto"), ("minimax_m2", "auto"),
    ("qwen3", "reference"), ("qwen3", "pallas")])
def test_other_families_and_backends_keep_their_bits_at_tp2(arch, backend):
    """MiniMax-M2's q/k norm spans every head (a reduction across the head shards); the
    Pallas body runs per head shard (``dispatch``), interpreted."""
    same_as_alone(setup(arch, tp=2, attention_backend=backend), PROBES["drops+repos"],
                  SITUATIONS[:2])
