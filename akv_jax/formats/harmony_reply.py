"""GPT-OSS (harmony) replies, parsed by openai-harmony's own streaming parser.

The prompt ends with ``<|start|>assistant``, so a reply is a run of messages such as
``<|channel|>analysis<|message|>...<|end|>``, ``<|start|>assistant<|channel|>final
<|message|>...<|return|>`` or a call ``<|start|>assistant to=functions.NAME<|channel|>
commentary <|constrain|>json<|message|>{...}<|call|>``. The analysis channel is reasoning; a
message to ``functions.NAME`` (on any channel) is a call, its arguments streamed as they
arrive; everything else (final, commentary preambles) is content.

Ids of other vocabularies are mapped onto o200k_harmony's (the parser knows no other):
``tiny-gpt-oss``'s byte vocabulary maps each byte to o200k's one-byte token and each special
to o200k's special of that name. Output the parser refuses (a random model's tokens) is not
an error: from the refused token on, the reply is the tokens' decoded text, as content.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from openai_harmony import Role, StreamableParser, StreamState

from akv_jax.formats.reply import Reply, ReplyDelta, ReplyLog, ReplyParser, ToolCallDelta
from akv_jax.formats.text_scan import TokenText
from akv_jax.model.byte_bpe import bytes_to_unicode
from akv_jax.model.harmony_template import HARMONY_SPECIALS
from akv_jax.model.vocabularies import harmony_encoding, o200k_harmony

FUNCTIONS = "functions."
# A header left open at the end is dropped (it is markup of a message cut off) unless it is
# longer than any real header, which means the model never wrote one: then it is content.
MAX_HEADER_TOKENS = 64

_maps: weakref.WeakKeyDictionary[Any, dict[int, int] | None] = weakref.WeakKeyDictionary()


def o200k_id_map(tokenizer: Any) -> dict[int, int] | None:
    """The tokenizer's id -> o200k_harmony id, or None when its ids already are o200k's.

    Built from the vocabulary's strings (byte-level tokens spelled in GPT-2's byte
    alphabet; harmony specials by name), once per tokenizer. Ids with no o200k equal
    (the byte vocabulary's reserved ids) are left out.
    """
    if tokenizer in _maps:
        return _maps[tokenizer]
    ranks, specials = o200k_harmony()
    mapping: dict[int, int] | None = None
    if tokenizer.vocab_size < len(ranks) or any(
        tokenizer.token_to_id(s) != specials[s] for s in HARMONY_SPECIALS
    ):
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        mapping = {}
        for text, tid in tokenizer.tokenizer.get_vocab(with_added_tokens=True).items():
            if text in specials:
                mapping[tid] = specials[text]
            elif all(c in byte_of for c in text):
                rank = ranks.get(bytes(byte_of[c] for c in text))
                if rank is not None:
                    mapping[tid] = rank
    _maps[tokenizer] = mapping
    return mapping


class HarmonyReplyParser(ReplyParser):
    def __init__(self, tokenizer: Any, *, call_id: Callable[[], str]):
        self.tok = tokenizer
        self.call_id = call_id
        self.to_o200k = o200k_id_map(tokenizer)
        self.parser = StreamableParser(harmony_encoding(), role=Role.ASSISTANT)
        _, specials = o200k_harmony()
        self.specials = set(specials.values())
        self.header_starts = {specials["<|start|>"], specials["<|channel|>"]}
        # EOS ids other than <|return|> / <|call|> (<|endoftext|>) end the generation but
        # are no part of a message: the parser is not shown them.
        message_ends = {specials["<|return|>"], specials["<|call|>"]}
        self.skipped = {i for i in tokenizer.eos_ids if self.o200k(i) not in message_ends}
        self.header: list[int] = []  # ids of the header being read (the tokenizer's ids)
        self.kind: str | None = None  # in a message body: "reasoning", "content" or "call"
        self.n_calls = 0
        self.fallback: TokenText | None = None  # set once the parser refused a token
        self.log = ReplyLog()
        self.finished = False

    def o200k(self, token_id: int) -> int | None:
        return token_id if self.to_o200k is None else self.to_o200k.get(token_id)

    def push(self, token_id: int) -> ReplyDelta:
        if self.finished or token_id in self.skipped:
            return ReplyDelta()
        if self.fallback is not None:
            return self.log.add(ReplyDelta(content=self.fallback.push(token_id)))
        h = self.o200k(token_id)
        try:
            if h is None:
                raise ValueError(f"id {token_id} has no o200k_harmony equal")
            self.parser.process(h)
        except Exception:  # whatever the (Rust) parser raises on tokens it refuses
            return self.log.add(self.give_up(token_id))
        return self.log.add(self.after(token_id, h))

    def after(self, token_id: int, h: int) -> ReplyDelta:
        p = self.parser
        # Only special tokens move the parser between header and body, so its ``state`` is
        # read just then: reading it serialises the message so far (quadratic if per token).
        in_body = p.state == StreamState.CONTENT if h in self.specials else self.kind is not None
        if not in_body:
            if self.kind is None:
                self.header.append(token_id)
            self.kind = None  # (else this token ended the message)
            return ReplyDelta()
        out = ReplyDelta()
        if self.kind is None:  # <|message|> ended a header
            self.header = []
            recipient = p.current_recipient or ""
            if recipient.startswith(FUNCTIONS) and len(recipient) > len(FUNCTIONS):
                self.kind = "call"
                name = recipient[len(FUNCTIONS) :]
                out.tool_calls.append(ToolCallDelta(self.n_calls, self.call_id(), name, ""))
                self.n_calls += 1
            else:
                self.kind = "reasoning" if p.current_channel == "analysis" else "content"
        text = p.last_content_delta or ""
        if not text:
            return out
        if self.kind == "call":
            if out.tool_calls:
                out.tool_calls[0].arguments = text
            else:
                out.tool_calls.append(ToolCallDelta(self.n_calls - 1, None, None, text))
        elif self.kind == "reasoning":
            out.reasoning = text
        else:
            out.content = text
        return out

    def give_up(self, token_id: int) -> ReplyDelta:
        """The parser refused ``token_id``: the open header's tokens and all from here on
        are decoded as content."""
        self.fallback = TokenText(self.tok, ())
        text = "".join(self.fallback.push(t) for t in [*self.header, token_id])
        self.header = []
        return ReplyDelta(content=text)

    def finish(self) -> ReplyDelta:
        if self.finished:
            return ReplyDelta()
        self.finished = True
        out = ReplyDelta()
        if self.fallback is not None:
            out.content = self.fallback.flush()
        elif self.header and not (
            self.o200k(self.header[0]) in self.header_starts
            and len(self.header) <= MAX_HEADER_TOKENS
        ):
            out.content = self.tok.decode(self.header, skip_special_tokens=True)
        self.header = []
        return self.log.add(out)

    def reply(self) -> Reply:
        return self.log.reply()
