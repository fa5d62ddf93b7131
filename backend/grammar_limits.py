"""Size limits on a structured-outputs constraint, checked before xgrammar parses it.

Why: xgrammar's parse of a JSON schema grows much faster than its nesting (a few hundred nested arrays
take seconds), and its compile grows with what a grammar holds: alternatives (enum values, choices,
optional properties), bounded repetitions (`{n,m}`, maxLength, maxItems: each a run of counted states)
and plain length. The time budget ends the wait for a compile (backend/grammar_compiler.py) but not the
compile, which cannot be interrupted and goes on holding a thread and memory. So these limits refuse at
once, in plain Python, what is never a real constraint, and keep the worst compile under them to
minutes of one thread and hundreds of MiB, not hours and gigabytes. Each refusal is an
InvalidRequestError naming the field and the limit.

The defaults sit above OpenAI's structured outputs (10 levels of schema nesting, 5000 properties, 1000
enum values) because this is an open server whose users bring schemas written for other engines too:
- depth counts the JSON document's nesting of objects and arrays, and one schema level is two of those
  (`{"properties": {"a": {...}}}`), so 64 is about 32 schema levels; xgrammar parses that in
  milliseconds;
- properties stay at OpenAI's 5000: optional properties cost the compile quadratically, so more would
  only ever end at the time budget;
- enum values and choices at 5000 each, with their text bounded too (long random strings compile
  slowly: the limits keep that to seconds);
- long repetitions (a bound over 16) and length/item bounds count in dozens in real constraints;
- text lengths far above any hand-written schema, regex or grammar, far below the request body limit.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NoReturn

from protocol import InvalidRequestError, StructuredOutputs

# A repetition quantifier of a regex or of xgrammar's EBNF: {n}, {n,} or {n,m}.
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_SHORT_REPETITION = 16  # bounds up to this compile to a handful of states: not counted
_SCHEMA_BOUNDS = ("minLength", "maxLength", "minItems", "maxItems")


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    max_schema_chars: int = 1 << 20  # the schema as compact JSON text
    max_schema_depth: int = 64  # nested JSON objects and arrays in the schema document
    max_schema_properties: int = 5000  # keys of every `properties` object, summed
    max_schema_bounds: int = 128  # minLength / maxLength / minItems / maxItems over 16, summed
    max_enum_values: int = 5000  # items of every `enum` list, summed
    max_enum_chars: int = 1 << 18  # their strings together
    max_choices: int = 5000
    max_choice_chars: int = 1 << 18  # all choices together
    max_regex_chars: int = 1 << 14
    max_grammar_chars: int = 1 << 16
    max_long_repetitions: int = 32  # quantifiers with a bound over 16 in a regex, grammar or schema patterns


DEFAULT_LIMITS = GrammarLimits()


def check_limits(spec: StructuredOutputs, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """Raise InvalidRequestError (param `structured_outputs.<kind>`) if spec passes one of the limits."""
    kind = spec.kind
    if kind == "json":
        _check_schema(spec.json or "", limits)
    elif kind in ("regex", "grammar"):
        text = spec.regex or spec.grammar or ""
        limit = limits.max_regex_chars if kind == "regex" else limits.max_grammar_chars
        _check_length(len(text), limit, f"the {kind}", kind)
        _check_count(long_repetitions(text), limits.max_long_repetitions, "repetitions with a bound over 16", kind)
    elif kind == "choice":
        choices = spec.choice or ()
        _check_count(len(choices), limits.max_choices, "choices", "choice")
        _check_length(sum(len(c) for c in choices), limits.max_choice_chars, "the choices together", "choice")


def long_repetitions(text: str) -> int:
    """How many repetition quantifiers in a regex or grammar have a bound over 16 (a quantifier-like
    text in a literal counts too: harmless at the limit)."""
    return sum(max(_bound(low), _bound(high)) > _SHORT_REPETITION for low, high in _QUANTIFIER.findall(text))


def _bound(digits: str) -> int:
    return int(digits) if 0 < len(digits) <= 6 else (0 if not digits else 10**6)


def _check_schema(text: str, limits: GrammarLimits) -> None:
    _check_length(len(text), limits.max_schema_chars, "the JSON schema", "json")
    too_deep = (
        f"the JSON schema nests JSON objects and arrays more than {limits.max_schema_depth} deep "
        "(each level of properties counts two)"
    )
    try:
        schema = json.loads(text)
    except RecursionError:  # nested far past any limit: the C parser's own recursion guard stops it
        _refuse(too_deep, "json")
    stats = schema_stats(schema, limits.max_schema_depth)
    if stats.depth > limits.max_schema_depth:
        _refuse(too_deep, "json")
    _check_count(stats.properties, limits.max_schema_properties, "properties", "json")
    _check_count(stats.bounds, limits.max_schema_bounds, "length or item bounds over 16", "json")
    _check_count(stats.enum_values, limits.max_enum_values, "enum values", "json")
    _check_length(stats.enum_chars, limits.max_enum_chars, "the enum strings together", "json")
    _check_count(
        stats.pattern_repetitions, limits.max_long_repetitions, "pattern repetitions with a bound over 16", "json"
    )


@dataclass(frozen=True, slots=True)
class SchemaStats:
    depth: int  # deepest nesting of objects and arrays, at most the limit + 1 (the walk stops there)
    properties: int
    bounds: int  # length and item bounds over 16
    enum_values: int
    enum_chars: int  # of the string enum values
    pattern_repetitions: int  # long repetitions in `pattern` strings


def schema_stats(schema: Any, max_depth: int) -> SchemaStats:
    """Walks the schema document with a stack (no recursion: the depth is what is being checked).
    Keywords are counted wherever they appear, which at worst counts a property that is itself named
    so: harmless at these limits."""
    depth = properties = bounds = enum_values = enum_chars = pattern_repetitions = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, level = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        depth = max(depth, level)
        if level > max_depth:
            break
        if isinstance(node, list):
            stack.extend((child, level + 1) for child in node)
            continue
        if isinstance(node.get("properties"), dict):
            properties += len(node["properties"])
        if isinstance(node.get("enum"), list):
            enum_values += len(node["enum"])
            enum_chars += sum(len(v) for v in node["enum"] if isinstance(v, str))
        if isinstance(node.get("pattern"), str):
            pattern_repetitions += long_repetitions(node["pattern"])
        bounds += sum(_is_long_bound(node.get(key)) for key in _SCHEMA_BOUNDS)
        stack.extend((child, level + 1) for child in node.values())
    return SchemaStats(depth, properties, bounds, enum_values, enum_chars, pattern_repetitions)


def _is_long_bound(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > _SHORT_REPETITION


def _check_length(length: int, limit: int, what: str, kind: str) -> None:
    if length > limit:
        _refuse(f"{what} is {length} characters; this server takes at most {limit}", kind)


def _check_count(count: int, limit: int, what: str, kind: str) -> None:
    if count > limit:
        _refuse(f"the constraint holds {count} {what}; this server takes at most {limit}", kind)


def _refuse(message: str, kind: str) -> NoReturn:
    raise InvalidRequestError(message, f"structured_outputs.{kind}")
