"""Checkpoint sources: a Hugging Face safetensors folder or a GGUF file, seen the same way.

A :class:`Source` gives the model config, the list of tensors (HF names and shapes, read from
headers only, so a checkpoint is fully validated before any weight is read), an iterator over
the weights in HF layout (float arrays, names in HF spelling) and the tokenizer that goes with
the weights.

GPT-OSS as released keeps its expert weights in MXFP4 (config.json's
``quantization_config.quant_method == "mxfp4"``): each ``<name>_blocks`` / ``<name>_scales`` pair
is seen as the one dense tensor ``<name>`` (shape derived from the headers, so a malformed pair
fails before any weight is read) and read dequantised to float32 (exact: every MXFP4 value is a
float32, and a bfloat16 too unless its scale is extreme), which the converter then maps exactly
as it maps a dense checkpoint's tensor and stores in the serving dtype. Or, for the names a
caller passes in ``read(keep_packed=...)`` (``--moe-weight-format mxfp4``), read as they are:
an :class:`Mxfp4Weight` of the uint8 blocks and scales, never decoded on the host.

MiniMax-M2 and the Qwen3 FP8 releases keep their Linear weights block-scaled FP8
(``quantization_config.quant_method == "fp8"``, :mod:`converters.fp8`): each float8_e4m3fn
``<module>.weight`` with its float32 ``<module>.weight_scale_inv`` is seen as the one dense
tensor ``<module>.weight`` (pairs, dtypes, scale shapes and ``modules_to_not_convert`` checked
from the headers before any weight is read) and read dequantised to float32, one tensor at a
time (the scale consumed, never listed). safetensors' numpy loader has no float8 dtype, so the
FP8 bytes are read at their header offsets and viewed as ml_dtypes' float8_e4m3fn.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from akv_jax.model.config import ConfigError, ModelConfig
from akv_jax.model.hf_config import config_from_hf
from akv_jax.model.tokenizer import ChatTokenizer
from akv_jax.pallas.grouped_matmul import Mxfp4Weight
from converters import fp8, mxfp4
from converters.gguf_names import gguf_to_hf_name, unpermute_llama_qk
from converters.mapping import ConversionError

# Files copied next to a converted checkpoint when the source folder has them.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


# (HF name, array) in file order; ``read(keep_packed)`` yields the MXFP4 tensors named in
# ``keep_packed`` as Mxfp4Weight of their numpy blocks and scales instead of dequantised.
Reader = Callable[..., Iterator[tuple[str, np.ndarray | Mxfp4Weight]]]


@dataclasses.dataclass
class Source:
    description: str
    config: ModelConfig
    shapes: dict[str, tuple[int, ...]]  # HF name -> shape in HF layout (dense, for MXFP4 too)
    read: Reader
    tokenizer: Callable[[], ChatTokenizer | None]
    tokenizer_files: list[Path]  # copied verbatim into a converted folder
    packed: frozenset[str] = frozenset()  # HF names stored as MXFP4 blocks + scales


# --------------------------------------------------------------------------- safetensors


def _safetensors_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError):
            raise ConversionError(f"{index} is not a valid safetensors index") from None
        files = [d / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.exists():
                raise ConversionError(f"shard {f.name} listed in {index.name} is missing")
        return files
    single = d / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"no *.safetensors weights in {d}")
    return files


MXFP4_SUFFIXES = ("_blocks", "_scales")


def _quant_method(raw: dict[str, Any], cfg_file: Path) -> tuple[str | None, Any]:
    """(quant_method, its parsed config: an :class:`fp8.Fp8Config` for "fp8")."""
    q = raw.get("quantization_config")
    if q is None:
        return None, None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method == "fp8":
        try:
            return method, fp8.parse_config(q, str(cfg_file))
        except ValueError as e:
            raise ConversionError(str(e)) from None
    if method != "mxfp4":
        raise ConversionError(
            f"{cfg_file}: quantization_config.quant_method {method!r} is not supported "
            f"(only 'mxfp4', GPT-OSS's released expert layout, and 'fp8', block-scaled FP8)"
        )
    return method, None


def _pair_fp8(
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, str],
    fp8_cfg: fp8.Fp8Config | None,
    cfg_file: Path,
) -> dict[str, str]:
    """Drop every ``X_scale_inv`` from ``shapes`` after checking it against its FP8 weight
    ``X``; returns ``X -> X_scale_inv`` for every FP8 weight."""
    pairs: dict[str, str] = {}
    for name in [n for n in shapes if dtypes.get(n, "").startswith("F8")]:
        if fp8_cfg is None:
            raise ConversionError(
                f"tensor {name} is {dtypes[name]} but {cfg_file} has no quantization_config "
                f"with quant_method 'fp8'"
            )
        if dtypes[name] != fp8.SAFETENSORS_DTYPE:
            raise ConversionError(f"fp8 tensor {name} is {dtypes[name]}; only "
                                  f"{fp8.SAFETENSORS_DTYPE} (e4m3) is supported")
        scale = name + fp8.SCALE_SUFFIX
        if scale not in shapes:
            raise ConversionError(f"fp8 tensor {name} has no matching {scale}")
        if not fp8_cfg.converts(name):
            raise ConversionError(f"fp8 tensor {name} is FP8 but its module is in "
                                  f"quantization_config.modules_to_not_convert")
        if dtypes[scale] != "F32":
            raise ConversionError(f"fp8 scale {scale} must be F32, not {dtypes[scale]}")
        want = fp8.scale_shape(shapes[name], fp8_cfg.block) if len(shapes[name]) >= 2 else None
        if shapes[scale] != want:
            raise ConversionError(
                f"fp8 scale {scale} has shape {list(shapes[scale])}, expected "
                f"{list(want) if want else '[..., out, in]'} for {name} {list(shapes[name])} "
                f"in {fp8_cfg.block[0]}x{fp8_cfg.block[1]} blocks"
            )
        pairs[name] = scale
    for name in [n for n in shapes if n.endswith(fp8.SCALE_SUFFIX)]:
        base = name.removesuffix(fp8.SCALE_SUFFIX)
        if fp8_cfg is None:
            raise ConversionError(f"tensor {name} looks like an fp8 scale but {cfg_file} has "
                                  f"no quantization_config with quant_method 'fp8'")
        if base not in pairs:
            what = "is not float8" if base in shapes else "is missing"
            raise ConversionError(f"fp8 scale {name} has no fp8 weight: {base} {what}")
        del shapes[name]
    if fp8_cfg is not None and not pairs:
        raise ConversionError(f"{cfg_file}: quantization_config.quant_method is 'fp8' but no "
                              f"tensor is float8 ({fp8.SAFETENSORS_DTYPE})")
    return pairs


def _raw_offsets(f: Path) -> dict[str, tuple[int, int, str, list[int]]]:
    """name -> (start, end, dtype, shape) of every tensor of a safetensors file, absolute
    byte offsets (the format: u64 header length, JSON header, data)."""
    with open(f, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    return {
        k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1], v["dtype"], v["shape"])
        for k, v in header.items() if k != "__metadata__"
    }


def _read_fp8(f: Path, offsets: tuple[int, int, str, list[int]]) -> np.ndarray:
    start, end, _, shape = offsets
    with open(f, "rb") as fh:
        fh.seek(start)
        buf = fh.read(end - start)
    return np.frombuffer(buf, fp8.FP8_DTYPE).reshape(shape)


def _pair_mxfp4(
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, str],
    quant: str | None,
    cfg_file: Path,
) -> dict[str, tuple[str, str]]:
    """Replace every ``X_blocks`` / ``X_scales`` pair in ``shapes`` by ``X`` with its dense
    shape ``[..., in, out]``; returns ``X -> (blocks name, scales name)``."""
    packed: dict[str, tuple[str, str]] = {}
    for name in [n for n in shapes if n.endswith(MXFP4_SUFFIXES)]:
        base = name[: -len("_blocks")]
        if quant != "mxfp4":
            raise ConversionError(
                f"tensor {name} looks MXFP4-packed but {cfg_file} has no quantization_config "
                f"with quant_method 'mxfp4'"
            )
        blocks, scales = f"{base}_blocks", f"{base}_scales"
        if base in packed:
            continue
        for have, want in ((blocks, scales), (scales, blocks)):
            if have in shapes and want not in shapes:
                raise ConversionError(f"mxfp4 tensor {have} has no matching {want}")
        if base in shapes:
            raise ConversionError(f"tensor {base} is stored both dense and as mxfp4 {blocks}")
        for n in (blocks, scales):
            if dtypes[n] != "U8":
                raise ConversionError(f"mxfp4 tensor {n} must be uint8, not {dtypes[n]}")
        b, sc = shapes[blocks], shapes[scales]
        if len(b) < 3 or b[-1] != mxfp4.BLOCK // 2 or b[:-1] != sc:
            raise ConversionError(
                f"mxfp4 shape mismatch for {base}: {blocks} is {b}, {scales} is {sc} "
                f"(expected blocks [..., out, in/{mxfp4.BLOCK}, {mxfp4.BLOCK // 2}] and scales "
                f"[..., out, in/{mxfp4.BLOCK}])"
            )
        *lead, out, groups, _ = b
        shapes[base] = (*lead, groups * mxfp4.BLOCK, out)
        del shapes[blocks], shapes[scales]
        packed[base] = (blocks, scales)
    return packed


def open_hf_dir(path: str | Path) -> Source:
    """A Hugging Face checkpoint folder: config.json + model(-0000k-of-0000n).safetensors."""
    from safetensors import safe_open

    d = Path(path)
    if not d.is_dir():
        raise ConversionError(f"checkpoint folder {d} does not exist")
    cfg_file = d / "config.json"
    if not cfg_file.exists():
        raise ConversionError(f"no config.json in {d}")
    try:
        raw = json.loads(cfg_file.read_text())
        cfg = config_from_hf(raw)
    except ValueError as e:
        raise ConversionError(f"{cfg_file}: {e}") from None
    quant, fp8_cfg = _quant_method(raw, cfg_file)
    files = _safetensors_files(d)
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    where: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as h:
                for k in h.keys():
                    sl = h.get_slice(k)
                    shapes[k] = tuple(sl.get_shape())
                    dtypes[k] = sl.get_dtype()
                    where[k] = f
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ConversionError(f"cannot read {f.name}: {e}") from None
    packed = _pair_mxfp4(shapes, dtypes, quant, cfg_file)
    fp8_scales = _pair_fp8(shapes, dtypes, fp8_cfg, cfg_file)
    fp8_files = {where[n] for n in fp8_scales}
    raw_offsets = {f: _raw_offsets(f) for f in files if f in fp8_files}
    scales_of = {blocks: (base, scales) for base, (blocks, scales) in packed.items()}
    part_of_pair = {n for pair in packed.values() for n in pair}

    def tensor(name: str) -> np.ndarray:
        with safe_open(str(where[name]), framework="numpy") as h:
            return h.get_tensor(name)

    def read(keep_packed: Collection[str] = ()) -> Iterator[tuple[str, Any]]:
        for f in files:
            with safe_open(str(f), framework="numpy") as h:
                for k in h.keys():
                    if k in scales_of:
                        base, scales = scales_of[k]
                        if base in keep_packed:
                            yield base, Mxfp4Weight(h.get_tensor(k), tensor(scales))
                            continue
                        w = mxfp4.dequantize(h.get_tensor(k), tensor(scales))
                        yield base, w.reshape(shapes[base])
                    elif k in fp8_scales:
                        q = _read_fp8(f, raw_offsets[f][k])
                        try:
                            w = fp8.dequantize(q, tensor(fp8_scales[k]), fp8_cfg.block, k)
                        except ValueError as e:
                            raise ConversionError(str(e)) from None
                        yield k, w
                    elif k.endswith(fp8.SCALE_SUFFIX) and k.removesuffix(
                        fp8.SCALE_SUFFIX
                    ) in fp8_scales:
                        continue  # consumed with its weight
                    elif k not in part_of_pair:
                        yield k, h.get_tensor(k)

    def tokenizer() -> ChatTokenizer | None:
        if not (d / "tokenizer.json").exists():
            return None
        return ChatTokenizer.from_dir(d, extra_eos_ids=cfg.eos_token_ids)

    tok_files = [d / n for n in TOKENIZER_FILES if (d / n).exists()]
    return Source(str(d), cfg, shapes, read, tokenizer, tok_files, frozenset(packed))


# --------------------------------------------------------------------------- GGUF


def read_gguf_metadata(reader: Any) -> dict[str, Any]:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def gguf_hf_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The config.json transformers derives from GGUF metadata (for llama and qwen3)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConversionError(
            f"unknown GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    n_vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    head_dim = get("rope.dimension_count") if arch == "llama" else get("attention.key_length")
    if get("rope.scaling.type") not in (None, "none") or "rope_freqs.weight" in tensor_names:
        raise ConversionError(f"GGUF RoPE scaling ({arch}) is not supported")
    cfg = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": n_vocab,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim or (hidden // heads if hidden and heads else None),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 2048),
        # transformers: tied exactly when the file has no output.weight.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    missing = [k for k, v in cfg.items() if v is None and not k.endswith("token_id")]
    if missing:
        raise ConversionError(f"GGUF metadata lacks {', '.join(missing)}")
    return cfg


def open_gguf(path: str | Path) -> Source:
    """A GGUF file: weights dequantised to float32, llama q/k un-permuted, tokenizer rebuilt."""
    import gguf

    p = Path(path)
    if not p.is_file():
        raise ConversionError(f"GGUF file {p} does not exist")
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as e:  # gguf raises ValueError/struct errors on foreign files
        raise ConversionError(f"cannot read GGUF {p.name}: {e}") from None
    meta = read_gguf_metadata(reader)
    names = {t.name for t in reader.tensors}
    try:
        cfg = config_from_hf(gguf_hf_config(meta, names))
    except ConfigError as e:
        raise ConversionError(f"{p.name}: {e}") from None
    permute = meta.get("general.architecture") == "llama"
    # GGUF stores dims innermost-first; numpy (and HF) order is the reverse.
    shapes = {
        gguf_to_hf_name(t.name): tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors
    }

    def read(keep_packed: Collection[str] = ()) -> Iterator[tuple[str, np.ndarray]]:
        # GGUF has no MXFP4 expert tensors (Source.packed is empty): keep_packed never applies
        for t in reader.tensors:
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
            name = gguf_to_hf_name(t.name)
            if permute and name.endswith("self_attn.q_proj.weight"):
                w = unpermute_llama_qk(w, cfg.num_heads)
            elif permute and name.endswith("self_attn.k_proj.weight"):
                w = unpermute_llama_qk(w, cfg.num_kv_heads)
            yield name, w.reshape(shapes[name])

    def tokenizer() -> ChatTokenizer | None:
        if "tokenizer.ggml.tokens" not in meta:
            return None
        return ChatTokenizer.from_gguf_metadata(meta)

    return Source(str(p), cfg, shapes, read, tokenizer, [])


def open_source(hf_dir: str | Path | None = None, gguf: str | Path | None = None) -> Source:
    if (hf_dir is None) == (gguf is None):
        raise ConversionError("give exactly one of an HF checkpoint folder or a GGUF file")
    return open_hf_dir(hf_dir) if hf_dir is not None else open_gguf(gguf)
