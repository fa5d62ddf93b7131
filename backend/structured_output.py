"""Structured outputs: grammars compiled with xgrammar, one matcher per sequence, a token bitmask per step.

What happens to a constrained request:
1. When the request is made, the spec is checked against size limits (backend/grammar_limits.py) and
   parsed into an xgrammar `Grammar` (`build_grammar`); a bad one is an InvalidRequestError naming the
   field, before any token is generated.
2. Compiling (the grammar against our vocabulary: which tokens each grammar state allows) runs on a
   thread of its own within a time and memory budget, cached by the spec
   (backend/grammar_compiler.py); the engine keeps a request whose grammar is not ready out of the
   scheduler, and refuses it if its grammar is refused.
3. Each sequence gets its own `GrammarMatcher` (n > 1 siblings each have one). Every step the
   runner fills one bitmask row per constrained row (`TokenBitmask`), the sampler masks the processed
   logits with it (logprobs stay the raw model's), and the output processor advances the matcher with
   the sampled token. EOS is allowed only where the grammar may end; a matcher that has ended
   (`is_terminated`) finishes its sequence with "stop".

The matcher follows the sequence's own output tokens, which preemption by recompute keeps. Only the
rows of drafted tokens (speculative decoding) move it ahead, to fill their masks, and roll it back. The
vocabulary is the model's (its size may exceed the tokenizer's: the extra ids are never allowed).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from protocol import InvalidRequestError, StructuredOutputs

if TYPE_CHECKING:
    import xgrammar

# Whitespace between JSON tokens, when free whitespace is allowed: more than this in one place is
# never useful output, and without a bound a small model can loop on newlines until max_tokens.
MAX_JSON_WHITESPACE = 16
_XGRAMMAR_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _xgr() -> Any:
    # Imported on first use: the import is slow, and most engines (tests, benchmarks) never need it.
    import xgrammar

    return xgrammar


def build_grammar(spec: StructuredOutputs) -> xgrammar.Grammar:
    """The spec as an xgrammar Grammar; InvalidRequestError (param `structured_outputs.<kind>`) if invalid."""
    xgr = _xgr()
    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            # json_object is any JSON object, as in OpenAI's API and vLLM's xgrammar backend.
            schema = spec.json if kind == "json" else '{"type": "object"}'
            return xgr.Grammar.from_json_schema(
                schema,
                any_whitespace=not spec.disable_any_whitespace,
                max_whitespace_cnt=None if spec.disable_any_whitespace else MAX_JSON_WHITESPACE,
                strict_mode=True,
            )
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            # vLLM's meaning: the output is exactly one of the strings (an alternation of literals).
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_literal(c) for c in spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}.get(kind, kind)
        raise InvalidRequestError(f"invalid {what}: {_xgrammar_message(e)}", f"structured_outputs.{kind}") from None


def _ebnf_literal(text: str) -> str:
    # JSON string escapes (\", \\, \n, \uXXXX) are what xgrammar's EBNF string literals accept.
    return json.dumps(text, ensure_ascii=True) if text else '""'


def _xgrammar_message(error: Exception) -> str:
    """xgrammar's message without its C++ source location and timestamp."""
    text = str(error).strip()
    return _XGRAMMAR_LOCATION.sub("", text).strip() or type(error).__name__


class GrammarState:
    """One sequence's position in its grammar (wraps an xgrammar GrammarMatcher)."""

    __slots__ = ("_matcher",)

    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        self._matcher = _xgr().GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (nothing changes then)."""
        return self._matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended (its stop token was accepted): nothing may follow."""
        return self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, ahead: tuple[int, ...] = ()) -> None:
        """The tokens allowed next, or after the drafted tokens `ahead` (the matcher is rolled back after).
        Where the grammar refuses a drafted token, the row gets what it allows there: the row is never
        kept, as the token sampled in that token's place differs from it."""
        accepted = 0
        for token_id in ahead:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token_id):
                break
            accepted += 1
        if not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(bitmask, row)
        if accepted:
            self._matcher.rollback(accepted)


@dataclass(frozen=True, slots=True)
class TokenBitmask:
    """The allowed tokens of a step's constrained rows: bit t of row r set = token t allowed.

    bitmask: (S, ceil(V / 32)) int32 over all S sampled rows; only `rows` are read.
    """

    bitmask: torch.Tensor
    rows: tuple[int, ...]

    @classmethod
    def for_rows(
        cls, states: list[tuple[GrammarState | None, tuple[int, ...]]], vocab_size: int
    ) -> TokenBitmask | None:
        """One row per sampled row: its sequence's grammar state (None: unconstrained) and the drafted
        tokens the row comes after; None when no row is constrained."""
        rows = tuple(i for i, (s, _) in enumerate(states) if s is not None)
        if not rows:
            return None
        bitmask = _xgr().allocate_token_bitmask(len(states), vocab_size)  # (S, ceil(V / 32)) int32, all allowed
        for i in rows:
            state, ahead = states[i]
            state.fill_bitmask(bitmask, i, ahead)  # type: ignore[union-attr]
        return cls(bitmask, rows)

    def apply(self, logits: torch.Tensor, rows: list[int] | None = None) -> None:
        """logits (S, V) fp32, in place: disallowed tokens of the constrained rows (or of `rows`) become -inf."""
        _xgr().apply_token_bitmask_inplace(logits, self.bitmask, indices=list(self.rows) if rows is None else rows)

    def allowed(self, row: int, vocab_size: int) -> torch.Tensor:
        """(V,) bool: the tokens row `row` allows (tests and diagnostics)."""
        words = self.bitmask[row].to(torch.int64) & 0xFFFFFFFF  # (ceil(V / 32),)
        bits = (words[:, None] >> torch.arange(32)) & 1  # (ceil(V / 32), 32)
        return bits.flatten()[:vocab_size].bool()
