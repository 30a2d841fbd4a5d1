"""The source of notebooks/training_under_ops.ipynb: edit here, not the .ipynb, then run
`python notebooks/tools/build.py training_under_ops` (it executes the notebook as written, the
SmolLM2 run: ~30 min on 2 CPU cores, and writes it with its outputs)."""

from nbformat.v4 import new_code_cell as code
from nbformat.v4 import new_markdown_cell as md


def cells() -> list:
    """The notebook's cells, in order."""
    return [
        md("""# Training under cache engineering

A model that was never trained with dropped and repositioned context sees an unfamiliar view
when AKV's rolling drop removes old tool outputs and a reposition re-encodes the remaining
keys' positions. `akv_jax.train` fine-tunes through the op history itself: one forward pass
per packed example, every token predicted from exactly the view it had.

This notebook fine-tunes the embedded SmolLM2-135M-Instruct (every weight, float32) for a
few hundred steps on synthetic agent conversations
(`akv_jax.train.synthetic`: config-file lookups through a `read_file` tool), with AKV's
rolling drop (only the latest tool output kept) and a reposition whenever the position
counter passes a threshold. It plots the held-out loss under the cache-engineered view
(with the ops) against the full-context loss (the same conversations without the ops),
before and after. The test suite runs it with the tiny random model and a few steps
(`tests/test_train_cli.py`); the SmolLM2 run is marked slow."""),
        code("""import json
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

from akv_jax.train import cli
from akv_jax.train.sources import chat_records, write_jsonl
from akv_jax.train.synthetic import agent_chats
from converters.loading import load_model

# "default" is the embedded SmolLM2-135M-Instruct; the tests run "tiny" with a few steps.
MODEL = "default"
STEPS = 300
TRAIN, EVAL, TURNS, LINES = 64, 8, 3, 4
RUN_ARGS = ["--lr", "1e-4", "--batch", "1", "--max-tokens", "256", "--max-segments", "16",
            "--max-trajectories", "1", "--max-versions", "8", "--eval-every", "25"]
FIGURE = "docs/training_under_ops.png"  # where the README's copy is written
LOG_COPY = "bench/results/training_under_ops_smollm2_log.jsonl"  # the SmolLM2 run's log"""),
        md("""## Data: synthetic agent conversations under AKV's rolling drop
Each conversation: a system prompt, the user's request (one setting across a project's config
files), then per turn an assistant message (the value from the file just read, and the next
`read_file` call) and the tool's output. `chat_records` adds the ops AKV's rolling drop sends:
every tool output but the latest is dropped before the next assistant turn, and a reposition
closes the gaps once the position counter reaches the threshold."""),
        code("""tok = load_model(MODEL, placement="host").tokenizer
work = Path(tempfile.mkdtemp(prefix="akv_train_"))
chats = agent_chats(seed=0, count=TRAIN + EVAL, turns=TURNS, lines=LINES)
# reposition once the position counter passes half a conversation's length
lengths = [sum(map(len, tok.encode_messages(c["messages"]))) for c in chats[:16]]
threshold = sum(lengths) // len(lengths) // 2
print(f"{sum(lengths) / len(lengths):.0f} tokens per conversation, repos threshold {threshold}")
records = list(chat_records(chats, tok, keep_tools=1, repos_threshold=threshold))
write_jsonl(work / "train.jsonl", records[:TRAIN])
write_jsonl(work / "eval.jsonl", records[TRAIN:])
example = records[0]
for i, m in enumerate(example["messages"]):
    print(f"{i:2} {m['role']:9} {m['content'][:60]!r}")
print("cache:", json.dumps(example["cache"]))
assert example["cache"]["drop"] and example["cache"]["reposition"]"""),
        md("""## Fine-tune through the op history
The command line does the whole run (`python -m akv_jax.train`); here it runs in this
process. It evaluates the held-out conversations under both views before the first step and
every `--eval-every` steps."""),
        code("""out = work / "run"
rc = cli.main(["--model-path", MODEL, "--data", str(work / "train.jsonl"),
               "--eval-data", str(work / "eval.jsonl"), "--out", str(out),
               "--steps", str(STEPS), "--no-progress", *RUN_ARGS])
assert rc == 0
log = cli.read_log(out / cli.LOG_NAME)
evals = [e for e in log if "eval_loss_ops" in e]
train = [e for e in log if "loss" in e]
before, after = evals[0], evals[-1]
rates = sorted(e["tokens_per_s"] for e in train)
print(f"{train[-1]['step']} steps, median {rates[len(rates) // 2]:.0f} training tokens/s")
print(f"before: eval loss with ops {before['eval_loss_ops']:.4f}, full context "
      f"{before['eval_loss_full']:.4f}")
print(f"after:  eval loss with ops {after['eval_loss_ops']:.4f}, full context "
      f"{after['eval_loss_full']:.4f}")
assert after["eval_loss_ops"] < before["eval_loss_ops"]"""),
        md("""## Held-out loss: cache-engineered view against full context"""),
        code("""fig, ax = plt.subplots(figsize=(6, 3.5))
steps = [e["step"] for e in evals]
ax.plot(steps, [e["eval_loss_ops"] for e in evals], "o-", label="with ops (drop + repos)")
ax.plot(steps, [e["eval_loss_full"] for e in evals], "s--", label="full context (no ops)")
ax.plot([e["step"] for e in train], [e["loss"] for e in train], ":", color="gray",
        label="training loss (with ops)")
ax.set_xlabel("training step (trained under the ops)")
ax.set_ylabel("loss (nats / target token)")
ax.set_title(f"{MODEL}: before and after training under cache engineering", fontsize=9)
ax.legend()
fig.tight_layout()
if MODEL == "default":
    Path(FIGURE).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=120)
    Path(LOG_COPY).write_text((out / cli.LOG_NAME).read_text())
    print("saved", FIGURE, "and", LOG_COPY)"""),
    ]
