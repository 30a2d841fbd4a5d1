"""Byte-level BPE tokenizers built in code: the byte tokenizer of the tiny test model, and the
one transformers builds from a GGUF file's ``tokenizer.*`` metadata.

Both spell bytes in GPT-2's printable byte alphabet (:func:`bytes_to_unicode`). Errors are
``ValueError``; :class:`~akv_jax.model.tokenizer.ChatTokenizer` reports them as its
``TokenizerError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp's pre-tokenizer names -> the split regex their merges were learned with (the same
# table as transformers' GGUF converter; names not listed use GPT-2's ByteLevel regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
}

_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # llama.cpp token types


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


def byte_tokenizer(vocab_size: int, specials: Sequence[str]) -> Tokenizer:
    """Ids 0..255 are the bytes, the last ``len(specials)`` ids the special tokens, the ids
    between reserved; no merges."""
    if vocab_size < 256 + len(specials):
        raise ValueError(
            f"a byte-level tokenizer needs a vocabulary of at least {256 + len(specials)}"
        )
    spelling = bytes_to_unicode()
    vocab = {spelling[b]: b for b in range(256)}
    first_special = vocab_size - len(specials)
    for i in range(256, first_special):
        vocab[f"<|reserved_{i}|>"] = i
    for j, s in enumerate(specials):
        vocab[s] = first_special + j
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in specials])
    return tok


def gguf_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The ``tokenizers`` object transformers builds for a byte-level BPE ("gpt2") GGUF.

    Same steps as transformers' ``byte_level_tokenizer`` + ``add_gguf_special_tokens`` +
    ``set_split_regex``: the vocabulary respelled in the byte alphabet where needed, the merges as
    stored, GPT-2's ByteLevel pre-tokenizer (or the split regex the ``pre`` name calls for),
    control tokens added as special tokens and user-defined ones as plain added tokens.
    """
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
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


# tiktoken's o200k split regex (o200k_base, o200k_harmony: GPT-4o, GPT-OSS).
O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def tiktoken_tokenizer(ranks: dict[bytes, int], specials: dict[str, int], split: str) -> Tokenizer:
    """A tiktoken encoding (mergeable ranks, special tokens, split regex) as a ``tokenizers``
    byte-level BPE, the way transformers' ``TikTokenConverter`` builds it: every token's merges
    are the splits of it into two tokens, ordered by the token's rank; ``ignore_merges`` so a
    pre-token that is itself a token stays whole, as tiktoken does.

    Ids equal tiktoken's ``encode(text, allowed_special="all")``. A special id given under two
    names keeps the first name.
    """
    spelling = bytes_to_unicode()

    def spell(b: bytes) -> str:
        return "".join(spelling[x] for x in b)

    vocab: dict[str, int] = {}
    merges: list[tuple[int, int, int, str, str]] = []
    for token, rank in ranks.items():
        vocab[spell(token)] = rank
        local = []
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                local.append((rank, ranks[left], ranks[right], spell(left), spell(right)))
        merges.extend(local)
    merges.sort()
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(m[3], m[4]) for m in merges],
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=True,
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    by_id: dict[int, str] = {}
    for name, tid in specials.items():
        by_id.setdefault(tid, name)
    # Added tokens get the next free ids in the order given, so the ids must be dense.
    first = max(ranks.values(), default=-1) + 1
    if sorted(by_id) != list(range(first, first + len(by_id))):
        raise ValueError(f"special token ids must be {first}, {first + 1}, ... with no gaps")
    tok.add_special_tokens(
        [AddedToken(by_id[tid], normalized=False, special=True) for tid in sorted(by_id)]
    )
    return tok
