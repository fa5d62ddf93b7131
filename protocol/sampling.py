"""What a request asks for: SamplingParams and its StructuredOutputs constraint, validated on
construction so that bad values never reach the engine. No torch: both sides import it."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from protocol.errors import InvalidRequestError

MAX_LOGPROBS = 20
# Sizes a client chooses and the engine pays for at every step: OpenAI's bound where it has one (logit_bias),
# elsewhere one no real request nears. Past a bound the request is a 400 naming the field (docs/security.md).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300
MAX_ALLOWED_TOKEN_IDS = 16384
MAX_CACHE_SALT_CHARS = 256
MAX_TOKEN_ID = 2**31 - 1  # the wire carries ids as INT32
# Beam search keeps n beams and ranks 2n candidates of each at every step (vLLM's beam width is n, its
# candidates 2n logprobs, bounded by its max_logprobs of 20).
MAX_BEAM_WIDTH = 10
# What beam search cannot honour (it ranks beams by the model's raw logprobs and cuts them at EOS, stop token
# ids and the length bounds): a request that sets one of these with use_beam_search is a 400 naming it.
_NOT_WITH_BEAM_SEARCH = (
    ("stop", ()),
    ("prompt_logprobs", None),
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("repetition_penalty", 1.0),
    ("logit_bias", ()),
    ("allowed_token_ids", None),
    ("bad_words", ()),
    ("structured_outputs", None),
)


def _require(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param)


def _refuse_unknown(cls: type, data: dict[str, Any], what: str, param_prefix: str) -> None:
    """Wire objects name only fields of their dataclass: an unknown one is an error, not ignored."""
    unknown = sorted(set(data) - {f.name for f in fields(cls)})
    if unknown:
        raise InvalidRequestError(f"unknown {what}: {', '.join(unknown)}", param_prefix + unknown[0])


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """A constraint on what a sequence may generate (vLLM's `structured_outputs`): exactly one kind.

    - json: a JSON schema, held as JSON text (hashable, and its property order is kept: the output
      follows it); json_object: any JSON object;
    - regex: the whole output matches it; choice: the output is exactly one of the strings;
    - grammar: an EBNF grammar in xgrammar's dialect (GBNF-style `root ::= ...`).
    disable_any_whitespace: JSON without free whitespace between tokens (vLLM's flag).
    The engine enforces it (backend/structured_output.py); the syntax is checked when the request is made.
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        _require(
            len(set_kinds) == 1,
            "structured_outputs needs exactly one of json, regex, choice, grammar, "
            f"json_object (got {', '.join(set_kinds) or 'none'})",
            "structured_outputs",
        )
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            _require(
                value is None or (isinstance(value, str) and value != ""),
                f"{name} must be a non-empty string",
                f"structured_outputs.{name}",
            )
        _require(
            self.choice is None or (len(self.choice) > 0 and all(isinstance(c, str) for c in self.choice)),
            "choice must be a non-empty list of strings",
            "structured_outputs.choice",
        )
        _require(
            isinstance(self.json_object, bool) and isinstance(self.disable_any_whitespace, bool),
            "json_object and disable_any_whitespace must be booleans",
            "structured_outputs",
        )

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def from_dict(cls, data: Any) -> StructuredOutputs:
        """From the wire's JSON object; `json` may be a schema object or its JSON text."""
        if not isinstance(data, dict):
            raise InvalidRequestError("structured_outputs must be a JSON object", "structured_outputs")
        _refuse_unknown(cls, data, "structured_outputs field(s)", "structured_outputs.")
        kwargs = {k: v for k, v in data.items() if v is not None}
        if "json" in kwargs:
            kwargs["json"] = schema_text(kwargs["json"], "structured_outputs.json")
        if "choice" in kwargs:
            _require(
                isinstance(kwargs["choice"], (list, tuple)),
                "choice must be a list of strings",
                "structured_outputs.choice",
            )
            kwargs["choice"] = tuple(kwargs["choice"])
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {self.kind: getattr(self, self.kind)}
        if self.json is not None:
            out["json"] = json.loads(self.json)
        if self.choice is not None:
            out["choice"] = list(self.choice)
        if self.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        return out


def schema_text(schema: Any, param: str) -> str:
    """A JSON schema (object, or its JSON text) as compact JSON text, key order kept."""
    try:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", param) from None
            except RecursionError:
                raise InvalidRequestError("the JSON schema is nested too deeply", param) from None
        _require(isinstance(schema, (dict, bool)), "a JSON schema must be a JSON object", param)
        try:
            return json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except ValueError:  # Python's parser reads NaN and Infinity, which JSON (and the grammar compiler) does not
            raise InvalidRequestError("a JSON schema must not hold NaN or Infinity", param) from None
    except RecursionError:
        raise InvalidRequestError("the JSON schema nests too deeply", param) from None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings, validated on construction (bad values never reach the engine)."""

    n: int = 1
    max_tokens: int | None = 16  # None: up to the context window
    min_tokens: int = 0
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; 0: the sampled token only; k: plus top k
    prompt_logprobs: int | None = None  # None: off; k: each prompt token's logprob, plus the top k at its position
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # sorted (token_id, bias) pairs
    allowed_token_ids: tuple[int, ...] | None = None  # None: any token; else only these are sampled (vLLM's)
    bad_words: tuple[str, ...] = ()  # words never generated (vLLM's; backend/bad_words.py)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None  # a constraint the engine enforces on every token
    # vLLM's cache_salt: requests share cached prefix blocks only with requests of the same salt (None: unsalted).
    cache_salt: str | None = None
    # Beam search (vLLM's use_beam_search; backend/beam_search.py): n beams, the n best returned. A beam's
    # score is its cumulative logprob / (prompt + output tokens) ** length_penalty; early_stopping ends the
    # search once n beams have finished. Temperature, top_p, top_k, min_p and seed do not apply.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False

    def __post_init__(self) -> None:
        _require(isinstance(self.n, int) and 1 <= self.n <= 128, "n must be an integer in [1, 128]", "n")
        _require(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens must be an integer >= 1",
            "max_tokens",
        )
        _require(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens must be >= 0", "min_tokens")
        _require(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens must not exceed max_tokens",
            "min_tokens",
        )
        _require(
            _finite(self.temperature) and 0.0 <= self.temperature <= 100.0,
            "temperature must be in [0, 100]",
            "temperature",
        )
        _require(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p")
        _require(isinstance(self.top_k, int) and self.top_k >= -1, "top_k must be -1, 0 or a positive integer", "top_k")
        _require(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", "min_p")
        _require(
            self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63),
            "seed must be an integer in the signed 64-bit range",
            "seed",
        )
        _require(len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings", "stop")
        _require(
            all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
            f"a stop string holds at most {MAX_STOP_STRING_CHARS} characters",
            "stop",
        )
        _require(len(self.bad_words) <= MAX_BAD_WORDS, f"at most {MAX_BAD_WORDS} bad_words", "bad_words")
        _require(
            all(isinstance(w, str) and w.strip() for w in self.bad_words),
            "bad_words must be non-blank strings",
            "bad_words",
        )
        _require(
            all(len(w) <= MAX_BAD_WORD_CHARS for w in self.bad_words),
            f"a bad word holds at most {MAX_BAD_WORD_CHARS} characters",
            "bad_words",
        )
        _require(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids",
            "stop_token_ids",
        )
        _require_token_ids(self.stop_token_ids, "stop_token_ids")
        _require(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
            f"logprobs must be an integer in [0, {MAX_LOGPROBS}]",
            "logprobs",
        )
        _require(
            self.prompt_logprobs is None
            or (
                isinstance(self.prompt_logprobs, int)
                and not isinstance(self.prompt_logprobs, bool)
                and 0 <= self.prompt_logprobs <= MAX_LOGPROBS
            ),
            f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}]",
            "prompt_logprobs",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_finite(value) and -2.0 <= value <= 2.0, f"{name} must be in [-2, 2]", name)
        _require(
            _finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty must be in (0, 2]",
            "repetition_penalty",
        )
        _require(
            len(self.logit_bias) <= MAX_LOGIT_BIAS, f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens", "logit_bias"
        )
        _require_token_ids((t for t, _ in self.logit_bias), "logit_bias")
        _require(
            all(_finite(b) and -100 <= b <= 100 for _, b in self.logit_bias),
            "logit_bias maps token ids to values in [-100, 100]",
            "logit_bias",
        )
        _require(
            self.allowed_token_ids is None or len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS,
            f"allowed_token_ids holds at most {MAX_ALLOWED_TOKEN_IDS} token ids",
            "allowed_token_ids",
        )
        _require(
            self.allowed_token_ids is None
            or (isinstance(self.allowed_token_ids, tuple) and len(self.allowed_token_ids) > 0),
            "allowed_token_ids must be a non-empty list of token ids",
            "allowed_token_ids",
        )
        _require_token_ids(self.allowed_token_ids or (), "allowed_token_ids")
        _require(
            self.cache_salt is None
            or (isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS),
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
            "cache_salt",
        )
        _require(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
            "structured_outputs must be a StructuredOutputs",
            "structured_outputs",
        )
        _require(isinstance(self.use_beam_search, bool), "use_beam_search must be a boolean", "use_beam_search")
        _require(isinstance(self.early_stopping, bool), "early_stopping must be a boolean", "early_stopping")
        _require(
            _finite(self.length_penalty) and -10.0 <= self.length_penalty <= 10.0,
            "length_penalty must be in [-10, 10]",
            "length_penalty",
        )
        if self.use_beam_search:
            _require(
                self.n <= MAX_BEAM_WIDTH,
                f"use_beam_search keeps n beams: n must be at most {MAX_BEAM_WIDTH}",
                "n",
            )
            for name, default in _NOT_WITH_BEAM_SEARCH:
                _require(getattr(self, name) == default, f"{name} is not supported with use_beam_search", name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_top_logprobs(self) -> int | None:
        """How many most likely tokens the sampler reports for each sampled token (None: no logprobs):
        the k of `logprobs`, or for beam search its 2n candidates if more."""
        if self.use_beam_search:
            return max(2 * self.n, self.logprobs or 0)
        return self.logprobs

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from the JSON object of the wire contract; unknown fields are an error, not ignored."""
        if not isinstance(data, dict):
            raise InvalidRequestError("sampling_params must be a JSON object", "sampling_params")
        _refuse_unknown(cls, data, "sampling parameter(s)", "")
        kwargs = dict(data)
        if "stop" in kwargs:
            stop = kwargs["stop"]
            kwargs["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if "stop_token_ids" in kwargs:
            kwargs["stop_token_ids"] = tuple(kwargs["stop_token_ids"] or ())
        if isinstance(kwargs.get("bad_words"), list):
            kwargs["bad_words"] = tuple(kwargs["bad_words"])
        if isinstance(kwargs.get("allowed_token_ids"), list):
            kwargs["allowed_token_ids"] = tuple(kwargs["allowed_token_ids"])
        if "logit_bias" in kwargs:
            bias = kwargs["logit_bias"] or {}
            if not isinstance(bias, dict):
                raise InvalidRequestError("logit_bias must be an object", "logit_bias")
            try:
                kwargs["logit_bias"] = tuple(sorted((int(k), float(v)) for k, v in bias.items()))
            except (TypeError, ValueError):
                raise InvalidRequestError("logit_bias maps token ids to numbers", "logit_bias") from None
        if kwargs.get("structured_outputs") is not None:
            kwargs["structured_outputs"] = StructuredOutputs.from_dict(kwargs["structured_outputs"])
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "length_penalty",
        ):
            if isinstance(kwargs.get(name), int) and not isinstance(kwargs.get(name), bool):
                kwargs[name] = float(kwargs[name])
            elif name in kwargs and not isinstance(kwargs[name], float):
                raise InvalidRequestError(f"{name} must be a number", name)
        for name in ("n", "min_tokens", "top_k"):
            if name in kwargs and (isinstance(kwargs[name], bool) or not isinstance(kwargs[name], int)):
                raise InvalidRequestError(f"{name} must be an integer", name)
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> SamplingParams:
        try:
            data = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"sampling_params is not valid JSON: {e}", "sampling_params") from None
        except RecursionError:  # nested past the parser's stack: no real request is
            raise InvalidRequestError("sampling_params is nested too deeply", "sampling_params") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the wire contract (inverse of from_dict)."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["bad_words"] = list(self.bad_words)
        out["logit_bias"] = {str(t): b for t, b in self.logit_bias}
        if self.allowed_token_ids is None:
            del out["allowed_token_ids"]
        else:
            out["allowed_token_ids"] = list(self.allowed_token_ids)
        if self.cache_salt is None:
            del out["cache_salt"]
        if not self.use_beam_search:
            for name in ("use_beam_search", "length_penalty", "early_stopping"):
                del out[name]
        if self.structured_outputs is None:
            del out["structured_outputs"]
        else:
            out["structured_outputs"] = self.structured_outputs.to_dict()
        return out


def _require_token_ids(ids: Iterable[object], param: str) -> None:
    """Every id a token id the wire can carry (the engine checks them against its vocabulary)."""
    for t in ids:
        if not _token_id(t):
            raise InvalidRequestError(
                f"{param} holds {t!r}, which is not a token id (an integer in [0, {MAX_TOKEN_ID}])", param
            )


def _token_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_TOKEN_ID


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
