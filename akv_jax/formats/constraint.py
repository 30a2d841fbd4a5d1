"""Constrained decoding: a grammar engine's token mask over one request's generation.

``tool_choice`` ``required`` / named and ``response_format`` json_object / json_schema are
enforced by compiling the family's call or document syntax (:mod:`akv_jax.formats.grammars`)
with llguidance and masking, at every step, the ids the grammar does not allow. One
:class:`GrammarCompiler` per served model builds llguidance's view of the vocabulary once;
each request gets a :class:`TokenConstraint`.

Driving a constraint, per step: take :meth:`TokenConstraint.forced` tokens when there are
any (append them as if sampled, :meth:`~TokenConstraint.advance` each), otherwise sample
from :meth:`~TokenConstraint.mask_logits` (or mask with :meth:`~TokenConstraint.allowed` /
:meth:`~TokenConstraint.bitmask` on the device) and advance with the sampled id; stop when
:attr:`~TokenConstraint.finished`. The grammar ends with the token that ends the generation
(``<|call|>``, ``<|return|>``, ``<|im_end|>``, EOS), so that token is the last one advanced.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import jsonschema
import llguidance
import llguidance.numpy as llnp
import numpy as np
from tokenizers import AddedToken, Tokenizer

from akv_jax.formats import grammars
from akv_jax.formats.grammars import Tool, Vocab

FAMILIES = ("harmony", "qwen3", "minimax_m2", "llama3", "plain")
# Vocabulary entries a tokenizer holds back for later use; never to be generated.
RESERVED = re.compile(r"<\|reserved[^|]*\|>")
CACHE_SIZE = 256  # compiled grammars kept per model (requests repeat their tools)


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot compile (the message says why, in one line)."""


def one_line(text: str) -> str:
    return " ".join(str(text).split())


class GrammarCompiler:
    """One per served model: the llguidance tokenizer is built once (it can take seconds on
    a 200k vocabulary), thread-safe to use from several threads."""

    def __init__(self, tokenizer: Any, logits_width: int, family: str):
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")
        hf: Tokenizer = tokenizer.tokenizer
        n = hf.get_vocab_size(with_added_tokens=True)
        if logits_width < n:
            raise ValueError(f"logits width {logits_width} is below the vocabulary's {n}")
        self.family = family
        self.logits_width = int(logits_width)
        hf = reserved_as_special(hf)
        eos = list(tokenizer.eos_ids)
        try:
            # n_vocab pads llguidance's vocabulary to the logits: ids past the tokenizer's
            # become nameless special tokens, which no grammar here names.
            self._ll = llguidance.LLTokenizer(
                hf.to_str(), n_vocab=self.logits_width, eos_token=eos or None
            )
        except ValueError as e:
            raise ValueError(f"llguidance cannot use this tokenizer: {one_line(e)}") from None
        # llguidance treats special added tokens and any added "<...>" token as special.
        specials = {
            t.content: i
            for i, t in hf.get_added_tokens_decoder().items()
            if t.special or (t.content.startswith("<") and t.content.endswith(">"))
        }
        self.vocab = Vocab(specials, eos)
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    # ---- public

    def check_schema(self, schema: dict) -> None:
        """Raise :class:`GrammarError` unless ``schema`` is a valid JSON schema (its
        meta-schema) that llguidance compiles."""
        meta_check(schema)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(grammars.styled(schema))
        except ValueError as e:
            raise GrammarError(f"schema does not compile: {one_line(e)}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self._ll)
        if error:
            raise GrammarError(f"schema does not compile: {first_line(error)}")

    def json_document(
        self, schema: dict | None, *, reasoning_budget: int = 0, reasoning_open: bool = False
    ) -> TokenConstraint:
        """A JSON document (response_format): any JSON object when ``schema`` is None
        (json_object), else one valid against ``schema`` (json_schema). ``reasoning_open``:
        the prompt left a ``<think>`` block open (Qwen3 family; MiniMax-M2's always does)."""
        budget = check_budget(reasoning_budget)
        if schema is not None:
            meta_check(schema)
        return self._constraint(
            ["document", schema, budget, bool(reasoning_open)],
            lambda: self._grammar(None, schema, budget, False, bool(reasoning_open)),
        )

    def tool_calls(
        self,
        tools: list[dict],
        *,
        names: list[str] | None = None,
        parallel: bool = False,
        reasoning_budget: int = 0,
        reasoning_open: bool = False,
    ) -> TokenConstraint:
        """Calls of the declared ``tools`` (OpenAI chat ``tools``): ``names`` the functions
        allowed (None: any declared one), ``parallel`` more than one call where the family
        can say so (Qwen3, plain, MiniMax-M2; harmony and Llama 3 make one);
        ``reasoning_open`` as for :meth:`json_document`."""
        budget = check_budget(reasoning_budget)
        chosen = select_tools(tools, names)
        key = [[t.name, t.parameters] for t in chosen]
        return self._constraint(
            ["tools", key, bool(parallel), budget, bool(reasoning_open)],
            lambda: self._grammar(chosen, None, budget, bool(parallel), bool(reasoning_open)),
        )

    # ---- compiling

    def _grammar(
        self, tools: list[Tool] | None, schema: dict | None, budget: int, parallel: bool,
        reasoning_open: bool,
    ) -> str:
        v, f = self.vocab, self.family
        try:
            if f == "harmony":
                return grammars.harmony(v, tools, schema, budget)
            if f in ("qwen3", "plain"):
                return grammars.chatml(v, tools, schema, budget, parallel, think=f == "qwen3",
                                       reasoning_open=reasoning_open)
            if f == "llama3":
                return grammars.llama3(v, tools, schema)
            return grammars.minimax_m2(v, tools, schema, budget, parallel)
        except (KeyError, ValueError) as e:
            raise GrammarError(f"no {f} grammar for this vocabulary: {one_line(e)}") from None

    def _constraint(self, key: list, grammar: Callable[[], str]) -> TokenConstraint:
        k = json.dumps(key, sort_keys=True, ensure_ascii=False)
        with self._lock:
            proto = self._compiled.get(k)
            if proto is not None:
                self._compiled.move_to_end(k)
                return TokenConstraint(proto.deep_copy(), self.logits_width, self.vocab.eos_ids)
        text = grammar()
        # The matcher compiles outside the lock (llguidance drops the GIL while it does).
        matcher = llguidance.LLMatcher(self._ll, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"grammar does not compile: {first_line(matcher.get_error())}")
        with self._lock:
            self._compiled[k] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
            return TokenConstraint(matcher.deep_copy(), self.logits_width, self.vocab.eos_ids)


class TokenConstraint:
    """One request's grammar state (host side)."""

    def __init__(
        self, matcher: llguidance.LLMatcher, logits_width: int, eos_ids: tuple[int, ...] = ()
    ):
        self._m = matcher
        self._width = logits_width
        self._eos = frozenset(eos_ids)
        self._bits = llnp.allocate_token_bitmask(1, logits_width)
        self._allowed: np.ndarray | None = None
        self._forced: list[int] | None = None

    def bitmask(self) -> np.ndarray:
        """The allowed ids packed 32 to an int32 (bit ``i % 32`` of word ``i // 32``), for
        masking on the device; read-only, valid until the next :meth:`advance`."""
        self._fill()
        return self._bits[0]

    def allowed(self) -> np.ndarray:
        """bool [logits_width]: the ids the grammar allows next (read-only). Once
        :attr:`finished`, llguidance allows only the EOS ids."""
        self._fill()
        assert self._allowed is not None
        return self._allowed

    def mask_logits(self, logits: np.ndarray) -> np.ndarray:
        """A copy of the 1-D row ``logits`` with every disallowed id set to -inf."""
        logits = np.asarray(logits)
        if logits.shape != (self._width,) or not np.issubdtype(logits.dtype, np.floating):
            raise ValueError(
                f"expected a float row of {self._width} logits, got {logits.dtype} "
                f"{logits.shape}"
            )
        return np.where(self.allowed(), logits, np.array(-np.inf, dtype=logits.dtype))

    def advance(self, token_id: int) -> None:
        """Consume ``token_id``; ValueError (state unchanged) if the grammar rejects it."""
        t = int(token_id)
        if self.finished:
            raise ValueError(f"token {t} after the grammar finished")
        if not 0 <= t < self._width or not self._allows(t):
            raise ValueError(f"token {t} is not allowed by the grammar here")
        if not self._m.consume_token(t):
            raise ValueError(f"token {t} rejected: {first_line(self._m.get_error())}")
        self._allowed = self._forced = None

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (jump-forward), not yet consumed; [] if none."""
        if self._forced is None:
            self._forced = [] if self.finished else list(self._m.compute_ff_tokens())
        return list(self._forced)

    @property
    def finished(self) -> bool:
        """The grammar is complete: generation must stop."""
        return self._m.is_stopped()

    def _allows(self, t: int) -> bool:
        """Checked before consuming (a rejected token would leave llguidance's matcher in an
        error state for good): the mask when it is at hand; else validate_tokens, except for
        EOS ids, which it accepts only where the grammar could end, not as the grammar's own
        end token (``<|return|>``, ``<|im_end|>``)."""
        if self._allowed is None and t not in self._eos:
            return self._m.validate_tokens([t]) == 1
        return bool(self.allowed()[t])

    def _fill(self) -> None:
        if self._allowed is not None:
            return
        llnp.fill_next_token_bitmask(self._m, self._bits)
        if self._m.is_error():
            raise ValueError(f"grammar engine failed: {first_line(self._m.get_error())}")
        bits = np.unpackbits(self._bits.view(np.uint8), count=self._width, bitorder="little")
        self._allowed = bits.view(np.bool_)
        self._allowed.flags.writeable = False
        self._bits.flags.writeable = False


# --------------------------------------------------------------------------- helpers


def first_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[0] if lines else "unknown error"


def meta_check(schema: Any) -> None:
    """GrammarError unless ``schema`` is a JSON schema object valid against its meta-schema."""
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, not {type(schema).__name__}")
    try:
        text = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"a JSON schema must be JSON: {one_line(e)}") from None
    meta_check_text(text)


@functools.lru_cache(maxsize=1024)
def meta_check_text(text: str) -> None:
    """:func:`meta_check` of a schema's JSON text, cached: jsonschema's check takes about a
    millisecond per schema and requests repeat their tools."""
    schema = json.loads(text)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise GrammarError(f"invalid JSON schema at {where}: {one_line(e.message)}") from None


def check_budget(budget: int) -> int:
    if int(budget) < 0:
        raise ValueError(f"reasoning budget must be >= 0, got {budget}")
    return int(budget)


def select_tools(tools: list[dict], names: list[str] | None) -> list[Tool]:
    """The declared function tools ``names`` picks (all when None), schemas checked."""
    declared: dict[str, Tool] = {}
    for t in tools or []:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not fn:
            raise GrammarError("each tool must be {'type': 'function', 'function': {...}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise GrammarError("a function tool needs a name")
        params = fn.get("parameters")
        params = grammars.ANY_OBJECT if params is None else params
        meta_check(params)
        declared.setdefault(name, Tool(name, params))
    if not declared:
        raise GrammarError("no function tools declared")
    if names is None:
        return list(declared.values())
    missing = [n for n in names if n not in declared]
    if missing:
        raise GrammarError(f"tool_choice names undeclared function(s): {', '.join(missing)}")
    if not names:
        raise GrammarError("tool_choice names no function")
    return [declared[n] for n in dict.fromkeys(names)]


def reserved_as_special(tok: Tokenizer) -> Tokenizer:
    """``tok``, or a copy where reserved vocabulary entries (``<|reserved_N|>`` spelled as
    plain text, as in the tiny byte vocabularies) are special tokens, which llguidance
    allows only where a grammar names them."""
    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    reserved = [
        s for s in tok.get_vocab(with_added_tokens=False) if RESERVED.fullmatch(s)
        and s not in added
    ]
    if not reserved:
        return tok
    copy = Tokenizer.from_str(tok.to_str())
    copy.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in reserved])
    return copy
