"""Repos kernel (GPU and TPU bodies, interpret mode on the CPU) against ``repos_reference`` and
against RoPE itself, at positions up to 32k; and the server's re-rotated copies
(``DeviceGroup.rerotate_copy``, which runs the kernel) against the jnp rotation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from akv_jax.model.config import RopeConfig
from akv_jax.model.forward import KVPool
from akv_jax.model.params import seeded_params
from akv_jax.model.presets import tiny_config
from akv_jax.model.rope import make_rope_table, rope_table_for
from akv_jax.pallas.dispatch import make_repos_fn
from akv_jax.pallas.reference import repos_reference
from akv_jax.pallas.repos import repos_pallas
from akv_jax.pallas.rotary import apply_rope, rerotate
from akv_jax.serving.device_group import DeviceGroup

MAX_POS = 32768


@functools.lru_cache
def table(head_dim: int):
    return make_rope_table(RopeConfig(theta=500000.0), head_dim, MAX_POS)


def pool(rng, P, ps, Hkv, Dh, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal((P, ps, Hkv, Dh), np.float32), dtype)


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def run(body, k, pages, old, new, tab):
    return repos_pallas(k, jnp.asarray(pages, jnp.int32), jnp.asarray(old, jnp.int32),
                        jnp.asarray(new, jnp.int32), tab, body=body, interpret=True)


# (body, dtype, page_size, head_dim)
CASES = [
    ("gpu", jnp.float32, 16, 16),
    ("gpu", jnp.bfloat16, 1, 64),
    ("gpu", jnp.float32, 64, 128),
    ("tpu", jnp.float32, 16, 24),
    ("tpu", jnp.bfloat16, 64, 128),
]


@pytest.mark.parametrize("body,dtype,ps,dh", CASES,
                         ids=[f"{b}-{jnp.dtype(d).name}-ps{p}-d{h}" for b, d, p, h in CASES])
def test_repos_matches_reference_and_leaves_other_pages(body, dtype, ps, dh):
    rng = np.random.default_rng(0)
    P, Hkv = 9, 3
    k = pool(rng, P, ps, Hkv, dh, dtype)
    pages = np.array([5, 0, 7, P, P + 3])  # the last two are padding
    old = rng.integers(0, MAX_POS, (5, ps))
    new = rng.integers(0, MAX_POS, (5, ps))
    tab = table(dh)
    got = run(body, k, pages, old, new, tab)
    want = repos_reference(k, jnp.asarray(pages), jnp.asarray(old), jnp.asarray(new), tab)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)
    untouched = [p for p in range(P) if p not in pages]
    np.testing.assert_array_equal(_bits(got[np.array(untouched)]), _bits(k[np.array(untouched)]))
    assert not np.array_equal(_bits(got[5]), _bits(k[5]))  # a listed page did change


@pytest.mark.parametrize("body", ["gpu", "tpu"])
def test_repos_rope_identities(body):
    """Delta 0 is the identity; two shifts compose; rotate(rope(k, p), p -> q) == rope(k, q)."""
    rng = np.random.default_rng(1)
    P, ps, Hkv, dh = 6, 16, 2, 32
    tab = table(dh)
    raw = pool(rng, P, ps, Hkv, dh)
    pages = np.array([4, 1, 2])
    p0 = rng.integers(0, MAX_POS, (3, ps))
    p1 = rng.integers(0, MAX_POS, (3, ps))
    p2 = np.concatenate([np.arange(ps)[None], rng.integers(0, MAX_POS, (2, ps))])  # 0.. too

    def rope_pages(positions):
        # Keys of the listed pages rotated to `positions`; other pages stay raw.
        x = raw[pages].reshape(-1, Hkv, dh)
        rot = apply_rope(x, jnp.asarray(positions.reshape(-1)), tab).reshape(3, ps, Hkv, dh)
        return raw.at[pages].set(rot)

    k0 = rope_pages(p0)
    same = run(body, k0, pages, p0, p0, tab)
    np.testing.assert_allclose(np.asarray(same), np.asarray(k0), atol=1e-6, rtol=1e-6)

    via = run(body, run(body, k0, pages, p0, p1, tab), pages, p1, p2, tab)
    direct = run(body, k0, pages, p0, p2, tab)
    np.testing.assert_allclose(np.asarray(via), np.asarray(direct), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(direct), np.asarray(rope_pages(p2)), atol=1e-5,
                               rtol=1e-5)


def test_repos_donated_pool_keeps_unlisted_pages():
    """Under jit with the pool donated, the input is consumed and every page the kernel does
    not list keeps its bits, the listed ones equal the reference. Whether XLA reuses the very
    buffer is its choice (in the full CPU suite it sometimes does not), so the pointer is not
    asserted."""
    rng = np.random.default_rng(2)
    P, ps, Hkv, dh = 5, 16, 2, 16
    tab = table(dh)
    k = pool(rng, P, ps, Hkv, dh)
    k_bits = _bits(k).copy()  # host copy: k itself is consumed by the call
    pages = jnp.asarray([3, 1], jnp.int32)
    old = jnp.asarray(rng.integers(0, MAX_POS, (2, ps)), jnp.int32)
    new = jnp.asarray(rng.integers(0, MAX_POS, (2, ps)), jnp.int32)
    want = repos_reference(k, pages, old, new, tab)
    repos = make_repos_fn("pallas")  # CPU: the GPU body in interpret mode

    @functools.partial(jax.jit, donate_argnums=0)
    def step(k):
        return repos(k, pages, old, new, tab)

    k_new = step(k)
    # CPU, GPU and TPU all honour donation: the caller's pool is consumed.
    assert k.is_deleted()
    np.testing.assert_allclose(np.asarray(k_new), np.asarray(want), atol=1e-5, rtol=1e-5)
    untouched = np.array([0, 2, 4])
    np.testing.assert_array_equal(_bits(k_new)[untouched], k_bits[untouched])


def test_make_repos_fn_auto_is_reference_on_cpu():
    assert make_repos_fn("auto") is repos_reference
    assert make_repos_fn("reference") is repos_reference


@pytest.mark.parametrize("backend", ["pallas", "reference", "auto"])
def test_server_rerotated_copies_equal_the_jnp_rotation(backend):
    """The engine's pre-pass copies: key re-rotated old -> new into another slot (across pages,
    every layer), value copied; no other slot changes a bit. "pallas" on the CPU runs the GPU
    body in interpret mode, "auto" the reference (as for attention)."""
    cfg = tiny_config()
    P, ps = 6, 4
    group = DeviceGroup(cfg, seeded_params(cfg, 0), P, ps, jnp.float32, attention_backend=backend)
    assert (group._repos is repos_reference) == (backend != "pallas")  # the kernel runs
    rng = np.random.default_rng(3)
    shape = group.kv.k.shape  # [L, P, ps, Hkv, Dh]
    group.kv = KVPool(k=jnp.asarray(rng.standard_normal(shape), jnp.float32),
                      v=jnp.asarray(rng.standard_normal(shape), jnp.float32))
    k0, v0 = np.asarray(group.kv.k).copy(), np.asarray(group.kv.v).copy()
    rope = rope_table_for(cfg)
    # 11 copies (padded to 16 inside): sources and destinations on different pages, some
    # destinations in the middle of a page, positions up to the model's limit.
    src = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    dst = [13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
    old = rng.integers(0, cfg.max_position_embeddings, len(src)).tolist()
    new = rng.integers(0, cfg.max_position_embeddings, len(src)).tolist()
    group.rerotate_copy(list(zip(src, dst, old, new, strict=True)), rope)
    k, v = np.asarray(group.kv.k), np.asarray(group.kv.v)
    L, _, _, H, D = shape
    flat = lambda x: x.reshape(L, P * ps, H, D)  # noqa: E731
    for layer in range(L):
        want = rerotate(jnp.asarray(flat(k0)[layer, src]), jnp.asarray(old), jnp.asarray(new),
                        rope)
        np.testing.assert_allclose(flat(k)[layer, dst], np.asarray(want), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(flat(v)[:, dst], flat(v0)[:, src])
    rest = [i for i in range(P * ps) if i not in dst]
    np.testing.assert_array_equal(_bits(flat(k)[:, rest]), _bits(flat(k0)[:, rest]))
    np.testing.assert_array_equal(_bits(flat(v)[:, rest]), _bits(flat(v0)[:, rest]))


@pytest.mark.parametrize("body", ["gpu", "tpu"])
def test_repos_partial_rotary(body):
    """Partial rotary (MiniMax-M2: 16 of 32 dims, DESIGN §2.1): both bodies equal the jnp
    rotation, which equals rotating the raw key at the new position; the 16 pass-through
    dims of every listed page keep their bits."""
    rng = np.random.default_rng(4)
    P, ps, Hkv, dh, r = 6, 16, 2, 32, 16
    tab = make_rope_table(RopeConfig(theta=5e6), r, MAX_POS)
    assert tab.rotary_dim == r
    raw = pool(rng, P, ps, Hkv, dh)
    pages = np.array([4, 1, P])
    old = rng.integers(0, MAX_POS, (3, ps))
    new = rng.integers(0, MAX_POS, (3, ps))
    x = raw[pages[:2]].reshape(-1, Hkv, dh)
    k0 = raw.at[pages[:2]].set(
        apply_rope(x, jnp.asarray(old[:2].reshape(-1)), tab).reshape(2, ps, Hkv, dh))
    got = run(body, k0, pages, old, new, tab)
    want = repos_reference(k0, jnp.asarray(pages), jnp.asarray(old), jnp.asarray(new), tab)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    at_new = apply_rope(x, jnp.asarray(new[:2].reshape(-1)), tab).reshape(2, ps, Hkv, dh)
    np.testing.assert_allclose(np.asarray(got[pages[:2]]), np.asarray(at_new), atol=1e-5)
    np.testing.assert_array_equal(_bits(got)[..., r:], _bits(raw)[..., r:])
    moved = np.asarray(got)[pages[:2], ..., :r] - np.asarray(raw)[pages[:2], ..., :r]
    assert np.abs(moved).max() > 0.5
