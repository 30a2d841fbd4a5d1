"""Bit for bit (issue 38): one request's answer, float32 log-prob bits included, does not
depend on what the server ran before or beside it. On the default CPU backend, one request
with ops against itself alone on a fresh engine: from the cache, after its prefixes were
cached, amid batches of other requests (arriving with it, decoding when it arrives,
arriving while it decodes), beside a long prompt prefilled in slices, with another
``prefill_chunk``, and preempted in a small pool. The pieces that made bits move with the
batch are tested on their own below: XLA:CPU's row reductions (norms, log-softmax) and its
one-row and 17-63-row products."""


import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise_cases import (
    PROBES,
    SAMPLED,
    SCENARIOS,
    bits,
    drive,
    engine,
    from_cache,
    probe_request,
    same_as_alone,
    segments,
    setup,
)

from akv_jax.cache.ops import parse_history
from akv_jax.kernels.cpu import matmul as cpu_matmul
from akv_jax.kernels.cpu.projection import CPU
from akv_jax.model.forward import rms_norm
from akv_jax.model.row_sum import pairwise_sum, row_logsumexp, row_sum
from akv_jax.serving.types import GenerateRequest, SamplingParams


@pytest.fixture(scope="module")
def model():
    return setup("qwen3")


@pytest.fixture(scope="module")
def alone(model):
    """The probe's answer alone on a fresh engine, run once a probe."""
    return functools.cache(lambda name: drive(engine(model), {0: [probe_request(PROBES[name])]}))


# The probe with drops only is the other's ops less its repos: every situation once more,
# under -m slow (CI's time).
PROBE_PARAMS = [pytest.param("drops", marks=pytest.mark.slow), "drops+repos"]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("probe", PROBE_PARAMS)
def test_a_request_keeps_its_bits_whatever_ran_before_or_beside_it(model, alone, probe,
                                                                   scenario):
    toks, lps = SCENARIOS[scenario](model, PROBES[probe])
    want_toks, want_lps = alone(probe)
    assert toks == want_toks
    np.testing.assert_array_equal(bits(lps), bits(want_lps))


@pytest.mark.parametrize("probe", PROBE_PARAMS)
def test_a_token_attends_alike_in_a_decode_step_and_a_prefill(model, probe):
    """Page size 1: from the cache, only the prompt's last token is recomputed, its
    attention one token's rows (a decode step's shape) where alone it was a row of its
    segment's prefill block; both score a key with the same chain of multiply-adds."""
    toks, lps = from_cache(model, PROBES[probe], page_size=1)
    want_toks, want_lps = drive(engine(model, page_size=1),
                                {0: [probe_request(PROBES[probe])]})
    assert toks == want_toks
    np.testing.assert_array_equal(bits(lps), bits(want_lps))


@pytest.mark.parametrize("backend", ["auto", "pallas"])
def test_a_turn_after_the_one_it_extends_keeps_its_bits(backend):
    """An agent's next turn: the first four segments (with their drops and repos) answered,
    then the same history with that answer and one more segment. After the first turn its
    answer's KV is the first turn's decode steps' (decode rows' attention and shapes);
    alone, it is prefilled with the rest of the prompt. With ``pallas`` (bits that follow
    the layout) the turn recomputes the answer's last, partial page, as laid out alone."""
    tiny = setup("qwen3", attention_backend=backend)
    cache = PROBES["drops+repos"]
    eng = engine(tiny)
    answer, _ = drive(eng, {0: [probe_request(cache, "first", upto=4)]}, "first")
    segs = segments()
    c = {"drop": {"3": [1]}, "reposition": [2]}
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    turn = GenerateRequest("probe", [*segs[:4], answer, segs[4]], parse_history(c, 6), sp,
                           return_logprob=True)
    toks, lps = drive(eng, {0: [turn]})
    reused = len(answer) - 1  # decoded: the last token has no KV
    if backend == "pallas":
        reused -= reused % 8  # the engine's page size (bitwise_cases.engine)
    assert eng.stats()["cache_hit_tokens"] == sum(map(len, segs[:4])) + reused
    want_toks, want_lps = drive(engine(tiny), {0: [turn]})
    assert toks == want_toks
    np.testing.assert_array_equal(bits(lps), bits(want_lps))


def test_a_seeded_sample_keeps_its_tokens_and_bits(model):
    """Temperature 0.8, top-p 0.95, a seed: the same tokens and log-prob bits whatever runs
    beside it (the draw is a function of the request's logits row and its own generator)."""
    same_as_alone(model, SAMPLED, ["from the cache", "amid 7 decoding when it arrives",
                                    "amid 16 arriving while it decodes"])


# MoE routing (the router's product and softmax), attention sinks and sliding windows, and
# the other attention backends, in the situations that moved their bits ("batch": a batch
# around the router, prefill slices moving a window's first page); -m slow runs each
# family on each backend in every situation.
BATCH = ["amid 7 decoding when it arrives", "beside a long prompt in slices"]
MATRIX = [(arch, backend) for arch in ("qwen3", "gpt_oss", "qwen3_moe")
          for backend in ("auto", "reference", "pallas")]


@pytest.mark.parametrize("arch,backend,situations", [
    *(pytest.param(arch, backend, BATCH, id=f"{arch}-{backend}-batch") for arch, backend in
      [("qwen3_moe", "auto"), ("gpt_oss", "auto"), ("qwen3", "reference")]),
    # The qwen3 default backend's every situation runs above, in CI. The Pallas bodies run
    # interpreted (the GPU body as --deterministic runs it).
    *(pytest.param(arch, backend, list(SCENARIOS), marks=pytest.mark.slow,
                   id=f"{arch}-{backend}-every") for arch, backend in MATRIX
      if (arch, backend) != ("qwen3", "auto")),
])
def test_other_families_and_backends_keep_their_bits(arch, backend, situations):
    same_as_alone(setup(arch, attention_backend=backend), PROBES["drops+repos"], situations)


# ---- the pieces


ROWS = [(1, 7), (3, 60), (20, 56), (24, 50), (32, 56)]  # (rows, offset) within 320


@pytest.mark.parametrize("fn", [
    lambda x: row_sum(x * x),
    row_logsumexp,
    lambda x: rms_norm(x, jnp.linspace(0.5, 1.5, x.shape[-1], dtype=jnp.float32), 1e-6),
], ids=["sum of squares", "logsumexp", "rms_norm"])
@pytest.mark.parametrize("width", [48, 512, 1031])
def test_row_reductions_do_not_depend_on_the_rows_beside(fn, width):
    """A row's bits are the same in a batch of 320 rows and in smaller batches at other
    offsets (XLA:CPU's own reductions fail this for the sum of squares of 48 columns)."""
    x = np.random.default_rng(width).standard_normal((320, width)).astype(np.float32) * 3
    f = jax.jit(fn)
    whole = np.asarray(f(jnp.asarray(x)))
    for rows, off in ROWS:
        part = np.asarray(f(jnp.asarray(x[off : off + rows])))
        np.testing.assert_array_equal(bits(part), bits(whole[off : off + rows]))


def test_pairwise_sum_is_the_sum():
    x = np.random.default_rng(0).standard_normal((5, 1031))
    np.testing.assert_allclose(np.asarray(pairwise_sum(jnp.asarray(x, jnp.float32))),
                               x.sum(-1), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(row_logsumexp(jnp.asarray(x, jnp.float32))),
                               np.log(np.exp(x).sum(-1)), rtol=1e-5)


@pytest.mark.skipif(not cpu_matmul.available(), reason="the CPU kernels are not built here")
@pytest.mark.parametrize("packed", [False, True])
def test_projection_rows_keep_their_bits_at_every_row_count(packed):
    """One row, a decode step's few, 17-63 and a prefill's many: each row's product has the
    same bits (one kernel or the other at every count, their sums alike)."""
    from akv_jax.kernels.cpu.projection import pack_stack

    rng = np.random.default_rng(1)
    w = rng.standard_normal((48, 96)).astype(np.float32)
    x = rng.standard_normal((320, 48)).astype(np.float32)
    if packed:
        stack = pack_stack(jnp.asarray(w[None]), 1, [0])
        f = jax.jit(lambda x: CPU("td,df->tf", x, stack.at(jnp.int32(0))))
    else:
        f = jax.jit(lambda x: CPU("td,df->tf", x, jnp.asarray(w)))
    whole = np.asarray(f(jnp.asarray(x)))
    for rows, off in [(1, 7), (2, 0), (9, 11), (16, 40), (17, 3), (24, 50), (48, 100),
                      (63, 1), (64, 200)]:
        part = np.asarray(f(jnp.asarray(x[off : off + rows])))
        np.testing.assert_array_equal(bits(part), bits(whole[off : off + rows]))
