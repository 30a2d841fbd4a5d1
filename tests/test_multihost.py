"""Multi-host serving in the form this machine allows: two processes on localhost, each with
one CPU device, joined by jax.distributed (gloo) into one tp=2 mesh. Process 0 serves HTTP,
process 1 follows in lock step. Tokens and log-probs equal the single-process engine's."""

from __future__ import annotations

import socket
import subprocess
import sys

import numpy as np
from engine_cases import random_requests, run

from akv_jax.agent.launch import LocalServer
from akv_jax.serving.engine import Engine
from converters.loading import load_model

ARGS = ("--model-path", "tiny", "--max-total-tokens", "4096", "--page-size", "8", "--tp", "2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one():
    coord = f"127.0.0.1:{_free_port()}"
    dist = ("--num-processes", "2", "--dist-coordinator", coord)
    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "akv_jax.serving.main",
            *ARGS,
            *dist,
            "--process-id",
            "1",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    leader = None
    try:
        leader = LocalServer([*ARGS, *dist, "--process-id", "0"])
        reqs = random_requests(np.random.default_rng(21), 6, vocab=512)
        got = []
        with leader.client() as c:
            for segs, cache in reqs:
                r = c.post(
                    "/generate",
                    json={
                        "input_ids": segs,
                        "cache": cache,
                        "return_logprob": True,
                        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                    },
                )
                assert r.status_code == 200, r.text
                body = r.json()
                got.append((body["output_ids"], body["output_token_logprobs"]))
            # a state change (flush) is replicated to the follower, which keeps serving
            assert c.post("/flush_cache").json() == {"flushed": True}
            again = c.post(
                "/generate",
                json={
                    "input_ids": reqs[0][0],
                    "cache": reqs[0][1],
                    "sampling_params": {"max_new_tokens": 4},
                },
            )
            assert again.json()["output_ids"] == got[0][0]
    finally:
        if leader is not None:
            leader.stop()
        try:
            rc = follower.wait(timeout=60)  # the leader's shutdown tells it to stop
        except subprocess.TimeoutExpired:
            follower.kill()
            raise AssertionError("the follower did not stop with the leader") from None
    assert rc == 0, follower.stderr.read()[-2000:]
    solo = run(Engine(load_model("tiny"), max_total_tokens=4096, page_size=8), reqs, True)
    for (toks, lps), (want_toks, want_lps, _) in zip(got, solo, strict=True):
        assert toks == want_toks
        np.testing.assert_allclose(lps, want_lps, atol=1e-4)
