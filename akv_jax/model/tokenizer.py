"""Tokenizer and chat template, with messages encoded as per-message token *segments*.

A segment (one message's tokens) is the unit every cache operation works on, so
:meth:`ChatTokenizer.encode_messages` returns one token list per message. Their concatenation
equals what transformers' ``apply_chat_template`` gives for the whole conversation: the template
is rendered for every prefix of the conversation and each message gets the text its prefix
added. Tokens of earlier messages therefore never change when a message is appended, which is
what lets a later turn find the earlier turns' KV in the cache.

Tokenizers come from ``tokenizer.json`` (the ``tokenizers`` library) or, for a GGUF file, are
rebuilt from its metadata exactly as transformers' GGUF converter builds them. The template is
rendered with jinja2 set up the way transformers sets it up.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

Message = dict[str, Any]

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

# A plain ChatML template: the chat format of the tiny test model and the fallback for a
# checkpoint that ships a tokenizer but no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# llama.cpp's pre-tokenizer names -> the split regex their merges were learned with (the same
# table as transformers' GGUF converter; names not listed use GPT-2's ByteLevel regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}

_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # llama.cpp token types


class TokenizerError(ValueError):
    """A tokenizer or chat template that cannot be built or rendered."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


# --------------------------------------------------------------------------- jinja setup


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers' assistant-mask tag, rendered
    as its body (we never need the mask, but templates using the tag must still compile)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers replaces jinja's tojson, which would HTML-escape the output.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers renders templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not compile: {e}") from None


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(messages: Sequence[Message]) -> list[Message]:
    """Give reasoning every name templates read it under (as transformers does)."""
    out = []
    for m in messages:
        r = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append({"thinking": r, **m, "reasoning_content": r} if r is not None else dict(m))
    return out


# --------------------------------------------------------------------------- the tokenizer


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
        self._template = compile_chat_template(chat_template) if chat_template else None
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
        return cls(gguf_tokenizer(meta), meta.get("tokenizer.chat_template"), special)

    @classmethod
    def byte_level_chatml(cls, vocab_size: int) -> ChatTokenizer:
        """A trivial byte tokenizer for the random test model: ids 0..255 are bytes, the last
        three ids ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (the EOS); ChatML chat."""
        if vocab_size < 259:
            raise TokenizerError("a byte-level tokenizer needs a vocabulary of at least 259")
        spelling = bytes_to_unicode()
        vocab = {spelling[b]: b for b in range(256)}
        for i in range(256, vocab_size - 3):
            vocab[f"<|reserved_{i}|>"] = i
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        for j, s in enumerate(specials):
            vocab[s] = vocab_size - 3 + j
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in specials])
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
                messages=_alias_reasoning(messages),
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


def gguf_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The ``tokenizers`` object transformers builds for a byte-level BPE ("gpt2") GGUF.

    Same steps as transformers' ``byte_level_tokenizer`` + ``add_gguf_special_tokens`` +
    ``set_split_regex``: the vocabulary respelled in the byte alphabet where needed, the merges as
    stored, GPT-2's ByteLevel pre-tokenizer (or the split regex the ``pre`` name calls for),
    control tokens added as special tokens and user-defined ones as plain added tokens.
    """
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise TokenizerError(
            f"GGUF tokenizer model {model!r} is not supported (supported: gpt2 byte-level BPE)"
        )
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    split = GGUF_PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    # Untrimmed offsets (transformers' GPT-2 tokenizer adds nothing, so no ByteLevel trimming).
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    types = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel; transformers
    # skips it (adding it would grow the vocabulary past the model's).
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types, strict=True)
        if ty == _GGUF_CONTROL and set(t) <= alphabet
    ]
    if control:
        tok.add_special_tokens(control)
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == _GGUF_USER_DEFINED and t in vocab
    ]
    if user:
        tok.add_tokens(user)
    return tok
