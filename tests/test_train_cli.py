"""``python -m akv_jax.train``: a run stopped part-way and resumed logs exactly the losses of an
uninterrupted run; its export loads with the server's loader and computes the trained params'
logits; bad input is one line and exit status 2; the training notebook runs (reduced)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient

from akv_jax.cache.core import restore
from akv_jax.cache.ops import parse_history
from akv_jax.train import cli
from akv_jax.train.sources import chat_records, write_jsonl
from akv_jax.train.synthetic import agent_chats
from converters.loading import TINY_TOKENIZERS, load_model

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "training_under_ops.ipynb"
# tiny model, 2 trajectories of ~420 byte tokens per step, 4 steps; the pack shape (and so
# the compiled step, shared through one compile cache) is the same in every run of the module
SHAPE = ["--max-tokens", "448", "--max-segments", "16", "--max-trajectories", "2",
         "--max-versions", "4", "--batch", "2"]  # fmt: skip
RUN = ["--model-path", "tiny", "--steps", "4", "--lr", "3e-2", "--save-every", "2",
       "--lora-rank", "4", "--no-progress", *SHAPE]  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Synthetic agent chats under rolling drop + repos (text records, the tiny tokenizer),
    and one compile cache for every run of the module."""
    d = tmp_path_factory.mktemp("train_cli")
    tok = TINY_TOKENIZERS["tiny"](512)
    recs = list(
        chat_records(agent_chats(0, 10, turns=2, lines=2), tok, keep_tools=1, repos_threshold=300)
    )
    assert all(r["cache"]["drop"] and r["cache"]["reposition"] for r in recs)
    write_jsonl(d / "train.jsonl", recs[:8])
    write_jsonl(d / "eval.jsonl", recs[8:])
    return {"dir": d, "train": d / "train.jsonl", "eval": d / "eval.jsonl", "xla": d / "xla"}


def train(files, out: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [
        sys.executable,
        "-m",
        "akv_jax.train",
        *RUN,
        "--data",
        str(files["train"]),
        "--eval-data",
        str(files["eval"]),
        "--out",
        str(out),
        "--compile-cache-dir",
        str(files["xla"]),
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


def losses(log: list[dict]) -> list[dict]:
    """A log without its timings."""
    return [{k: v for k, v in e.items() if k != "tokens_per_s"} for e in log]


def test_stopped_and_resumed_run_logs_the_same_losses_and_exports_for_serving(files):
    full = train(files, files["dir"] / "full")
    assert full.returncode == 0, full.stderr
    log = cli.read_log(files["dir"] / "full" / cli.LOG_NAME)
    # eval before training, 4 steps, eval at the end; training lowers both losses
    assert [e["step"] for e in log] == [0, 1, 2, 3, 4, 4]
    assert set(log[0]) == {"step", "eval_loss_ops", "eval_loss_full"}
    assert log[-1]["eval_loss_ops"] < log[0]["eval_loss_ops"] - 0.1
    assert log[-1]["eval_loss_full"] < log[0]["eval_loss_full"] - 0.1
    assert log[0]["eval_loss_ops"] != log[0]["eval_loss_full"]  # the views differ
    assert all(e["tokens"] > 700 and e["tokens_per_s"] > 0 for e in log[1:5])

    part = files["dir"] / "part"
    stopped = train(files, part, "--stop-after", "3")  # checkpoint at 2, stops after 3
    assert stopped.returncode == 0, stopped.stderr
    assert [e["step"] for e in cli.read_log(part / cli.LOG_NAME)] == [0, 1, 2, 3]
    assert not (part / cli.MODEL_DIR).exists()
    resumed = train(files, part, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert losses(cli.read_log(part / cli.LOG_NAME)) == losses(log)  # exactly

    # the export (LoRA merged) loads with the server's loader and computes the logits of the
    # trained params (adapters unmerged)
    exported = load_model(files["dir"] / "full" / cli.MODEL_DIR)
    assert exported.tokenizer is not None and exported.cfg == load_model("tiny").cfg
    trained = _checkpoint_params(files["dir"] / "full" / cli.CKPT_DIR)
    segs = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    hist = parse_history({"drop": {"1": [0]}, "reposition": [1]}, 3)
    got, _ = restore(exported.params, exported.cfg, segs, hist, max_tokens=64)
    want, _ = restore(trained, exported.cfg, segs, hist, max_tokens=64)
    base, _ = restore(load_model("tiny").params, exported.cfg, segs, hist, max_tokens=64)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
    assert np.abs(np.asarray(got) - np.asarray(base)).max() > 1e-2  # it was trained


def _checkpoint_params(path: Path):
    """The params of the run's latest checkpoint as training ran them: the tiny base with the
    LoRA adapters applied unmerged."""
    from akv_jax.train.trainer import Trainer

    args = cli.build_parser().parse_args([*RUN, "--data", "-", "--out", "-"])
    trainer = Trainer(load_model("tiny"), args)
    assert trainer.restore(path) == 4
    return trainer.params()


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--steps", "0"], "argument --steps: --steps must be at least 1, got 0 (see --help)"),
        (["--lr", "nan"], "argument --lr: --lr must be above 0, got nan (see --help)"),
        (["--max-tokens", "100"], "--max-tokens must be a multiple of 16, got 100"),
        (["--resume"], "--resume: no checkpoint in {out}/checkpoints"),
        (
            ["--loss-roles", "assistant,bot"],
            "--loss-roles: loss roles must be among ('system', 'developer', 'user', 'assistant', "
            "'tool', 'function'), got ['assistant', 'bot']",
        ),
        (
            ["--max-tokens", "64"],
            "{data}:1: messages: too large for one example (max_tokens: 400 > 64)",
        ),
        (
            ["--model-path", "nope"],
            "'nope' is not a model: expected 'default', 'tiny', 'tiny-gpt-oss', "
            "'tiny-gpt-oss-bpe', 'tiny-minimax-m2', 'tiny-qwen3-moe', 'tiny-qwen3-moe-bpe', "
            "a .gguf file, a Hugging Face folder (config.json + *.safetensors) "
            "or a converted folder",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(files, tmp_path, capsys, argv, error):
    out = tmp_path / "out"
    base = [
        "--model-path",
        "tiny",
        "--data",
        str(files["train"]),
        "--out",
        str(out),
        "--max-tokens",
        "448",
    ]
    try:
        code = cli.main([*base, *argv])
    except SystemExit as e:  # argparse's flag errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err == f"python -m akv_jax.train: error: {error.format(out=out, data=files['train'])}\n"


def test_bad_record_is_reported_without_traceback(files, tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = files["train"].read_text().splitlines()[0]
    bad.write_text(
        f"{good}\n{good}\n"
        + json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": ["x"]},
                ]
            }
        )
        + "\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "akv_jax.train",
            "--model-path",
            "tiny",
            "--data",
            str(bad),
            "--out",
            str(tmp_path / "o"),
            "--max-tokens",
            "448",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"python -m akv_jax.train: error: {bad}:3: messages[1].content[0]: only "
        "{'type': 'text'} content parts are supported"
    ]
    # an existing run is not overwritten without --resume
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / cli.LOG_NAME).write_text("")
    assert (
        cli.main(
            ["--model-path", "tiny", "--data", str(files["train"]), "--out", str(tmp_path / "o")]
        )
        == 2
    )


def test_training_notebook_runs_reduced(files):
    """The notebook on the tiny model with a few steps (the SmolLM2 run is slow-marked)."""
    run_args = [
        "--eval-every",
        "2",
        "--lr",
        "3e-2",
        "--lora-rank",
        "4",
        "--compile-cache-dir",
        str(files["xla"]),
    ]  # the compiled step of the test above
    nb = _notebook(
        {"MODEL": '"tiny"', "STEPS": "4", "TRAIN, EVAL, TURNS, LINES": "8, 2, 2, 2"},
        run_args + SHAPE,
    )
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    out = _outputs(nb)
    assert "before: eval loss with ops" in out and "after:  eval loss with ops" in out


@pytest.mark.slow
def test_training_notebook_smollm2(default_model_cache):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=7200, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    assert "after:  eval loss with ops" in _outputs(nb)


def _notebook(assign: dict[str, str], run_args: list[str]):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    lines = first.source.split("\n")
    for name, value in assign.items():
        (i,) = [k for k, ln in enumerate(lines) if ln.startswith(f"{name} = ")]
        lines[i] = f"{name} = {value}"
    (i,) = [k for k, ln in enumerate(lines) if ln.startswith("RUN_ARGS = ")]
    end = next(k for k in range(i, len(lines)) if lines[k].rstrip().endswith("]"))
    lines[i : end + 1] = [f"RUN_ARGS = {run_args!r}"]
    first.source = "\n".join(lines)
    return nb


def _outputs(nb) -> str:
    return "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )


@pytest.mark.slow
def test_killed_run_resumes_with_the_same_losses(files):
    """SIGKILL part-way (wherever it lands: between steps, inside a checkpoint write), then
    --resume: the log equals the uninterrupted run's."""
    import signal
    import time

    ref = files["dir"] / "kill_ref"
    assert train(files, ref, "--steps", "6").returncode == 0
    out = files["dir"] / "killed"
    args = [sys.executable, "-m", "akv_jax.train", *RUN, "--steps", "6", "--data",
            str(files["train"]), "--eval-data", str(files["eval"]), "--out", str(out),
            "--compile-cache-dir", str(files["xla"])]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    log = out / cli.LOG_NAME
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if log.exists() and sum(1 for e in cli.read_log(log) if "loss" in e) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / cli.MODEL_DIR).exists()
    resumed = train(files, out, "--steps", "6", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert losses(cli.read_log(log)) == losses(cli.read_log(ref / cli.LOG_NAME))
