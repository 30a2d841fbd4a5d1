"""Trajectory files: JSONL records read into :class:`TrainTrajectory`, and written by converters.

One line, one record, in the shape of the request an agent sends:

* **text**: ``{"messages": [{"role": ..., "content": ...}, ...], "cache": {...}}``, a
  ``POST /v1/chat/completions`` body (unknown keys ignored, as the server ignores them). Its
  messages become segments through the serving path itself: :func:`protocol.parse_chat`
  validates the body and :meth:`ChatTokenizer.encode_messages` renders one segment per message
  with the model's chat template; the ``cache`` field is the same op history
  (:func:`protocol.chat_history`), its indices naming messages. No generation prompt is added:
  the conversation's own last message ends the trajectory.
* **token ids**: ``{"messages": [{"role": ..., "token_ids": [...]}, ...], "cache": {...}}``,
  the segments of a ``POST /generate`` body with each message's role beside it (what
  :mod:`akv_jax.agent`'s policies send; their synthetic trajectories have no text).

Loss masks (per role, ``roles``, default assistant only). An assistant message's targets are
the tokens the model generates when serving it: its segment after the template's generation
prompt, through the first stop token (so the model learns to end its turn, and never to
produce the role header or the template's trailing newline). Any other role's targets are the
tokens of its content within its rendered segment. In token-id records every token of a
chosen role's message is a target. The very first token of a trajectory has nothing before it
and is never a target.

Every problem raises :class:`DataError` naming the file, line and field
(``data.jsonl:7: messages[3].content: ...``).

Converters (:func:`replay_records`, :func:`chat_records`) produce records; :func:`write_jsonl`
writes them; ``python -m akv_jax.train.sources`` runs them from the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from akv_jax.agent.messages import ROLES, Message
from akv_jax.agent.policies import ContextOverflow, Policy, RollingDrop
from akv_jax.agent.trajectory import Trajectory, TrajectorySpec, make_trajectory
from akv_jax.cache.ops import OpHistory, parse_history, token_outside_vocab
from akv_jax.errors import InvalidField
from akv_jax.model.tokenizer import ChatTokenizer, TokenizerError
from akv_jax.serving import protocol
from akv_jax.train.example import TrainTrajectory

DEFAULT_LOSS_ROLES = ("assistant",)
# The roles a chat request may carry (chat_body.Message); "function" is OpenAI's old tool role.
CHAT_ROLES = (*ROLES, "function")
TOOL_ROLES = ("tool", "function")


class DataError(ValueError):
    """A bad trajectory record: ``where`` is ``file:line``, ``field`` the field at fault."""

    def __init__(self, where: str, field: str, message: str):
        super().__init__(f"{where}: {field}: {message}")
        self.where, self.field, self.message = where, field, message


# --------------------------------------------------------------------------- reading


class JsonlSource:
    """Random access over the lines of a JSONL file (a grain ``RandomAccessDataSource``):
    item i is ``(line_number, text)`` of the i-th non-blank line. Only byte offsets are kept
    in memory; each item is read from the file when asked for."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(str(path), "file", "no such file")
        offsets, lines = [], []
        with open(self.path, "rb") as f:
            pos = 0
            for n, raw in enumerate(f, start=1):
                if raw.strip():
                    offsets.append(pos)
                    lines.append(n)
                pos += len(raw)
        if not offsets:
            raise DataError(str(path), "file", "no records (the file is empty)")
        self._offsets = np.asarray(offsets, np.int64)
        self._lines = np.asarray(lines, np.int64)

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, i: int) -> tuple[int, str]:
        with open(self.path, "rb") as f:
            f.seek(int(self._offsets[i]))
            raw = f.readline()
        return int(self._lines[i]), raw.decode("utf-8", errors="strict")

    def where(self, line: int) -> str:
        return f"{self.path}:{line}"


@dataclasses.dataclass(frozen=True)
class Tokenise:
    """Record text -> :class:`TrainTrajectory` for one model (picklable, for grain workers).

    ``tokenizer`` may be None for a model without one: only token-id records are then read.
    ``stop_ids`` end an assistant's generated part (the model's EOS ids and the tokenizer's).
    """

    tokenizer: ChatTokenizer | None
    vocab_size: int
    stop_ids: tuple[int, ...]
    roles: tuple[str, ...] = DEFAULT_LOSS_ROLES

    def __post_init__(self) -> None:
        bad = [r for r in self.roles if r not in CHAT_ROLES]
        if bad or not self.roles:
            raise ValueError(f"loss roles must be among {CHAT_ROLES}, got {list(self.roles)}")

    def __call__(self, item: tuple[int, str], where: str = "record") -> TrainTrajectory:
        line, text = item
        try:
            return self.parse(json.loads(text))
        except json.JSONDecodeError as e:
            raise DataError(f"{where}:{line}", "record", f"not JSON ({e.msg})") from None
        except InvalidField as e:
            raise DataError(f"{where}:{line}", e.field, e.message) from None

    def parse(self, record: Any) -> TrainTrajectory:
        """One decoded record (raises :class:`InvalidField` naming the field)."""
        if not isinstance(record, dict):
            raise InvalidField("record", "expected an object with 'messages'")
        msgs = record.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise InvalidField("messages", "expected a non-empty list of messages")
        if any(isinstance(m, dict) and "token_ids" in m for m in msgs):
            segments, roles, masks = self._token_messages(msgs)
        else:
            segments, roles, masks = self._text_messages(record)
        history = parse_history(record.get("cache"), len(segments), "cache")
        masks[0][0] = False  # the first token has no context to be predicted from
        if not any(m.any() for m in masks):
            raise InvalidField(
                "messages", f"no loss tokens: no message has a role in {list(self.roles)}"
            )
        return TrainTrajectory(segments, history, masks)

    def _token_messages(self, msgs: list[Any]) -> tuple[list[list[int]], list[str], list]:
        segments, roles = [], []
        for i, m in enumerate(msgs):
            f = f"messages[{i}]"
            if not isinstance(m, dict):
                raise InvalidField(f, "expected an object")
            role = m.get("role")
            if role not in CHAT_ROLES:
                raise InvalidField(f"{f}.role", f"expected one of {list(CHAT_ROLES)}, got {role!r}")
            if "token_ids" not in m:
                raise InvalidField(
                    f"{f}.token_ids", "required (a record's messages are all token ids or all text)"
                )
            if "content" in m:
                raise InvalidField(f"{f}.content", "a token-id message has no content")
            segments.append(self._ids(m["token_ids"], f"{f}.token_ids"))
            roles.append(role)
        masks = [np.full(len(s), r in self.roles) for s, r in zip(segments, roles, strict=True)]
        return segments, roles, masks

    def _ids(self, ids: Any, field: str) -> list[int]:
        if not isinstance(ids, list) or not ids:
            raise InvalidField(field, "expected a non-empty list of token ids")
        for j, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise InvalidField(f"{field}[{j}]", f"expected an integer token id, got {t!r}")
            if (why := token_outside_vocab(t, self.vocab_size)) is not None:
                raise InvalidField(f"{field}[{j}]", why)
        return ids

    def _text_messages(self, record: dict[str, Any]) -> tuple[list[list[int]], list[str], list]:
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise InvalidField("messages", "this model has no chat template; give token_ids")
        body = {k: v for k, v in record.items() if k != "cache"}
        inp = protocol.parse_chat(body, protocol.Limits(), None)
        try:
            segments = self.tokenizer.encode_messages(inp.messages, **inp.template_kwargs)
        except TokenizerError as e:
            raise InvalidField("messages", str(e)) from None
        roles = [m["role"] for m in inp.messages]
        gp = self.tokenizer.generation_prompt_segment(**inp.template_kwargs)
        masks = []
        for i, (seg, m) in enumerate(zip(segments, inp.messages, strict=True)):
            mask = np.zeros(len(seg), bool)
            if m["role"] in self.roles:
                if m["role"] == "assistant" and gp and seg[: len(gp)] == gp:
                    mask[self._generated(seg, len(gp))] = True
                else:
                    lo, hi = self._content_span(seg, m["content"], f"messages[{i}].content")
                    mask[lo:hi] = True
            masks.append(mask)
        return segments, roles, masks

    def _generated(self, seg: Sequence[int], start: int) -> slice:
        """What serving generates after the generation prompt: through the first stop id."""
        for j in range(start, len(seg)):
            if seg[j] in self.stop_ids:
                return slice(start, j + 1)
        return slice(start, len(seg))

    def _content_span(self, seg: Sequence[int], content: str, field: str) -> tuple[int, int]:
        """Token range of ``content`` inside segment ``seg``: the last place the content's text
        occurs outside special tokens (the header comes before it), through a stop token
        right after it. Exact whenever re-encoding the segment's text gives its ids."""
        if not content:
            return 0, 0
        tok = self.tokenizer
        assert tok is not None
        text = tok.decode(seg)
        enc = tok.tokenizer.encode(text, add_special_tokens=False)
        if list(enc.ids) != list(seg):
            raise InvalidField(
                field,
                "cannot align the content with its tokens (the rendered "
                "message does not re-encode to the same ids)",
            )
        specials = set(tok.tokenizer.get_added_tokens_decoder())
        taken = [(a, b) for t, (a, b) in zip(enc.ids, enc.offsets, strict=True) if t in specials]
        at = len(text)
        while (at := text.rfind(content, 0, at + len(content) - 1)) >= 0:
            end = at + len(content)
            if not any(a < end and at < b for a, b in taken):
                break
        if at < 0:
            raise InvalidField(field, "the content is not found in its rendered message")
        idx = [j for j, (a, b) in enumerate(enc.offsets) if a < end and at < b]
        lo, hi = idx[0], idx[-1] + 1
        if hi < len(seg) and seg[hi] in self.stop_ids:
            hi += 1
        return lo, hi


def without_ops(traj: TrainTrajectory) -> TrainTrajectory:
    """The same trajectory seen in full context: its ops removed."""
    return TrainTrajectory(traj.segments, OpHistory.empty(len(traj.segments)), traj.loss_mask)


def read_trajectories(path: str | Path, tokenise: Tokenise) -> list[TrainTrajectory]:
    """Every record of a file, tokenised (the whole file is validated)."""
    src = JsonlSource(path)
    return [tokenise(src[i], str(src.path)) for i in range(len(src))]


# --------------------------------------------------------------------------- converters


def replay_records(
    seed: int,
    count: int,
    spec: TrajectorySpec | None = None,
    policy: Callable[[], Policy] = RollingDrop,
) -> Iterator[dict[str, Any]]:
    """Records of synthetic agent trajectories (:mod:`akv_jax.agent.trajectory`) under a policy,
    offline (as :mod:`akv_jax.agent.offline` plays them): each trajectory's final request plus
    its answer, the recorded assistant message. Every earlier request of the trajectory must
    be a prefix of the final one, in segments and ops (true of :class:`RollingDrop`, whose op
    history only grows at its end): then each assistant message in the record is predicted
    under exactly the view its own request had. Token-id records."""
    for index in range(count):
        traj = make_trajectory(seed, index, spec or TrajectorySpec())
        yield _replay_record(traj, policy())


def _replay_record(traj: Trajectory, policy: Policy) -> dict[str, Any]:
    history = traj.initial_history()
    requests = []
    for turn in traj.turns:
        req = policy.next_request(history, turn.output_tokens)
        if req.kind != "turn":
            raise ValueError(
                f"policy {policy.name} sends {req.kind} requests; a trajectory "
                "record needs one op history for all its turns"
            )
        policy.observe(req, turn.assistant)
        requests.append(req)
        history = [*history, Message("assistant", turn.assistant)]
        if turn is not traj.turns[-1]:
            history.append(Message("tool", turn.tool))
    final = requests[-1]
    ops = parse_history(final.cache, len(history))
    for req in requests:
        n = len(req.segments)
        mine = parse_history(req.cache, n)
        if req.segments != tuple(m.tokens for m in history[:n]) or mine != ops.truncate(n):
            raise ValueError(
                f"policy {policy.name}: a request of trajectory {traj.index} is "
                "not a prefix of its final request"
            )
    return {
        "messages": [{"role": m.role, "token_ids": list(m.tokens)} for m in history],
        "cache": ops.to_api(),
    }


def chat_records(
    records: Iterable[dict[str, Any]],
    tokenizer: ChatTokenizer | None = None,
    keep_tools: int | None = None,
    repos_threshold: int | None = None,
    max_positions: int = 1 << 30,
) -> Iterator[dict[str, Any]]:
    """Plain chat records (``{"messages": [...]}``, no ``cache``) with synthetic ops: with
    ``keep_tools`` set, AKV's rolling drop (:class:`RollingDrop`) decides each assistant turn's
    request: tool outputs older than the ``keep_tools`` most recent are dropped at the boundary
    before that turn, and once the position counter reaches ``repos_threshold`` tokens a
    reposition closes the gaps. Token counts (which the threshold needs) come from
    ``tokenizer``'s segments. Without ``keep_tools`` records pass through unchanged."""
    for k, rec in enumerate(records):
        if not isinstance(rec, dict) or not isinstance(rec.get("messages"), list):
            raise InvalidField(f"records[{k}].messages", "expected a list of messages")
        if keep_tools is None:
            yield rec
            continue
        if "cache" in rec:
            raise InvalidField(f"records[{k}].cache", "already has cache ops")
        if tokenizer is None:
            raise ValueError("synthetic ops need the model's tokenizer (token counts)")
        inp = protocol.parse_chat(rec, protocol.Limits(), None)
        segs = tokenizer.encode_messages(inp.messages, **inp.template_kwargs)
        # RollingDrop works on agent Messages: the real segments, tool roles as "tool".
        history = [
            Message("tool" if m["role"] in TOOL_ROLES else m["role"], tuple(s))
            for m, s in zip(inp.messages, segs, strict=True)
        ]
        policy = RollingDrop(
            keep_tools=keep_tools,
            repos_threshold=repos_threshold if repos_threshold is not None else max_positions,
            max_positions=max_positions,
        )
        for i, m in enumerate(history):
            if m.role == "assistant" and i > 0:
                policy.next_request(history[:i], m.num_tokens)
        yield {**rec, "cache": policy.cache}


def write_jsonl(path: str | Path, records: Iterable[dict[str, Any]]) -> int:
    """Write ``records`` one per line; returns how many."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "w") as f:
        for rec in records:
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    src = JsonlSource(path)
    for i in range(len(src)):
        line, text = src[i]
        try:
            yield json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(src.where(line), "record", f"not JSON ({e.msg})") from None


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m akv_jax.train.sources", description="Write trajectory JSONL files."
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    rp = sub.add_parser("replay", help="synthetic agent trajectories under AKV's rolling drop")
    rp.add_argument("--out", required=True)
    rp.add_argument("--count", type=int, default=16)
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--context", type=int, default=4096, help="the model's positions")
    rp.add_argument("--max-turns", type=int, default=8)
    rp.add_argument("--tool-range", type=int, nargs=2, default=(16, 128))
    rp.add_argument("--output-range", type=int, nargs=2, default=(8, 32))
    rp.add_argument("--keep-tools", type=int, default=2)
    rp.add_argument("--repos-threshold", type=int, default=512)
    rp.add_argument("--vocab-size", type=int, default=512)
    cp = sub.add_parser("chat", help="plain chat JSONL plus synthetic rolling-drop ops")
    cp.add_argument("--data", required=True)
    cp.add_argument("--out", required=True)
    cp.add_argument("--model-path", default=None, help="for token counts (default: SmolLM2)")
    cp.add_argument("--keep-tools", type=int, default=None)
    cp.add_argument("--repos-threshold", type=int, default=None)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "replay":
            spec = TrajectorySpec(
                vocab_size=args.vocab_size,
                context=args.context,
                system_tokens=16,
                task_range=(8, 32),
                output_range=tuple(args.output_range),
                tool_range=tuple(args.tool_range),
                max_turns=args.max_turns,
                min_turns=1,
                keep_tools=args.keep_tools,
            )

            def policy() -> RollingDrop:
                return RollingDrop(args.keep_tools, args.repos_threshold, args.context)

            n = write_jsonl(args.out, replay_records(args.seed, args.count, spec, policy))
        else:
            from converters.loading import load_model

            tok = None
            if args.keep_tools is not None:
                tok = load_model(args.model_path, placement="host").tokenizer
            recs = chat_records(read_jsonl(args.data), tok, args.keep_tools, args.repos_threshold)
            n = write_jsonl(args.out, recs)
    except (ValueError, OSError, ContextOverflow) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
