"""Where each Hugging Face tensor goes among akv_jax's params, and which name fills a param.

:func:`hf_target` matches a tensor name against the table of :mod:`converters.tensor_rules`
(the architecture's own rules first), checks its layer and expert indices against the config
and says which param (and row of a stacked param) it fills with which transform; a tensor
with no place raises :class:`ConversionError`, so nothing is silently dropped.
:func:`hf_name_for` names the tensor a param expects, for error messages.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax

from akv_jax.model.config import ModelConfig
from akv_jax.model.params import PACKABLE_FIELDS, ArrayInfo, Params, stack_row
from converters.tensor_rules import ARCH_EXTRA, ARCH_RULES, EXTRA, RULES, Transform


class ConversionError(ValueError):
    """A checkpoint that cannot be converted (missing/unexpected tensor, wrong shape...)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one HF tensor goes: param ``path``, ``layer`` index (None if not stacked)."""

    path: str
    layer: int | None
    hf_shape: tuple[int, ...]
    transform: Transform
    # Further params filled from the same tensor (GPT-OSS's interleaved gate_up_proj fills
    # both the expert gate and up weights): (path, transform) pairs.
    extra: tuple[tuple[str, Transform], ...] = ()
    # The expert this tensor holds (per-expert checkpoints: Qwen3-MoE, MiniMax-M2): it fills
    # ``[layer, expert]`` of the stacked param; None for whole tensors.
    expert: int | None = None

    def outputs(self) -> tuple[tuple[str, Transform], ...]:
        return ((self.path, self.transform), *self.extra)


# Params that may be filled from a packed MXFP4 tensor and stay packed (Mxfp4Weight).
PACKABLE = frozenset(f"layers.{f}" for f in PACKABLE_FIELDS)
_COMPILED = [(re.compile(pat), path, shape, fn) for pat, path, shape, fn in RULES]
_ARCH_COMPILED = {
    arch: [(re.compile(pat), path, shape, fn) for pat, path, shape, fn in rules]
    for arch, rules in ARCH_RULES.items()
}


@functools.cache
def _param_paths(cfg: ModelConfig) -> frozenset[str]:
    """The param paths ``cfg``'s model has (optional fields are None otherwise)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(
        Params.abstract(cfg), is_leaf=lambda x: isinstance(x, ArrayInfo)
    )
    return frozenset(".".join(p.name for p in path) for path, _ in flat)

# Present in some checkpoints, never needed: RoPE buffers are recomputed from the config.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def hf_target(name: str, cfg: ModelConfig) -> Target | None:
    """Where HF tensor ``name`` goes, or None if it is to be skipped.

    Raises :class:`ConversionError` for a tensor akv_jax has no place for (e.g. biases, or an
    architecture feature it does not implement), so nothing is silently dropped.
    """
    if _IGNORED.fullmatch(name):
        return None
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None  # some tied checkpoints store the (identical) head anyway
    arch_rules = _ARCH_COMPILED.get(cfg.arch, [])
    for i, (pat, path, shape, fn) in enumerate([*arch_rules, *_COMPILED]):
        m = pat.fullmatch(name)
        if m is None:
            continue
        if path not in _param_paths(cfg):
            break  # e.g. a qk-norm in a Llama, a bias in a model without biases
        layer = int(m.group(1)) if m.groups() else None
        if layer is not None and not 0 <= layer < cfg.num_layers:
            raise ConversionError(
                f"tensor {name}: layer {layer} >= num_hidden_layers {cfg.num_layers}"
            )
        if layer is not None and stack_row(cfg, path.removeprefix("layers."), layer) is None:
            kind = "an MoE" if cfg.is_moe_layer(layer) else "a dense"
            raise ConversionError(
                f"unexpected tensor {name}: layer {layer} has {kind} MLP in this config "
                f"(mlp_only_layers / decoder_sparse_step)"
            )
        expert = int(m.group(2)) if len(m.groups()) > 1 else None
        if expert is not None and not 0 <= expert < cfg.num_experts:
            raise ConversionError(
                f"tensor {name}: expert {expert} >= {_experts_field(cfg)} {cfg.num_experts}"
            )
        if i < len(arch_rules):
            extra = ARCH_EXTRA.get(cfg.arch, {}).get(pat.pattern, ())
        else:
            extra = EXTRA.get(path, ())
        return Target(path, layer, shape(cfg), fn, extra, expert)
    raise ConversionError(f"unexpected tensor {name} (not part of a supported {cfg.arch} model)")


def _experts_field(cfg: ModelConfig) -> str:
    # The expert count's name in the architecture's own config.json, for error messages.
    return "num_experts" if cfg.arch == "qwen3_moe" else "num_local_experts"


def hf_name_for(
    path: str, layer: int | None, arch: str | None = None, expert: int | None = None
) -> str:
    """The HF tensor name that fills param ``path`` (at ``layer``, and ``expert`` for a
    per-expert checkpoint of ``arch``): for error messages."""
    if expert is not None:
        rules = [r for r in ARCH_RULES.get(arch, []) if r[0].count(r"(\d+)") == 2]
    else:
        rules = [r for r in ARCH_RULES.get(arch, []) if r[0].count(r"(\d+)") < 2] + RULES
    for base, extra in EXTRA.items():
        if any(path == p for p, _ in extra) and not any(p == path for _, p, _, _ in rules):
            path = base
    for pat, p, _, _ in rules:
        if p == path:
            name = pat
            for idx in (layer, expert):
                if idx is not None:
                    name = name.replace(r"(\d+)", str(idx), 1)
            return name.replace("\\.", ".")
    return path
