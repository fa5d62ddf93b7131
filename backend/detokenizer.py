"""Incremental detokenizer: the text each new token adds, never half a character.

One per sequence. `add_token(id)` returns the text that token adds to the output; the deltas of all
tokens plus `flush()` join to exactly `tokenizer.decode(all_ids, skip_special_tokens=...)`.

Why not decode each token alone: a byte-level BPE token can be a fragment of a UTF-8 character (an
emoji or a CJK character is often split over two or three tokens), and SentencePiece-style
decoders drop the leading space of the first token of every decode call. So, as in vLLM, the
detokenizer decodes a short window of ids twice:

    ids:  ... | prefix_offset ... read_offset | new ids ...
    prefix_text = decode(ids[prefix_offset:read_offset])   already emitted: context only
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]

The prefix window gives the new ids their left context (spacing), and the delta is held back
while `new_text` ends with U+FFFD, the replacement character of an incomplete UTF-8 sequence; it
goes out with the token that completes the character. After each emission the window slides: the
ids just emitted become the next prefix. The join equals the full decode whenever the decoder's
output splits at those boundaries, which holds for byte-level BPE (GPT-2, Llama-3, SmolLM2, Qwen)
and for Metaspace/SentencePiece text. (A SentencePiece byte-fallback run of invalid bytes is the
known exception: the decoder replaces the whole run, so text already emitted cannot match.)

A special token with skip_special_tokens decodes to "" and is not even put in the window: decode
drops such tokens before joining the rest, so leaving it out changes nothing, and the window does
not grow while a model emits special tokens.

`tokenizer` needs only `decode(ids, skip_special_tokens=...) -> str` and
`special_token_ids: frozenset[int]` (tokenization.tokenizer.Tokenizer has both).
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"  # what decode yields for the bytes of an unfinished UTF-8 character


class DecodingTokenizer(Protocol):
    special_token_ids: frozenset[int]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: DecodingTokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []  # every id that can contribute text
        self._prefix_offset = 0  # ids[prefix_offset:read_offset]: emitted, decoded again as context
        self._read_offset = 0  # ids[read_offset:]: not emitted yet
        self._text = ""
        self._skipped: dict[int, bool] = {}  # special id -> whether decode drops it (checked once)

    @property
    def text(self) -> str:
        """Everything emitted so far (the join of the returned deltas)."""
        return self._text

    def add_token(self, token_id: int) -> str:
        """The text `token_id` adds: "" while it ends in an incomplete character or is a skipped special token."""
        if self._is_skipped(token_id):
            return ""
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held (an unfinished character decodes to U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)):
            return ""  # nothing yet, or the last character is still incomplete: wait for more ids
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _is_skipped(self, token_id: int) -> bool:
        """A special token that decode drops. Checked with decode itself, so a tokenizer whose
        special_token_ids lists an id that decode keeps still gets that id's text right."""
        if not self._skip_special_tokens or token_id not in self._tokenizer.special_token_ids:
            return False
        skipped = self._skipped.get(token_id)
        if skipped is None:
            skipped = self._skipped[token_id] = self._decode([token_id]) == ""
        return skipped
