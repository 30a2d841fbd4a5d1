"""``--deterministic`` (issue 38): what a GPU or TPU server runs so that a request's bits do not
depend on the batch: every projection through the fixed-tile Pallas matmul and the GPU
attention body without split-K. Here both run interpreted on the CPU, through the engine: a
request's tokens and float32 log-prob bits amid other requests are its bits alone, and within
1e-4 of the default CPU engine's answer (itself checked against the dense reference and
transformers elsewhere)."""

import jax.numpy as jnp
import numpy as np
import pytest
from bitwise_cases import PROBES, SCENARIOS, bits, drive, engine, probe_request, setup

from akv_jax.kernels.cpu.projection import CPU
from akv_jax.kernels.projection import XLA
from akv_jax.pallas.dispatch import make_projection
from akv_jax.pallas.fixed_tile_projection import fixed_tile_projection
from akv_jax.serving import executor
from akv_jax.serving.engine import Engine

INTERPRETED = fixed_tile_projection(interpret=True)


@pytest.fixture
def gpu_configuration(monkeypatch):
    """Engines whose groups take the fixed-tile projection, interpreted (on a GPU,
    ``make_projection(deterministic=True)`` gives it compiled)."""
    monkeypatch.setattr(executor, "make_projection",
                        lambda deterministic=False: INTERPRETED if deterministic else CPU)


@pytest.mark.parametrize("arch,tied", [
    ("qwen3", True),
    pytest.param("gpt_oss", False, marks=pytest.mark.slow),  # sinks and windows: 3 min
])
def test_deterministic_mode_keeps_a_requests_bits(gpu_configuration, arch, tied):
    det = setup(arch, tied, attention_backend="pallas", deterministic=True)
    cache = PROBES["drops+repos"]
    want_toks, want_lps = drive(engine(det), {0: [probe_request(cache)]})
    for name in ["amid 7 decoding when it arrives", "beside a long prompt in slices"]:
        toks, lps = SCENARIOS[name](det, cache)
        assert toks == want_toks, name
        np.testing.assert_array_equal(bits(lps), bits(want_lps), err_msg=name)
    default_toks, default_lps = drive(engine(setup(arch, tied)), {0: [probe_request(cache)]})
    assert want_toks == default_toks
    np.testing.assert_allclose(want_lps, default_lps, atol=1e-4, rtol=0)


def test_the_projection_is_the_products():
    """Each product of the backend against XLA's einsum, the tied head included."""
    rng = np.random.default_rng(0)
    x3 = jnp.asarray(rng.standard_normal((5, 4, 24)), jnp.float32)
    x2 = jnp.asarray(rng.standard_normal((5, 48)), jnp.float32)
    w = {"td,dhk->thk": jnp.asarray(rng.standard_normal((48, 4, 24)), jnp.float32),
         "thk,hkd->td": jnp.asarray(rng.standard_normal((4, 24, 48)), jnp.float32)}
    for eq, wt in w.items():
        x = x2 if eq.startswith("td") else x3
        got = INTERPRETED(eq, x, wt, jnp.asarray([3]))
        want = XLA(eq, x, wt, jnp.asarray([3]))
        np.testing.assert_allclose(got, want, atol=1e-4)
        assert not np.asarray(got[3:]).any()
    embed = jnp.asarray(rng.standard_normal((300, 48)), jnp.float32)
    np.testing.assert_allclose(INTERPRETED.head(x2, embed, tied=True), x2 @ embed.T,
                               atol=1e-4)
    with pytest.raises(ValueError, match="not a product by weights"):
        INTERPRETED("td,hdk->thk", x2, w["td,dhk->thk"].transpose(1, 0, 2))


def test_the_flag_picks_the_backends():
    assert make_projection("cuda", deterministic=True) is fixed_tile_projection("cuda")
    assert make_projection("tpu", deterministic=True).name == "fixed_tile"
    assert make_projection("cuda") is XLA
    assert make_projection("cpu", deterministic=True) is CPU
    tiny = setup("qwen3")
    with pytest.raises(ValueError, match="one device per group"):
        Engine(tiny.model, tp=2, deterministic=True)

