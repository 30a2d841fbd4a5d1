"""The training forward scores what the server served bit for bit (issue 38): a greedy
answer to a request with drops and repositions, its float32 log-probs as the server
returned them, against the training loss of the same (tokens, ops) with the answer as one
more message: each row's loss is the negated log-prob, ``==`` on the bits. So rollouts the
trainer scores are on-policy to the last bit, on the CPU, with the server's default attention
backend in the training forward (a scoring pass: that backend has no VJP), and with the
gradient's forward (the jnp reference attention). The ulp the latter was off on decode rows
was the rotation's fused multiply-adds, not its attention (``rotary.rotate_half_split``)."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from akv_jax.cache.ops import parse_history
from akv_jax.model.forward import make_model_attention
from akv_jax.model.params import init_params
from akv_jax.model.presets import tiny_config
from akv_jax.serving.engine import Engine
from akv_jax.serving.types import GenerateRequest, SamplingParams
from akv_jax.train.example import TrainTrajectory
from akv_jax.train.loss import token_losses, train_attention
from akv_jax.train.pack import PackShape, pack

N_NEW = 12
VOCAB = 500
OPS = {"drop": {"3": [1], "5": [3]}, "reposition": [2, 4]}


def served(model, segments: list[list[int]], backend: str) -> tuple[list[int], list[float]]:
    eng = Engine(model, max_total_tokens=4096, page_size=8, attention_backend=backend,
                 admission_window_s=0.0)
    sp = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    eng.add_request(GenerateRequest("r", segments, parse_history(OPS, len(segments)), sp,
                                    return_logprob=True))
    events = []
    while eng.has_work():
        for ev in eng.step():
            assert ev.error is None, ev.error
            events.append(ev)
    return [e.token_id for e in events], [e.logprob for e in events]


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_training_loss_is_the_served_log_prob_negated(backend):
    cfg = tiny_config("qwen3")
    model = SimpleNamespace(cfg=cfg, params=init_params(cfg, jax.random.key(5)), tokenizer=None)
    rng = np.random.default_rng(3)
    segments = [rng.integers(0, VOCAB, n).tolist() for n in (40, 70, 25, 90, 33, 18)]
    tokens, logprobs = served(model, segments, backend)
    assert len(tokens) == N_NEW

    # the answer as one more message, under the view the last prompt message had
    trajectory = TrainTrajectory(
        [*segments, tokens], parse_history(OPS, len(segments) + 1),
        [np.zeros(len(s), bool) for s in segments] + [np.ones(N_NEW, bool)])
    shape = PackShape(max_tokens=320, page_size=8, block_q=16, max_segments=8,
                      max_trajectories=1, max_versions=3)
    ex = pack([trajectory], shape)
    attention = (train_attention(cfg, shape) if backend == "reference"
                 else make_model_attention(cfg, backend, shape.block_q))
    losses = np.asarray(jax.jit(lambda p, ex: token_losses(p, cfg, ex, shape,
                                                           attention=attention))(
        model.params, ex))
    # row j predicts token j + 1: the answer's tokens from the last prompt row on
    first = sum(map(len, segments)) - 1
    scored = -losses[first : first + N_NEW]
    np.testing.assert_array_equal(scored.view(np.int32),
                                  np.asarray(logprobs, np.float32).view(np.int32))
