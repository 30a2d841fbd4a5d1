"""Seeded synthetic agent conversations in text, for training under cache engineering.

A small tool-using agent: the user asks for one setting across a project's config files; each
assistant turn reports the setting's value from the file just read and calls ``read_file`` on
the next one; each tool message is a file of ``name = value`` lines. What an assistant turn
says is determined by the user's request (never dropped) and by the latest tool output (always
inside a rolling window), so under AKV's rolling drop the targets stay predictable while
older tool outputs vanish from the view and the positions are re-encoded: exactly the
situation in which a model trained only on full contexts sees an unfamiliar view.

The chats are plain (no ``cache`` field); :func:`akv_jax.train.sources.chat_records` adds the
rolling-drop ops.
"""

from __future__ import annotations

import random
from typing import Any

_KEYS = (
    "timeout",
    "retries",
    "port",
    "workers",
    "log_level",
    "cache_size",
    "region",
    "mode",
    "batch",
    "threads",
    "backend",
    "user",
    "max_conn",
    "interval",
    "codec",
    "quota",
)
_WORDS = (
    "alpha",
    "delta",
    "amber",
    "cobalt",
    "ember",
    "fjord",
    "garnet",
    "harbor",
    "indigo",
    "juniper",
    "kelvin",
    "lumen",
    "meadow",
    "nimbus",
    "orbit",
    "pylon",
    "quartz",
    "raven",
)
_FILES = ("app", "db", "cache", "worker", "proxy", "auth", "queue", "search", "mail", "api")
SYSTEM = (
    "You are a coding agent. Read files with read_file and report the values you are asked "
    "for, one file at a time."
)


def _value(rng: random.Random) -> str:
    return str(rng.randrange(1, 1000)) if rng.random() < 0.5 else rng.choice(_WORDS)


def agent_chat(seed: int, index: int, turns: int = 4, lines: int = 5) -> dict[str, Any]:
    """Conversation ``index`` of the seeded sequence: ``turns`` tool calls, ``lines`` settings
    per file (the asked-for key among them)."""
    rng = random.Random(f"synthetic-agent/{seed}/{index}")
    key = rng.choice(_KEYS)
    project = rng.choice(_WORDS)
    files = rng.sample(_FILES, turns)
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": f"Report the value of {key} in each config file of the {project} project.",
        },
        {"role": "assistant", "content": f'read_file("{files[0]}.cfg")'},
    ]
    for k, name in enumerate(files):
        others = rng.sample([x for x in _KEYS if x != key], lines - 1)
        settings = {o: _value(rng) for o in others}
        settings[key] = _value(rng)
        order = list(settings)
        rng.shuffle(order)
        msgs.append({"role": "tool", "content": "\n".join(f"{o} = {settings[o]}" for o in order)})
        report = f"{name}.cfg: {key} = {settings[key]}."
        nxt = f' read_file("{files[k + 1]}.cfg")' if k + 1 < turns else " Done."
        msgs.append({"role": "assistant", "content": report + nxt})
    return {"messages": msgs}


def agent_chats(seed: int, count: int, turns: int = 4, lines: int = 5) -> list[dict[str, Any]]:
    """``count`` conversations (``agent_chat(seed, i)`` for i < count)."""
    if not 1 <= turns <= len(_FILES):
        raise ValueError(f"turns must be in [1, {len(_FILES)}], got {turns}")
    if not 1 <= lines <= len(_KEYS):
        raise ValueError(f"lines must be in [1, {len(_KEYS)}], got {lines}")
    return [agent_chat(seed, i, turns, lines) for i in range(count)]
