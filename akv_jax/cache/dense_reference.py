"""A deliberately naive dense reference of the op semantics (tests only).

numpy, float64, no pages, no batching. It shares with the JAX path only the model's
constants: the config, the params (as arrays), the RoPE inverse frequencies
(:func:`akv_jax.model.rope.hf_inv_freq`) and YaRN's attention factor
(:meth:`RopeConfig.attention_scaling`). None of those is what this oracle checks (positions,
visibility, windows, repos, segment order); the frequencies and the factor are transformers'
per-model constants, checked against transformers by the golden parity tests, and a second
copy of that rule here would only be a duplicate. Everything the ops decide is computed from
scratch: every cached token keeps its raw (unrotated) key, its value, its current position and
an active flag; attention builds explicit per-query masks and rotates keys from scratch with
its own angle code. It is slow and obviously right, which is its job.

GPT-OSS (DESIGN §2.1) adds, each written here from the spec and transformers' formulas:

* q/k/v/o biases;
* attention sinks: one logit per query head joins each softmax denominator, with no value;
* sliding-window layers: a query attends to the W most recent entries of its view (the
  active entries when it is computed, in append order, itself included). Every token's K/V
  are computed at append time with the view it had then; generated tokens see the final view;
* YaRN: q and k are rotated at their *current* positions with cos and sin multiplied by the
  attention factor (as transformers does). Keeping raw keys and rotating them at their
  current position equals storing them scaled-rotated at append and moving them by the
  unscaled rotation on repos, which is what the cache does;
* the MoE MLP, token by token: router logits plus bias, top-k, softmax over the k, the
  clamped SwiGLU ``(clip(up) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``,
  expert biases, the routing-weighted sum.

MiniMax-M2 (DESIGN §2.1, transformers' ``modeling_minimax_m2``) adds:

* partial rotary: only the first ``rotary_dim`` dims of each q/k head rotate (half-split
  within them); the others are never touched, by append or by repos;
* q/k RMSNorm over the whole projection (all heads at once), before the split into heads;
* the MoE MLP, token by token: sigmoid scores, top-k on scores plus
  ``e_score_correction_bias``, the chosen unbiased scores renormalised to sum 1, experts
  ``silu(gate) * up``, no biases.
Qwen3-MoE adds (from transformers' Qwen3MoeSparseMoeBlock): per layer, the dense MLP or the
experts as the config's ``mlp_only_layers`` / ``decoder_sparse_step`` say; the router, a
softmax over *all* experts, top-k, divided by the top-k sum when ``norm_topk_prob``; experts
``silu(gate) * up``, no biases.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from akv_jax.cache.ops import OpHistory
from akv_jax.model.config import ModelConfig
from akv_jax.model.params import Params, params_to_arrays, stack_row
from akv_jax.model.rope import hf_inv_freq


@dataclasses.dataclass
class DenseState:
    k_raw: list[np.ndarray]  # per layer [N, Hkv, Dh] keys before rotation
    v: list[np.ndarray]  # per layer [N, Hkv, Dh]
    pos: np.ndarray  # [N] current positions
    active: np.ndarray  # [N]
    segment: np.ndarray  # [N]
    next_pos: int = 0
    num_segments: int = 0

    def rotated_keys(self, inv_freq: np.ndarray, scale: float = 1.0) -> list[np.ndarray]:
        """The keys as the cache stores them: rotated to their current positions, times the
        attention factor ``scale`` (YaRN; 1.0 otherwise)."""
        return [scale * reference_rope(k, self.pos, inv_freq) for k in self.k_raw]


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def reference_rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """``x`` [T, H, D] rotated to positions ``pos`` [T] (numpy, rotate-half pairing; dims past
    ``2 * len(inv_freq)`` pass through): the reference the kernels' rotations are checked on."""
    # Same angle definition as transformers: float32(inv_freq_f32 * position).
    angle = (pos.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float32)
    angle = angle.astype(np.float64)[:, None, :]
    half = len(inv_freq)  # one frequency per pair of rotary dims; the rest pass through
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    c, s = np.cos(angle), np.sin(angle)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)


def _rms_over_heads(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of [T, H, Dh] over the flattened H*Dh (MiniMax-M2's q/k norm)."""
    flat = x.reshape(x.shape[0], -1)
    return _rms(flat, w.reshape(-1), eps).reshape(x.shape)


def _window_mask(visible: np.ndarray, window: int | None) -> np.ndarray:
    """Keep, per query row, only the ``window`` last visible entries (append order)."""
    if window is None:
        return visible
    # rank[i, j]: how many visible entries of row i lie at or after j.
    rank = np.cumsum(visible[:, ::-1], axis=1)[:, ::-1]
    return visible & (rank <= window)


def _moe_sigmoid(cfg: ModelConfig, lw: dict[str, np.ndarray], h: np.ndarray) -> np.ndarray:
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        scores = 1 / (1 + np.exp(-(h[t] @ lw["router"])))
        top = np.argsort(-(scores + lw["router_score_bias"]), kind="stable")
        top = top[: cfg.num_experts_per_tok]
        r = scores[top] / scores[top].sum()
        for e, we in zip(top, r, strict=True):
            gate = h[t] @ lw["expert_gate"][e]
            act = gate / (1 + np.exp(-gate)) * (h[t] @ lw["expert_up"][e])
            out[t] += we * (act @ lw["expert_down"][e])
    return out


def _moe(cfg: ModelConfig, lw: dict[str, np.ndarray], h: np.ndarray) -> np.ndarray:
    if cfg.sigmoid_router:
        return _moe_sigmoid(cfg, lw, h)
    out = np.zeros_like(h)
    limit, alpha = cfg.swiglu_limit, cfg.swiglu_alpha
    for t in range(h.shape[0]):
        logits = h[t] @ lw["router"] + lw["router_bias"]
        top = np.argsort(-logits, kind="stable")[: cfg.num_experts_per_tok]
        r = np.exp(logits[top] - logits[top].max())
        r /= r.sum()
        for e, we in zip(top, r, strict=True):
            gate = np.minimum(h[t] @ lw["expert_gate"][e] + lw["expert_gate_bias"][e], limit)
            up = np.clip(h[t] @ lw["expert_up"][e] + lw["expert_up_bias"][e], -limit, limit)
            act = (up + 1) * gate / (1 + np.exp(-alpha * gate))
            out[t] += we * (act @ lw["expert_down"][e] + lw["expert_down_bias"][e])
    return out


def _moe_softmax(cfg: ModelConfig, lw: dict[str, np.ndarray], h: np.ndarray) -> np.ndarray:
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        logits = h[t] @ lw["router"]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[: cfg.num_experts_per_tok]
        r = p[top] / p[top].sum() if cfg.norm_topk_prob else p[top]
        for e, we in zip(top, r, strict=True):
            gate = h[t] @ lw["expert_gate"][e]
            act = gate / (1 + np.exp(-gate)) * (h[t] @ lw["expert_up"][e])
            out[t] += we * (act @ lw["expert_down"][e])
    return out


class DenseModel:
    def __init__(self, params: Params, cfg: ModelConfig):
        if cfg.layer_types is not None and "sliding_attention" in cfg.layer_types:
            assert cfg.sliding_window, "sliding layers need a window"
        self.cfg = cfg
        self.w = {k: np.asarray(v, np.float64) for k, v in params_to_arrays(params).items()}
        # Partial rotary: frequencies over the rotary dims only (transformers' ``dim``).
        self.inv_freq = hf_inv_freq(cfg.rope, cfg.rope_dim)
        self.attn_factor = float(cfg.rope.attention_scaling())

    def rotated_keys(self, st: DenseState) -> list[np.ndarray]:
        """The final keys as the cache stores them (with YaRN's attention factor)."""
        return st.rotated_keys(self.inv_freq, self.attn_factor)

    def empty(self) -> DenseState:
        L, H, D = self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim
        z = np.zeros((0, H, D))
        return DenseState([z] * L, [z] * L, np.zeros(0, int), np.zeros(0, bool), np.zeros(0, int))

    def append(self, st: DenseState, tokens: Sequence[int]) -> tuple[np.ndarray, DenseState]:
        cfg, w = self.cfg, self.w
        n = len(tokens)
        pos_new = st.next_pos + np.arange(n)
        n_old = len(st.pos)
        pos_all = np.concatenate([st.pos, pos_new])
        # mask[i, j]: query i (new token) may attend cached/new entry j
        mask = np.zeros((n, n_old + n), bool)
        mask[:, :n_old] = st.active[None, :]
        mask[:, n_old:] = np.tril(np.ones((n, n), bool))
        x = w["embed"][np.asarray(tokens)]
        k_raw, vs = [], []
        G = cfg.num_heads // cfg.num_kv_heads
        for layer in range(cfg.num_layers):
            lw = {}
            for key, v in w.items():  # this layer's row of every stack it is part of
                if key.startswith("layers."):
                    field = key[len("layers.") :].split(".")[0]
                    row = stack_row(cfg, field, layer)
                    if row is not None:
                        lw[key[len("layers.") :]] = v[row]
            h = _rms(x, lw["attn_norm"], cfg.rms_norm_eps)
            q = np.einsum("td,dhk->thk", h, lw["wq"])
            k = np.einsum("td,dhk->thk", h, lw["wk"])
            v = np.einsum("td,dhk->thk", h, lw["wv"])
            if "bq" in lw:
                q, k, v = q + lw["bq"], k + lw["bk"], v + lw["bv"]
            if cfg.qk_norm:
                q = _rms(q, lw["q_norm"], cfg.rms_norm_eps)
                k = _rms(k, lw["k_norm"], cfg.rms_norm_eps)
            elif cfg.qk_norm_over_heads:
                q = _rms_over_heads(q, lw["q_norm"], cfg.rms_norm_eps)
                k = _rms_over_heads(k, lw["k_norm"], cfg.rms_norm_eps)
            keys_raw = np.concatenate([st.k_raw[layer], k])
            vals = np.concatenate([st.v[layer], v])
            k_raw.append(keys_raw)
            vs.append(vals)
            qr = self.attn_factor * reference_rope(q, pos_new, self.inv_freq)
            kr = self.attn_factor * reference_rope(keys_raw, pos_all, self.inv_freq)
            lmask = _window_mask(mask, cfg.window_for(cfg.layer_type(layer)))
            out = np.zeros_like(q)
            for hq in range(cfg.num_heads):
                hk = hq // G
                s = qr[:, hq] @ kr[:, hk].T / np.sqrt(cfg.head_dim)
                s = np.where(lmask, s, -np.inf)
                m = s.max(axis=1, keepdims=True)
                if "sinks" in lw:
                    m = np.maximum(m, lw["sinks"][hq])
                p = np.exp(s - m)
                denom = p.sum(axis=1, keepdims=True)
                if "sinks" in lw:  # joins the denominator, carries no value
                    denom = denom + np.exp(lw["sinks"][hq] - m)
                out[:, hq] = (p / denom) @ vals[:, hk]
            x = x + np.einsum("thk,hkd->td", out, lw["wo"])
            if "bo" in lw:
                x = x + lw["bo"]
            h = _rms(x, lw["mlp_norm"], cfg.rms_norm_eps)
            if cfg.is_moe_layer(layer) and cfg.arch == "qwen3_moe":
                x = x + _moe_softmax(cfg, lw, h)
            elif cfg.is_moe_layer(layer):
                x = x + _moe(cfg, lw, h)
            else:
                g = h @ lw["w_gate"]
                x = x + ((g / (1 + np.exp(-g))) * (h @ lw["w_up"])) @ lw["w_down"]
        x = _rms(x, w["final_norm"], cfg.rms_norm_eps)
        head = w["embed"].T if "lm_head" not in w else w["lm_head"]
        logits = x @ head
        new = DenseState(
            k_raw=k_raw,
            v=vs,
            pos=pos_all,
            active=np.concatenate([st.active, np.ones(n, bool)]),
            segment=np.concatenate([st.segment, np.full(n, st.num_segments)]),
            next_pos=st.next_pos + n,
            num_segments=st.num_segments + 1,
        )
        return logits, new

    @staticmethod
    def drop(st: DenseState, segments: Sequence[int]) -> DenseState:
        active = st.active & ~np.isin(st.segment, list(segments))
        return dataclasses.replace(st, active=active)

    @staticmethod
    def repos(st: DenseState) -> DenseState:
        pos = st.pos.copy()
        r = int(st.active.sum())
        pos[st.active] = np.arange(r)
        return dataclasses.replace(st, pos=pos, next_pos=r)

    def run(self, segments: Sequence[Sequence[int]], history: OpHistory):
        """(logits of every token [T, V], final state) of a whole history."""
        st = self.empty()
        logits = []
        for s, seg in enumerate(segments):
            lg, st = self.append(st, seg)
            logits.append(lg)
            if history.drops_at(s):
                st = self.drop(st, history.drops_at(s))
            if history.repos_at(s):
                st = self.repos(st)
        return np.concatenate(logits), st
