"""Tokenizer and chat template, with messages encoded as per-message token *segments*.

A segment (one message's tokens) is the unit every cache operation works on, so
:meth:`ChatTokenizer.encode_messages` returns one token list per message. Their concatenation
equals what transformers' ``apply_chat_template`` gives for the whole conversation: the template
is rendered for every prefix of the conversation and each message gets the text its prefix
added. With templates that render each message the same whatever follows it, tokens of earlier
messages therefore never change when a message is appended, which is what lets a later turn find
the earlier turns' KV in the cache. Some templates do not (GPT-OSS's harmony drops reasoning
once a final answer ends the conversation, Qwen3's once a later user message follows): each
segment is still exactly its message's text in the full rendering (found by
:mod:`akv_jax.model.message_ends`), and the changed messages simply miss the cache.

Tokenizers come from ``tokenizer.json`` (the ``tokenizers`` library) or, for a GGUF file, are
rebuilt from its metadata exactly as transformers' GGUF converter builds them
(:mod:`akv_jax.model.byte_bpe`). The template is rendered with jinja2 set up the way
transformers sets it up (:mod:`akv_jax.model.chat_template`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from tokenizers import Tokenizer

from akv_jax.model import byte_bpe, vocabularies
from akv_jax.model.byte_bpe import byte_tokenizer, gguf_tokenizer
from akv_jax.model.chat_template import (
    CHATML_TEMPLATE,
    MINIMAX_M2_TINY_SPECIALS,
    MINIMAX_M2_TINY_TEMPLATE,
    Message,
    alias_reasoning,
    compile_chat_template,
)
from akv_jax.model.harmony_template import HARMONY_SPECIALS, HARMONY_TEMPLATE
from akv_jax.model.message_ends import message_end
from akv_jax.model.released_templates import QWEN3_TEMPLATE

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

    @classmethod
    def byte_level_minimax_m2(cls, vocab_size: int) -> ChatTokenizer:
        """The byte tokenizer with MiniMax-M2's chat structure (``tiny-minimax-m2``): the last
        three ids ``]~!b[`` (BOS), ``]~b]`` (role start), ``[e~[`` (message end, the EOS)."""
        try:
            tok = byte_tokenizer(vocab_size, list(MINIMAX_M2_TINY_SPECIALS))
        except ValueError as e:
            raise TokenizerError(str(e)) from None
        bos, _, eos = MINIMAX_M2_TINY_SPECIALS
        special = {"bos_token": bos, "eos_token": eos, "unk_token": None}
        return cls(tok, MINIMAX_M2_TINY_TEMPLATE, special)

    @classmethod
    def byte_level_harmony(cls, vocab_size: int) -> ChatTokenizer:
        """A byte tokenizer for the random GPT-OSS (``tiny-gpt-oss``): ids 0..255 are bytes,
        the last ids harmony's special tokens (``<|return|>`` last, the EOS, as GPT-OSS's;
        ``<|call|>`` and ``<|endoftext|>`` end a generation too); harmony chat."""
        try:
            tok = byte_tokenizer(vocab_size, HARMONY_SPECIALS)
        except ValueError as e:
            raise TokenizerError(str(e)) from None
        special = {"bos_token": "<|startoftext|>", "eos_token": "<|return|>",
                   "pad_token": "<|endoftext|>"}
        extra = [tok.token_to_id("<|call|>"), tok.token_to_id("<|endoftext|>")]
        return cls(tok, HARMONY_TEMPLATE, special, extra_eos_ids=extra)

    @classmethod
    def o200k_harmony(cls) -> ChatTokenizer:
        """GPT-OSS's tokenizer (``tiny-gpt-oss-bpe``): the o200k_harmony vocabulary
        (:func:`akv_jax.model.vocabularies.o200k_harmony_tokenizer`) chatting in harmony, its
        special tokens as GPT-OSS's tokenizer_config.json (EOS ``<|return|>``) and
        generation_config.json (``<|call|>`` and ``<|endoftext|>`` end a generation too)."""
        tok = _cached_bpe("o200k_harmony", vocabularies.o200k_harmony,
                          vocabularies.o200k_harmony_tokenizer, ())
        special = {"bos_token": "<|startoftext|>", "eos_token": "<|return|>",
                   "pad_token": "<|endoftext|>"}
        extra = [tok.token_to_id("<|call|>"), tok.token_to_id("<|endoftext|>")]
        return cls(tok, HARMONY_TEMPLATE, special, extra_eos_ids=extra)

    @classmethod
    def qwen3(cls) -> ChatTokenizer:
        """Qwen3's tokenizer (``tiny-qwen3-moe-bpe``): its vocabulary
        (:func:`akv_jax.model.vocabularies.qwen3_tokenizer`) with the released chat template,
        EOS ``<|im_end|>`` and pad ``<|endoftext|>`` (tokenizer_config.json; no BOS), which
        ends a generation too (generation_config.json). As released, ``<think>``,
        ``<tool_call>`` and the other markup ids from ``<tool_call>`` on are added tokens that
        are not special, so decoding with ``skip_special_tokens`` keeps their text."""
        tok = _cached_bpe("qwen3", vocabularies.qwen3, vocabularies.qwen3_tokenizer,
                          QWEN3_MARKUP_TOKENS)
        special = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        return cls(tok, QWEN3_TEMPLATE, special, extra_eos_ids=[tok.token_to_id("<|endoftext|>")])

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

        Message i's segment is its text in the full rendering: from the end of message i-1 to
        the end of the rendering of ``messages[:i+1]``. Templates may render a message
        differently once others follow it, and :func:`message_end` finds the end anyway in
        the two ways they do (see there); a template whose messages cannot be told apart in the
        full rendering is refused (:class:`TokenizerError`). Each piece is tokenized on its
        own, which is exact whenever no token spans a message boundary (chat formats end
        messages with special tokens or newlines); otherwise the full text is tokenized once
        and cut where each piece starts.
        """
        if not messages:
            raise TokenizerError("no messages")
        full = self.render(messages, add_generation_prompt, **kwargs)
        gen_prompt = None
        ends: list[int] = []
        for i in range(len(messages) - 1 + int(add_generation_prompt)):
            last = self.render(messages[: i + 1], False, **kwargs)
            if full.startswith(last) and len(last) >= (ends[-1] if ends else 0):
                ends.append(len(last))
                continue
            if gen_prompt is None:
                try:
                    gen_prompt = self._generation_prompt_text(**kwargs)
                except TokenizerError:
                    gen_prompt = ""
            renderings = [last]
            try:  # some templates refuse a generation prompt after some messages
                followed = self.render(messages[: i + 1], True, **kwargs)
            except TokenizerError:
                pass
            else:
                if gen_prompt and followed.endswith(gen_prompt):
                    followed = followed[: len(followed) - len(gen_prompt)]
                renderings.insert(0, followed)
            end = message_end(full, renderings, ends[-1] if ends else 0, self._special_texts())
            if end is None:
                raise TokenizerError(
                    f"cannot split the conversation into messages: message {i} "
                    f"({messages[i].get('role')!r}) is rendered differently once later messages "
                    "follow it, and its end is not found in the full rendering"
                )
            ends.append(end)
        ends.append(len(full))
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

    def _special_texts(self) -> list[str]:
        return [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]

    def _cut_full_encoding(self, full: str, ends: list[int]) -> list[list[int]]:
        enc = self.tokenizer.encode(full, add_special_tokens=False)
        segments: list[list[int]] = [[] for _ in ends]
        seg = 0
        for tid, (s, _) in zip(enc.ids, enc.offsets, strict=True):
            while seg < len(ends) - 1 and s >= ends[seg]:
                seg += 1
            segments[seg].append(tid)
        return segments

    def generation_prompt_segment(self, **kwargs: Any) -> list[int]:
        """The ids ``add_generation_prompt`` appends (a segment of its own; may be empty)."""
        return self.encode(self._generation_prompt_text(**kwargs))

    def _generation_prompt_text(self, **kwargs: Any) -> str:
        probe = [{"role": "user", "content": "x"}]
        with_gp = self.render(probe, True, **kwargs)
        without = self.render(probe, False, **kwargs)
        if not with_gp.startswith(without):
            raise TokenizerError("the template's generation prompt is not a pure suffix")
        return with_gp[len(without) :]


# --------------------------------------------------------------------------- helpers


# Qwen3's added tokens that its tokenizer_config.json marks "special": false (ids 151657-151668).
QWEN3_MARKUP_TOKENS = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)


def _cached_bpe(
    name: str,
    encoding: Callable[[], Any],
    build: Callable[[], Tokenizer],
    not_special: Sequence[str],
) -> Tokenizer:
    """``build()`` (with the ``not_special`` added tokens made ordinary ones), kept as a
    tokenizer.json under :func:`akv_jax.model.vocabularies.cache_dir`, as loading that is
    cheaper than building the BPE at every start. The file is named by a digest of the
    vocabulary and of the code that builds it, so a change to either builds it afresh."""
    digest = hashlib.sha256(pickle.dumps((encoding(), tuple(not_special)), protocol=5))
    for module in (vocabularies, byte_bpe):
        digest.update(Path(module.__file__).read_bytes())
    digest.update(tokenizers.__version__.encode())
    folder = vocabularies.cache_dir() / "tokenizers"
    path = folder / f"{name}-{digest.hexdigest()[:16]}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    spec = json.loads(build().to_str())
    for added in spec["added_tokens"]:
        if added["content"] in not_special:
            added["special"] = False
    text = json.dumps(spec, ensure_ascii=False)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    for old in folder.glob(f"{name}-*.json"):  # earlier versions of this vocabulary
        if old != path:
            old.unlink(missing_ok=True)
    return Tokenizer.from_str(text)


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
