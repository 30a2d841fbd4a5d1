"""``python -m akv_jax.serving.main``: startup errors are one line and a non-zero exit; the
API key flag; and the default model with every default flag but the port."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from server_support import TINY_ARGS

from akv_jax.agent.launch import LocalServer

PROG = "python -m akv_jax.serving.main"


def run_main(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "akv_jax.serving.main", "--log-level", "warning", *args],
        capture_output=True, text=True, timeout=timeout,
    )


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{PROG}: error: ")
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    return lines[0]


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["--dtype", "float16"], 2, "invalid choice: 'float16'"),
        (["--attention-backend", "triton"], 2, "invalid choice: 'triton'"),
        (["--port", "70000"], 2, "port must be in [0, 65535], got 70000"),
        (["--port", "x"], 2, "port must be an integer"),
        (["--page-size", "0"], 2, "--page-size must be at least 1"),
        (["--max-total-tokens", "-5"], 2, "--max-total-tokens must be at least 1"),
        (["--no-such-flag"], 2, "unrecognized arguments: --no-such-flag"),
        (["--tp", "2"], 2, "--tp 2: only 1 devices available"),
        (["--tp", "2", "--deterministic"], 2, "--deterministic runs one device per group"),
        (["--disaggregate", "1,1"], 2, "needs 2 devices, 1 available"),
        (["--disaggregate", "4"], 2, "expected P,D (two integers)"),
        (["--max-total-tokens", "8", "--page-size", "16"], 2, "smaller than one page"),
        (["--context-length", "0"], 2, "--context-length must be at least 1"),
    ],
)
def test_bad_flags(args, code, words):
    proc = run_main(*args)
    assert proc.returncode == code
    assert words in one_error_line(proc)


def test_bad_model_paths(tmp_path: Path):
    missing = run_main("--model-path", str(tmp_path / "nope"), "--port", "0")
    assert missing.returncode == 1
    assert "cannot load" in one_error_line(missing) and "is not a model" in missing.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    proc = run_main("--model-path", str(bad), "--port", "0")
    assert proc.returncode == 1
    assert f"cannot load {bad}" in one_error_line(proc)
    fake_gguf = tmp_path / "m.gguf"
    fake_gguf.write_text("not a gguf file")
    proc = run_main("--model-path", str(fake_gguf), "--port", "0")
    assert proc.returncode == 1
    assert f"cannot load {fake_gguf}" in one_error_line(proc)


def test_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = run_main("--model-path", "tiny", "--port", str(port))
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in one_error_line(proc)


def test_api_key_server():
    srv = LocalServer([*TINY_ARGS, "--api-key", "sk-test", "--skip-warmup"])
    try:
        assert srv.ready_line == f"akv_jax serving tiny on {srv.url}"
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
        for path in ("/v1/models", "/metrics"):
            r = httpx.get(srv.url + path)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(srv.url + "/generate", json={"input_ids": [1]},
                       headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-test", max_retries=0) as good:
            assert [m.id for m in good.models.list()] == ["tiny"]
        r = httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer sk-test"})
        assert r.status_code == 200 and "akv_kv_pool_total_pages" in r.text
    finally:
        srv.stop()
    assert srv.proc.returncode == 0  # Ctrl-C is a clean shutdown
    assert "Traceback" not in "".join(srv.stderr_lines)


def test_warmup_shapes_and_chunked_prefill_server():
    """--warmup-shapes runs every step shape before the ready line (4,096 positions, chunk
    128, 8 rows: prefill T 64 and 128 with one segment and with several, decode 1, 4 and 8
    rows); a 300-token prompt then
    prefills in three slices and answers as the same prompt does on a server without
    chunking."""
    body = {"input_ids": [list(range(1, 151)), list(range(151, 301))],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    outs = []
    for extra in (["--warmup-shapes", "--prefill-chunk", "128", "--max-running-requests", "8",
                   "--log-level", "info"], []):
        srv = LocalServer([*TINY_ARGS, *extra])
        try:
            r = httpx.post(srv.url + "/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            outs.append(r.json()["output_ids"])
        finally:
            srv.stop()
        if extra:
            assert any("ran 7 step shapes" in line for line in srv.stderr_lines), srv.stderr_lines
    assert len(outs[0]) == 4 and outs[0] == outs[1]


def test_default_model_with_no_flags_but_port_0(default_model_cache):
    """No flags means the embedded SmolLM2-135M-Instruct on 127.0.0.1:30000. The defaults are
    read from the parser (the one place that holds them); the server then runs with every
    default but the port, which is 0 so the test never depends on 30000 being free (the conftest
    fixture converts the model into the session's AKV_JAX_CACHE, which the server inherits)."""
    from akv_jax.serving.main import build_parser, served_name

    args = build_parser().parse_args([])
    assert (args.model_path, args.host, args.port) == (None, "127.0.0.1", 30000)
    assert served_name(args.model_path) == "SmolLM2-135M-Instruct"
    proc = subprocess.Popen([sys.executable, "-m", "akv_jax.serving.main", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline().strip()
        m = re.fullmatch(r"akv_jax serving SmolLM2-135M-Instruct on (http://127\.0\.0\.1:(\d+))",
                         line)
        assert m and int(m[2]) != 0, line
        with openai.OpenAI(base_url=m[1] + "/v1", api_key="x",
                           max_retries=0, timeout=300) as client:
            resp = client.chat.completions.create(
                model="SmolLM2-135M-Instruct", temperature=0, max_tokens=20,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
            )
        assert "Paris" in resp.choices[0].message.content
        assert resp.choices[0].finish_reason in ("stop", "length")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_context_length_override():
    from akv_jax.serving.main import StartupError, with_context_length
    from converters.loading import load_model

    tiny = load_model("tiny")
    assert with_context_length(tiny, 32768, True).cfg.max_position_embeddings == 32768
    assert with_context_length(tiny, 1024, False).cfg.max_position_embeddings == 1024
    with pytest.raises(StartupError, match="above the model's max_position_embeddings"):
        with_context_length(tiny, 8192, False)  # as if it were a trained model
