"""Faults: an exception in one request's work fails that request only; disconnects abort;
multi-host faults stop the processes with a clear error instead of a hang.

Engine-level cases inject an exception (monkeypatching one engine method for one request) at
every stage of a request's life while other requests run beside it, and check that the other
requests' answers equal the same requests run alone, that nothing leaks (locks, half-written
nodes, pages), and that the KV left in the cache is still exact for later requests.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fastapi.testclient import TestClient
from server_support import scrape, shared_server, sse_events

from akv_jax.agent.launch import MODULE, LocalServer
from akv_jax.cache.ops import parse_history
from akv_jax.serving.api import create_app
from akv_jax.serving.async_engine import AsyncEngine
from akv_jax.serving.engine import Engine
from akv_jax.serving.types import GenerateRequest, SamplingParams
from converters.loading import load_model

N_NEW = 6
BASE = list(range(1, 41))  # 40 tokens (5 pages of 8) that most requests share
VICTIM_TOKENS = list(range(300, 311))  # only the victim's prompt holds these
# rid -> (segments, cache ops); "v" is the victim. "a" runs first, "b" "v" "c" "d" join
# while it decodes (sharing its prefix), "e" arrives while they decode.
REQS: dict[str, tuple[list[list[int]], dict | None]] = {
    "a": ([BASE, [41, 42, 43]], None),
    "b": ([BASE, [44, 45], [46, 47, 48]], {"drop": {"2": [1]}, "reposition": [2]}),
    "v": ([BASE, [49, 50, 51, 52], VICTIM_TOKENS], {"drop": {"2": [1]}, "reposition": [2]}),
    "c": ([BASE, [60, 61]], None),
    "d": ([[70, 71, 72, 73, 74]], None),
    "e": ([[80, 81, 82], [83, 84]], {"drop": {"1": [0]}}),
}
BOOM = "injected fault"


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def _engine(model) -> Engine:
    return Engine(model, max_total_tokens=2048, page_size=8, attention_backend="reference")


def _request(rid: str) -> GenerateRequest:
    segs, cache = REQS[rid]
    sp = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    return GenerateRequest(rid, segs, parse_history(cache, len(segs)), sp, return_logprob=True)


def _drive(eng: Engine, staged: bool = True) -> dict[str, list]:
    """Run REQS to the end: "a" first, "b v c d" once "a" has 2 tokens, "e" once "v" has
    one (``staged``), or all at once; every event by rid."""
    got: dict[str, list] = {rid: [] for rid in REQS}
    todo = ["a"] if staged else list(REQS)
    for rid in todo:
        eng.add_request(_request(rid))
    sent = set(todo)
    while eng.has_work() or len(sent) < len(REQS):
        if staged and "b" not in sent and len(got["a"]) >= 2:
            for rid in "bvcd":
                eng.add_request(_request(rid))
            sent |= set("bvcd")
        if staged and "e" not in sent and (got["v"] or len(got["a"]) >= 4):
            eng.add_request(_request("e"))
            sent.add("e")
        for ev in eng.step():
            got[ev.rid].append(ev)
    return got


@pytest.fixture(scope="module")
def solo(tiny) -> dict[str, tuple[list[int], list[float]]]:
    """Each request run alone on an empty cache."""
    eng = _engine(tiny)
    out = {}
    for rid in REQS:
        assert eng.flush_cache()
        eng.add_request(_request(rid))
        evs = []
        while eng.has_work():
            evs += eng.step()
        assert evs[-1].finish_reason == "length"
        out[rid] = ([ev.token_id for ev in evs], [ev.logprob for ev in evs])
    return out


def _assert_solo(events: list, want: tuple[list[int], list[float]], rid: str) -> None:
    assert [ev.token_id for ev in events] == want[0], rid
    np.testing.assert_allclose([ev.logprob for ev in events], want[1], atol=1e-4)
    assert events[-1].finished and events[-1].finish_reason == "length"


def _assert_clean(eng: Engine) -> None:
    """No request holds anything: no locks, no half-written nodes, and every page in use
    belongs to a cached node (none leaked)."""
    assert not eng.has_work()
    nodes = list(eng.cache.tree.nodes())
    assert all(n.lock == 0 and n.ends == 0 and n.writer is None for n in nodes)
    assert sum(len(n.pages) for n in nodes if n.pages) == eng.cache.pool.used_pages


class _Poisoned:
    """A forward result whose read fails, as an asynchronously dispatched forward does:
    each of its arrays (logits, greedy summary) raises when it reaches the host."""

    logits = greedy = greedy_logprob = ok = property(lambda self: self)

    def __array__(self, *args, **kwargs):
        raise RuntimeError(f"{BOOM}: device lost")


def _inject(eng: Engine, stage: str, in_forward: set[str]) -> None:
    """Make ``stage`` raise for the victim "v" (forward stages: for the forward carrying
    it, whose rids go to ``in_forward``). Most faults strike after the real method ran,
    leaving the most state behind to clean up."""

    def after(name: str, when=lambda r: True):
        owner = {"take_slice": eng.scheduler}.get(name, eng.planner)
        real = getattr(owner, name)

        def wrapped(r, *args):
            out = real(r, *args)
            if r.rid == "v" and when(r):
                raise ValueError(f"{BOOM} in {name}")
            return out

        setattr(owner, name, wrapped)

    if stage in ("build_path", "choose_compute", "lay_out", "take_slice"):
        after(stage)
    elif stage == "decode_pass":
        after(stage, lambda r: len(r.generated) == 2)  # it holds a fresh generation page
    elif stage == "sent":  # every generated token: sampled, greedy, or read a step late
        real_sent = eng.tokens.sent

        def sent(r, index, *args):
            out = real_sent(r, index, *args)
            if r.rid == "v" and index == 2:  # mid-generation, not finishing
                raise ValueError(f"{BOOM} in sent")
            return out

        eng.tokens.sent = sent
    elif stage == "finish":
        real = eng.tokens.finish

        def finish(r, reason):
            if r.rid == "v":
                raise KeyError(f"{BOOM} in finish")
            return real(r, reason)

        eng.tokens.finish = finish
    else:  # a forward: "prefill", "decode", or "decode-async" (fails when read)
        real_run = eng.executor.run
        kind = stage.split("-")[0]

        def run(group, work, block_q, *rest):
            rids = {r.rid for r, _ in work if r is not None}
            if "v" in rids and (block_q == 1) == (kind == "decode") and not in_forward:
                in_forward.update(rids)
                if stage.endswith("async"):
                    real_run(group, work, block_q, *rest)
                    return _Poisoned()
                raise RuntimeError(f"{BOOM}: {kind} forward")
            return real_run(group, work, block_q, *rest)

        eng.executor.run = run


STAGES = ["build_path", "choose_compute", "lay_out", "take_slice", "decode_pass",
          "sent", "finish", "prefill", "decode", "decode-async"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_fails_only_the_requests_it_touches(tiny, solo, stage):
    eng = _engine(tiny)
    in_forward: set[str] = set()
    _inject(eng, stage, in_forward)
    got = _drive(eng)
    failed = {rid for rid, evs in got.items() if evs and evs[-1].finish_reason == "error"}
    # a forward fails the requests whose rows it carried; anything else, the victim alone
    assert failed == (in_forward or {"v"})
    assert failed < set(REQS)  # others ran beside it
    for rid, evs in got.items():
        if rid in failed:
            last = evs[-1]
            assert last.finished and last.token_id == -1 and BOOM in last.error
            assert last.meta["finish_reason"] == "error"
            assert all(not ev.finished for ev in evs[:-1])  # one final event
        else:
            _assert_solo(evs, solo[rid], rid)
    assert eng.counters["requests_failed"] == len(failed)
    _assert_clean(eng)
    if stage in ("build_path", "choose_compute", "lay_out"):
        # the victim's unplanned nodes are gone from the tree
        held = {t for n in eng.cache.tree.nodes() if n.kind == "tokens" for t in n.key}
        assert not held & set(VICTIM_TOKENS)
    # What the fault left in the cache is exact: every request again (reusing it), now
    # without the fault, then a flush frees every page.
    eng.tokens.finish = eng.finish
    vars(eng.tokens).pop("sent", None)
    for owner in (eng.scheduler, eng.tokens, eng.planner, eng.executor):
        for name in ("build_path", "choose_compute", "lay_out", "take_slice", "decode_pass",
                     "emit", "run"):
            vars(owner).pop(name, None)  # the class's method again
    again = _drive(eng, staged=False)
    for rid, evs in again.items():
        _assert_solo(evs, solo[rid], rid)
    assert eng.counters["cache_hit_tokens"] > 0
    assert eng.flush_cache() and eng.cache.pool.used_pages == 0


def test_reset_fails_everything_and_starts_from_an_empty_cache(tiny, solo):
    eng = _engine(tiny)
    for rid in "abd":
        eng.add_request(_request(rid))
    eng.step()
    eng.step()
    assert eng.cache.pool.used_pages > 0
    events = eng.reset("engine error: boom")
    assert sorted(ev.rid for ev in events) == ["a", "b", "d"]
    assert all(ev.finish_reason == "error" and ev.error == "engine error: boom" for ev in events)
    assert not eng.has_work() and eng.cache.pool.used_pages == 0
    for rid, evs in _drive(eng, staged=False).items():
        _assert_solo(evs, solo[rid], rid)


# --------------------------------------------------------------------------- through the app


@pytest.fixture
def app_engine(tiny):
    eng = _engine(tiny)
    app = create_app(AsyncEngine(eng), "tiny", tiny.tokenizer, vocab_size=tiny.cfg.vocab_size,
                     max_position=tiny.cfg.max_position_embeddings, stop_ids=tiny.stop_ids)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, eng


def _gen_body(rid: str, stream: bool = False) -> dict:
    segs, cache = REQS[rid]
    return {"input_ids": segs, "cache": cache or {}, "return_logprob": True, "stream": stream,
            "sampling_params": {"max_new_tokens": N_NEW, "ignore_eos": True}}


def test_app_fault_is_a_500_for_that_request_and_the_others_complete(app_engine, solo):
    client, eng = app_engine
    real = eng.planner.decode_pass

    def decode_pass(r):
        if list(r.req.segments[-1]) == VICTIM_TOKENS and r.completion_tokens == 2:
            raise ValueError(f"{BOOM}: bad row")
        return real(r)

    eng.planner.decode_pass = decode_pass

    def stream(rid: str) -> list:
        with client.stream("POST", "/generate", json=_gen_body(rid, True)) as r:
            assert r.status_code == 200
            return sse_events(r.iter_lines())

    with ThreadPoolExecutor(6) as pool:
        plain = {rid: pool.submit(client.post, "/generate", json=_gen_body(rid))
                 for rid in ("a", "v", "c", "e")}
        streams = {rid: pool.submit(stream, rid) for rid in ("v", "b")}
        plain = {rid: f.result() for rid, f in plain.items()}
        streams = {rid: f.result() for rid, f in streams.items()}
    bad = plain.pop("v")
    assert bad.status_code == 500 and "Traceback" not in bad.text
    err = bad.json()["error"]
    assert err["type"] == "server_error"
    assert err["message"] == (
        f"generation failed: engine error (decode): ValueError: {BOOM}: bad row")
    for rid, r in plain.items():
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == solo[rid][0]
        np.testing.assert_allclose(r.json()["output_token_logprobs"], solo[rid][1], atol=1e-4)
    # the victim's stream: its first two tokens, then an error event, then [DONE]
    events = streams["v"]
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == err["message"]
    assert [t for e in events[:-2] for t in e["output_ids"]] == solo["v"][0][:2]
    events = streams["b"]
    assert [t for e in events[:-1] for t in e["output_ids"]] == solo["b"][0]
    assert client.post("/flush_cache").json() == {"flushed": True}
    assert eng.cache.pool.used_pages == 0
    assert scrape(client)["akv_engine_requests_failed"] == 2.0


def test_app_step_fault_fails_the_running_requests_and_the_server_keeps_serving(app_engine,
                                                                                 solo):
    """A fault outside any request's work (here: in step itself) fails the requests then
    running, empties the cache, and the next requests are served exactly."""
    client, eng = app_engine
    real, calls = eng.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError(f"{BOOM}: scheduler bug")
        return real()

    eng.step = step
    r = client.post("/generate", json=_gen_body("a"))
    assert r.status_code == 500
    assert r.json()["error"]["message"] == (
        f"generation failed: engine error: RuntimeError: {BOOM}: scheduler bug"
    )
    assert eng.cache.pool.used_pages == 0 and not eng.has_work()
    for rid in "ab":
        r = client.post("/generate", json=_gen_body(rid))
        assert r.status_code == 200 and r.json()["output_ids"] == solo[rid][0]
    assert client.get("/health").json() == {"status": "ok"}


def test_app_fatal_engine_error_fails_everyone_and_reports_unhealthy(app_engine):
    """A fault the engine cannot survive (here a MultihostError, as a lost follower raises):
    the waiting request gets the message, /health turns 503, later requests fail at once
    with the same message instead of hanging, and on_fatal is told (main.py then exits)."""
    from akv_jax.serving.multihost import MultihostError

    client, eng = app_engine
    told: list[str] = []
    client.app.state.server.async_engine.on_fatal = told.append
    reason = "lost the follower processes: a process died or disconnected (test)"

    def step():
        raise MultihostError(reason)

    eng.step = step
    for _ in range(2):  # the request in flight, then one sent after the stop
        r = client.post("/generate", json=_gen_body("a"))
        assert r.status_code == 500
        assert r.json()["error"]["message"] == f"generation failed: {reason}"
    with client.stream("POST", "/generate", json=_gen_body("b", True)) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-2]["error"]["message"] == f"generation failed: {reason}"
    assert told == [reason]
    r = client.get("/health")
    assert r.status_code == 503
    assert r.json()["error"] == {"message": reason, "type": "server_error", "param": None,
                                 "code": None}
    r = client.post("/flush_cache")
    assert r.status_code == 503 and r.json()["error"]["message"] == reason


# --------------------------------------------------------------------------- disconnects


def _wait_for(c, key: str, value: float, timeout: float = 30.0) -> float:
    """Seconds until metric ``key`` reads ``value`` (fails after ``timeout``)."""
    t0 = time.monotonic()
    while scrape(c).get(key) != value:
        assert time.monotonic() - t0 < timeout, f"{key} never reached {value}"
        time.sleep(0.05)
    return time.monotonic() - t0


RUNNING, USED = "akv_num_running_requests", "akv_kv_pool_used_pages"
FINISHED = "akv_engine_requests_finished_total"
# long enough that a request which is not aborted outlives the test's waits by far
LONG = 3000


def _cancelled(endpoint: str) -> str:
    return f'akv_requests_finished_total{{endpoint="{endpoint}",finish_reason="cancelled"}}'


@pytest.mark.parametrize("route", ["/generate", "/v1/chat/completions"])
def test_a_stream_cut_off_mid_way_aborts_its_request_and_frees_its_pages(route):
    srv = shared_server()
    endpoint = "generate" if route == "/generate" else "chat"
    if route == "/generate":
        body = {"input_ids": [list(range(1, 50)), [7, 8, 9]], "stream": True,
                "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    else:
        body = {"messages": [{"role": "user", "content": "count to a million"}], "stream": True,
                "max_tokens": LONG, "ignore_eos": True}
    with srv.client() as c:
        assert c.post("/flush_cache").json() == {"flushed": True}
        before = scrape(c)
        assert before[USED] == 0
        with c.stream("POST", route, json=body) as r:
            assert r.status_code == 200
            lines = []
            # Hold the iterator: a `for` over a fresh r.iter_lines() that breaks lets the
            # generator close, and httpx closes the connection at once (before "during").
            stream = r.iter_lines()
            for line in stream:
                if line.startswith("data: "):
                    lines.append(line)
                if len(lines) == 3:  # a few tokens in: the request runs and holds pages
                    break
            during = scrape(c)
            assert during[RUNNING] == 1 and during[USED] > 0, (lines, srv.stderr_lines[-20:])
        # leaving the block closed the connection mid-stream
        _wait_for(c, RUNNING, 0, timeout=20)
        after = scrape(c)
        assert after[FINISHED] == before[FINISHED]  # aborted, not run to its end
        assert after[_cancelled(endpoint)] == before.get(_cancelled(endpoint), 0) + 1
        # nothing holds a page: the flush empties the pool (it would refuse while running)
        assert c.post("/flush_cache").json() == {"flushed": True}
        assert scrape(c)[USED] == 0
        r = c.post("/generate", json={"input_ids": [1, 2, 3],
                                      "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


def test_a_plain_request_whose_client_disconnects_is_aborted():
    srv = shared_server()
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"input_ids": list(range(1, 30)),
                       "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}).encode()
    with srv.client() as c:
        assert c.post("/flush_cache").json() == {"flushed": True}
        before = scrape(c)
        gone = 'akv_http_requests_total{method="POST",path="/generate",status="499"}'
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: test\r\nContent-Type: application/json"
                      b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            _wait_for(c, RUNNING, 1)
            time.sleep(0.3)  # decoding now
            assert scrape(c)[USED] > 0
        _wait_for(c, RUNNING, 0, timeout=20)
        after = scrape(c)
        assert after[FINISHED] == before[FINISHED]
        assert after[gone] == before.get(gone, 0) + 1
        assert c.post("/flush_cache").json() == {"flushed": True}
        assert scrape(c)[USED] == 0


# --------------------------------------------------------------------------- multi-host
# Two processes on localhost, one CPU device each, joined by jax.distributed into one tp=2
# mesh (as in test_multihost.py). Process 0 serves HTTP; process 1 follows in lock step.

MH_ARGS = ("--model-path", "tiny", "--max-total-tokens", "4096", "--page-size", "8",
           "--tp", "2")
PROG_ERROR = "python -m akv_jax.serving.main: error: "
AFTER_FORWARD, BEFORE_FORWARD = 497, 498  # first prompt tokens that trip the leader's faults
# The leader's launcher: faults on process 0 only, for requests starting with a magic token.
# After the forward (Scheduler.prefill_done) the followers can drop the request too; before it
# (Planner.decode_pass) the processes would run different forwards.
LEADER_FAULTS = f"""
import sys, jax
from akv_jax.serving.planner import Planner
from akv_jax.serving.scheduling import Scheduler

def fault(cls, name, magic):
    real = getattr(cls, name)

    def patched(self, r, *args):
        if r.req.segments[0][0] == magic and jax.process_index() == 0:
            raise RuntimeError("{BOOM} on the leader")
        return real(self, r, *args)

    setattr(cls, name, patched)

fault(Scheduler, "prefill_done", {AFTER_FORWARD})
fault(Planner, "decode_pass", {BEFORE_FORWARD})
from akv_jax.serving.main import main
sys.exit(main(sys.argv[1:]))
"""


class _Pair:
    """A leader (LocalServer) and a follower process, joined by jax.distributed."""

    def __init__(self, leader_launcher: tuple[str, ...] = MODULE):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            coord = f"127.0.0.1:{s.getsockname()[1]}"
        dist = ("--num-processes", "2", "--dist-coordinator", coord)
        self.follower = subprocess.Popen(
            [sys.executable, "-m", "akv_jax.serving.main", *MH_ARGS, *dist,
             "--process-id", "1", "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self.follower_err: list[str] = []
        # drained continuously: a chatty follower must never block on a full pipe
        self._drain = ThreadPoolExecutor(1)
        self._drain.submit(lambda: self.follower_err.extend(self.follower.stderr))
        try:
            self.leader = LocalServer([*MH_ARGS, *dist, "--process-id", "0"],
                                      launcher=leader_launcher)
        except BaseException:
            self.follower.kill()
            raise

    def wait_exit(self, proc: subprocess.Popen, timeout: float) -> tuple[int, float]:
        t0 = time.monotonic()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process {proc.pid} still running after {timeout} s") from None
        return rc, time.monotonic() - t0

    def close(self) -> None:
        self.leader.stop()
        if self.follower.poll() is None:
            try:
                self.follower.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.follower.kill()
        self._drain.shutdown(wait=True)


def _last_error(lines: list[str]) -> str:
    """The one-line error a process printed last."""
    errs = [line.strip() for line in lines if line.startswith(PROG_ERROR)]
    assert errs, "".join(lines[-20:])
    return errs[-1]


def _mh_solo(reqs: list[list[list[int]]], n: int) -> list[tuple[list[int], list[float]]]:
    """The same requests, one at a time, on a single-process engine."""
    eng = Engine(load_model("tiny"), max_total_tokens=4096, page_size=8)
    out = []
    for i, segs in enumerate(reqs):
        eng.add_request(GenerateRequest(str(i), segs, parse_history(None, len(segs)),
                                        SamplingParams(max_new_tokens=n), True))
        evs = []
        while eng.has_work():
            evs += eng.step()
        out.append(([e.token_id for e in evs], [e.logprob for e in evs]))
    return out


def test_multihost_leader_faults_reach_the_follower():
    """A fault on the leader alone, after the step's forward, fails that request on both
    processes (the follower drops it when the leader says so) and serving goes on exactly.
    One before the forward would make the processes run different steps: the digest
    check catches it and both stop with a one-line error, none hangs."""
    pair = _Pair(("-c", LEADER_FAULTS))
    try:
        reqs = [[list(range(1, 30)), [30, 31, 32]], [list(range(1, 30)), [40, 41]],
                [[60, 61, 62, 63]]]
        want = _mh_solo(reqs, 5)
        victim = [AFTER_FORWARD, *range(1, 30)]
        with pair.leader.client() as c:

            def gen(segs):
                return c.post("/generate", json={
                    "input_ids": segs, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 5, "temperature": 0}})

            r = gen(reqs[0])
            assert r.status_code == 200 and r.json()["output_ids"] == want[0][0]
            with ThreadPoolExecutor(3) as pool:  # the victim beside two others
                futs = [pool.submit(gen, s) for s in (victim, reqs[1], reqs[2])]
                bad, *good = [f.result() for f in futs]
            assert bad.status_code == 500
            msg = bad.json()["error"]["message"]
            assert msg == f"generation failed: engine error (sampling): RuntimeError: {BOOM} " \
                          "on the leader"
            for r, (toks, lps) in zip(good, want[1:], strict=True):
                assert r.status_code == 200 and r.json()["output_ids"] == toks
                np.testing.assert_allclose(r.json()["output_token_logprobs"], lps, atol=1e-4)
            # both engines still agree (every step checks): a flush on both, then exact again
            assert c.post("/flush_cache").json() == {"flushed": True}
            r = gen(reqs[0])
            assert r.status_code == 200 and r.json()["output_ids"] == want[0][0]
            assert c.get("/health").json() == {"status": "ok"}
            assert pair.follower.poll() is None
            # the follower logged the leader's failure and dropped the request too
            rid = None
            for line in pair.follower_err:
                m = re.search(r"request (\w+) failed on the leader \((.*)\): dropped here too",
                              line)
                if m:
                    rid = m.group(1)
                    assert m.group(2) == f"engine error (sampling): RuntimeError: {BOOM} on " \
                                         "the leader"
            assert rid is not None, "".join(pair.follower_err[-20:])

            # Before the forward: the processes would diverge; both stop, with one line each.
            r = c.post("/generate", json={"input_ids": [BEFORE_FORWARD, 5, 6, 7],
                                          "sampling_params": {"max_new_tokens": 5}})
            assert r.status_code == 500
            msg = r.json()["error"]["message"]
            assert re.fullmatch(r"generation failed: engines diverged at step \d+: processes "
                                r"\[1\] differ from process 0 \(a fault hit some processes and "
                                r"not others\); stopping, restart the server", msg), msg
        rc, _ = pair.wait_exit(pair.leader.proc, 60)
        assert rc == 1
        assert _last_error(pair.leader.stderr_lines) == PROG_ERROR + msg.removeprefix(
            "generation failed: ")
        rc, _ = pair.wait_exit(pair.follower, 60)
        assert rc == 1
        err = _last_error(pair.follower_err)
        assert err.startswith(PROG_ERROR + "process 1: engines diverged at step "), err
        # (the leader's log holds the request fault's traceback, for its operator)
        assert "Traceback" not in "".join(pair.follower_err)
    finally:
        pair.close()


@pytest.mark.parametrize("killed", ["follower", "leader"])
def test_multihost_a_killed_process_stops_the_other_with_a_clear_error(killed):
    """SIGKILL one process mid-stream: the other notices at its next collective (the leader
    syncs at least once a second even when idle) and exits with a one-line error instead of
    hanging; the leader first ends the open stream with an SSE error event."""
    pair = _Pair()
    try:
        with pair.leader.client() as c:
            body = {"input_ids": list(range(1, 20)), "stream": True,
                    "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
            with c.stream("POST", "/generate", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                seen = 0
                for line in lines:
                    seen += line.startswith("data: ")
                    if seen == 2:
                        break
                victim = pair.follower if killed == "follower" else pair.leader.proc
                survivor = pair.leader.proc if killed == "follower" else pair.follower
                victim.send_signal(signal.SIGKILL)
                if killed == "follower":
                    events = sse_events(lines)
                    assert events[-1] == "[DONE]"
                    err = events[-2]["error"]
                    assert err["type"] == "server_error"
                    assert re.match(r"generation failed: lost the follower "
                                    r"processes: a process died or disconnected \(",
                                    err["message"]), err
        rc, took = pair.wait_exit(survivor, 60)
        assert rc == 1
        out = pair.leader.stderr_lines if killed == "follower" else pair.follower_err
        err = _last_error(out)
        if killed == "follower":
            assert re.match(PROG_ERROR + r"lost the follower processes: a process died "
                            r"or disconnected \(.*Connection (closed|reset) by peer", err), err
        else:
            assert err.startswith(PROG_ERROR + "process 1: lost the leader (process 0): a "
                                  "process died or disconnected ("), err
        assert "Traceback" not in "".join(out)
        assert took < 30
    finally:
        pair.close()


# The follower's launcher: process 1 stops in its first forward and never returns.
FOLLOWER_STALLS = """
import sys, time
from akv_jax.serving.executor import Executor

Executor.run_prefill = lambda self, *a, **k: time.sleep(3600)
from akv_jax.serving.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_multihost_a_stuck_process_stops_the_other_after_the_collective_timeout():
    """A process that never reaches a collective (stuck, or out of step) does not leave its
    peers waiting forever: on CPUs the leader's collective gives up after
    --collective-timeout and it exits with a one-line error naming the flag."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coord = f"127.0.0.1:{s.getsockname()[1]}"
    dist = ("--num-processes", "2", "--dist-coordinator", coord, "--collective-timeout", "5")
    follower = subprocess.Popen(
        [sys.executable, "-c", FOLLOWER_STALLS, *MH_ARGS, *dist, "--process-id", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        t0 = time.monotonic()
        leader = subprocess.run(
            [sys.executable, "-m", "akv_jax.serving.main", "--port", "0", *MH_ARGS, *dist,
             "--process-id", "0", "--log-level", "warning"],
            capture_output=True, text=True, timeout=240,
        )
        took = time.monotonic() - t0
    finally:
        follower.kill()
        follower.wait()
    assert leader.returncode == 1, leader.stderr[-2000:]
    err = _last_error(leader.stderr.splitlines())
    assert re.match(PROG_ERROR + r".*the follower processes did not join a collective within "
                    r"--collective-timeout: a process is stuck or out of step \(.*Timed out "
                    r"waiting 5000ms", err), err
    assert "Traceback" not in leader.stderr
    assert took < 200
