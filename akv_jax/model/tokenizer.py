"""Tokenizer and chat template, with messages encoded as per-message token *segments*.

A segment (one message's tokens) is the unit every cache operation works on, so
:meth:`ChatTokenizer.encode_messages` returns one token list per message. Their concatenation
equals what transformers' ``apply_chat_template`` gives for the whole conversation: the template
is rendered for every prefix of the conversation and each message gets the text its prefix
added. Tokens of earlier messages therefore never change when a message is appended, which is
what lets a later turn find the earlier turns' KV in the cache.

Tokenizers come from ``tokenizer.json`` (the ``tokenizers`` library) or, for a GGUF file, are
rebuilt from its metadata exactly as transformers' GGUF converter builds them
(:mod:`akv_jax.model.byte_bpe`). The template is rendered with jinja2 set up the way
transformers sets it up (:mod:`akv_jax.model.chat_template`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer

from akv_jax.model.byte_bpe import byte_tokenizer, gguf_tokenizer
from akv_jax.model.chat_template import (
    CHATML_TEMPLATE,
    Message,
    alias_reasoning,
    compile_chat_template,
)

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class TokenizerError(ValueError):
    """A tokenizer or chat template that cannot be built or rendered."""


class ChatTokenizer:
    """A ``tokenizers.Tokenizer`` plus the chat template and special tokens around it."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None,
        special_tokens: dict[str, str | None],
        extra_eos_ids: Sequence[int] = (),
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        try:
            self._template = compile_chat_template(chat_template) if chat_template else None
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(f"chat template does not compile: {e}") from None
        eos = [self.token_to_id(self.special_tokens["eos_token"])] if self.eos_token else []
        self.eos_ids: tuple[int, ...] = tuple(
            dict.fromkeys(i for i in [*eos, *extra_eos_ids] if i is not None)
        )

    # ---- construction

    @classmethod
    def from_dir(cls, path: str | Path, extra_eos_ids: Sequence[int] = ()) -> ChatTokenizer:
        """From a checkpoint folder: tokenizer.json, tokenizer_config.json, chat_template.jinja."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.exists():
            raise TokenizerError(f"no tokenizer.json in {path}")
        tok = Tokenizer.from_file(str(tj))
        tcfg = _read_json(path / "tokenizer_config.json")
        smap = _read_json(path / "special_tokens_map.json")
        special = {
            name: _token_content(tcfg.get(name, smap.get(name))) for name in SPECIAL_TOKEN_NAMES
        }
        return cls(tok, _find_template(path, tcfg), special, extra_eos_ids)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> ChatTokenizer:
        """From GGUF ``tokenizer.*`` metadata (see :func:`gguf_tokenizer`)."""
        tokens = meta["tokenizer.ggml.tokens"]
        special = {}
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        ):
            tid = meta.get(f"tokenizer.ggml.{key}")
            special[name] = tokens[tid] if tid is not None else None
        try:
            tok = gguf_tokenizer(meta)
        except ValueError as e:
            raise TokenizerError(str(e)) from None
        return cls(tok, meta.get("tokenizer.chat_template"), special)

    @classmethod
    def byte_level_chatml(cls, vocab_size: int) -> ChatTokenizer:
        """A trivial byte tokenizer for the random test model: ids 0..255 are bytes, the last
        three ids ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (the EOS); ChatML chat."""
        try:
            tok = byte_tokenizer(vocab_size, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        except ValueError as e:
            raise TokenizerError(str(e)) from None
        special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": None}
        return cls(tok, CHATML_TEMPLATE, special)

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into ``path``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(path / "tokenizer.json"))
        tcfg: dict[str, Any] = dict(self.special_tokens)
        if self.chat_template:
            tcfg["chat_template"] = self.chat_template
            (path / "chat_template.jinja").write_text(self.chat_template)
        (path / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1, ensure_ascii=False))

    # ---- plain text

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` with no special tokens added (special-token strings in it still
        map to their ids, as in transformers)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat

    def render(
        self, messages: Sequence[Message], add_generation_prompt: bool = False, **kwargs: Any
    ) -> str:
        """The chat template's text for ``messages`` (transformers' ``tokenize=False``)."""
        if self._template is None:
            raise TokenizerError("this tokenizer has no chat template")
        context = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=alias_reasoning(messages),
                tools=context.pop("tools", None),
                documents=context.pop("documents", None),
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from None

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = False, **kwargs: Any
    ) -> list[int]:
        """The whole conversation as one id list (transformers' ``apply_chat_template``)."""
        return self.encode(self.render(messages, add_generation_prompt, **kwargs))

    def encode_messages(
        self, messages: Sequence[Message], add_generation_prompt: bool = False, **kwargs: Any
    ) -> list[list[int]]:
        """One token segment per message (plus the generation prompt as a last segment when
        ``add_generation_prompt``); their concatenation equals :meth:`apply_chat_template`.

        Message i's segment is the text that rendering ``messages[:i+1]`` adds to the rendering
        of ``messages[:i]``. Each piece is tokenized on its own, which is exact whenever no token
        spans a message boundary (chat formats end messages with special tokens or newlines);
        otherwise the full text is tokenized once and cut where each piece starts.
        """
        if not messages:
            raise TokenizerError("no messages")
        full = self.render(messages, add_generation_prompt, **kwargs)
        ends = []
        for i in range(len(messages)):
            prefix = self.render(messages[: i + 1], False, **kwargs)
            # A template may render a message differently once others follow it (e.g. one
            # that strips old reasoning); the boundary is then where the two texts part.
            ends.append(_common_prefix_len(prefix, full))
        if add_generation_prompt:
            ends.append(len(full))
        ends[-1] = len(full)
        for i in range(1, len(ends)):
            ends[i] = max(ends[i], ends[i - 1])
        starts = [0, *ends[:-1]]
        segments = [self.encode(full[s:e]) for s, e in zip(starts, ends, strict=True)]
        if [t for seg in segments for t in seg] != self.encode(full):
            segments = self._cut_full_encoding(full, ends)
        for i, seg in enumerate(segments):
            if not seg:
                raise TokenizerError(
                    f"message {i} renders to no tokens; segments must be non-empty"
                )
        return segments

    def _cut_full_encoding(self, full: str, ends: list[int]) -> list[list[int]]:
        enc = self.tokenizer.encode(full, add_special_tokens=False)
        segments: list[list[int]] = [[] for _ in ends]
        seg = 0
        for tid, (s, _) in zip(enc.ids, enc.offsets, strict=True):
            while seg < len(ends) - 1 and s >= ends[seg]:
                seg += 1
            segments[seg].append(tid)
        return segments

    def generation_prompt_segment(self) -> list[int]:
        """The ids ``add_generation_prompt`` appends (a segment of its own; may be empty)."""
        probe = [{"role": "user", "content": "x"}]
        with_gp = self.render(probe, True)
        without = self.render(probe, False)
        if not with_gp.startswith(without):
            raise TokenizerError("the template's generation prompt is not a pure suffix")
        return self.encode(with_gp[len(without) :])


# --------------------------------------------------------------------------- helpers


def _common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_content(tok: Any) -> str | None:
    """A special token given as a string or as an AddedToken dict."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _find_template(path: Path, tcfg: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    tmpl = tcfg.get("chat_template") or _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(tmpl, list):  # named templates: use the default one
        named = {t.get("name"): t.get("template") for t in tmpl}
        tmpl = named.get("default") or next(iter(named.values()), None)
    return tmpl
