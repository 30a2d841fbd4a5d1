"""Real vocabularies read from local files: o200k_harmony (GPT-OSS) and Qwen3's, as the
``quicktok-v1`` package bundles them, and openai-harmony's encoding loaded offline.

Nothing here downloads: openai-harmony would fetch ``o200k_base.tiktoken`` on first use, so the
file is written from quicktok's ranks into a local cache folder and harmony is pointed at it
(its SHA-256 is checked against the published one, so a different vocabulary fails loudly).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import struct
import threading
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from akv_jax.model.byte_bpe import O200K_SPLIT, QWEN2_SPLIT, tiktoken_tokenizer

__all__ = [
    "O200K_BASE_SHA256",
    "harmony_encoding",
    "o200k_harmony",
    "o200k_harmony_tokenizer",
    "qwen3",
    "qwen3_tokenizer",
    "quicktok_encoding",
]

# The SHA-256 of openaipublic's o200k_base.tiktoken (the file openai-harmony downloads).
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"

Encoding = tuple[dict[bytes, int], dict[str, int]]


def quicktok_encoding(name: str, vocab: str) -> Encoding:
    """quicktok's bundled data files as ``(ranks, specials)``: ``<vocab>.vocab`` (u32 count,
    then per token u16 length, bytes, u32 rank) and ``<name>.special`` (u32 count, then per
    token u32 id, u16 length, UTF-8 name). A special id listed under a reserved name and a real
    one keeps the real one."""
    import quicktok

    data = Path(quicktok.__file__).parent / "data"
    raw = (data / f"{vocab}.vocab").read_bytes()
    (n,), off, ranks = struct.unpack_from("<I", raw), 4, {}
    for _ in range(n):
        (length,) = struct.unpack_from("<H", raw, off)
        token = raw[off + 2 : off + 2 + length]
        (ranks[token],) = struct.unpack_from("<I", raw, off + 2 + length)
        off += 6 + length
    if off != len(raw):
        raise ValueError(f"{vocab}.vocab: {len(raw) - off} trailing bytes")
    raw = (data / f"{name}.special").read_bytes()
    (n,), off, specials = struct.unpack_from("<I", raw), 4, []
    for _ in range(n):
        tid, length = struct.unpack_from("<IH", raw, off)
        specials.append((raw[off + 6 : off + 6 + length].decode(), tid))
        off += 6 + length
    if off != len(raw):
        raise ValueError(f"{name}.special: {len(raw) - off} trailing bytes")
    specials.sort(key=lambda s: s[0].startswith("<|reserved_"))
    return ranks, dict(specials)


@functools.cache
def o200k_harmony() -> Encoding:
    """GPT-OSS's vocabulary: o200k's ranks plus harmony's special tokens."""
    return quicktok_encoding("o200k_harmony", "o200k")


@functools.cache
def qwen3() -> Encoding:
    """Qwen3's vocabulary (151,643 ranks; ``<think>``, ``<tool_call>`` etc. as specials)."""
    return quicktok_encoding("qwen3", "qwen3")


@functools.cache
def o200k_harmony_tokenizer() -> Tokenizer:
    """o200k_harmony as a ``tokenizers`` BPE (ids equal tiktoken's, specials included)."""
    ranks, specials = o200k_harmony()
    return tiktoken_tokenizer(ranks, specials, O200K_SPLIT)


@functools.cache
def qwen3_tokenizer() -> Tokenizer:
    """Qwen3's vocabulary as a ``tokenizers`` BPE."""
    ranks, specials = qwen3()
    return tiktoken_tokenizer(ranks, specials, QWEN2_SPLIT)


def cache_dir() -> Path:
    root = os.environ.get("AKV_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "akv_jax"
    )
    return Path(root)


_harmony_lock = threading.Lock()


@functools.cache
def harmony_encoding() -> Any:
    """openai-harmony's GPT-OSS encoding, loaded offline from quicktok's o200k ranks."""
    import openai_harmony

    d = cache_dir() / "tiktoken"
    f = d / "o200k_base.tiktoken"
    if not f.exists():
        ranks, _ = o200k_harmony()
        text = "".join(
            f"{base64.b64encode(t).decode()} {r}\n"
            for t, r in sorted(ranks.items(), key=lambda x: x[1])
        )
        if hashlib.sha256(text.encode()).hexdigest() != O200K_BASE_SHA256:
            raise ValueError("quicktok's o200k vocabulary is not o200k_base")
        d.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(f)
    with _harmony_lock:  # the variables are process-wide: set them only for this load
        saved = {k: os.environ.get(k) for k in ("TIKTOKEN_ENCODINGS_BASE", "TIKTOKEN_RS_CACHE_DIR")}
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(d)
        os.environ["TIKTOKEN_RS_CACHE_DIR"] = str(d / "cache")
        try:
            return openai_harmony.load_harmony_encoding(
                openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS
            )
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
