"""Output constraints of a request: OpenAI's response_format, vLLM's structured_outputs and guided_*
fields, and the schema that tool_choice "required" or a named function imposes, all turned into the
one engine-side `StructuredOutputs` (enforced token by token in backend/structured_output.py).

A request may carry at most one of them (vLLM's rule). `param` remembers the field the user wrote,
so an error the engine raises about the grammar names that field, not the wire's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openai_frontend.errors import InvalidRequest
from openai_frontend.schemas import SamplingFields
from protocol import STRUCTURED_OUTPUT_KINDS, InvalidRequestError, StructuredOutputs

WIRE_PARAM = "structured_outputs"  # the engine's errors name structured_outputs.<kind>


@dataclass(frozen=True, slots=True)
class Constraint:
    spec: StructuredOutputs
    param: str  # the request field it came from, e.g. "response_format.json_schema.schema"

    def rename(self, error: InvalidRequest) -> InvalidRequest:
        """An engine error about the constraint, re-labelled with the user's field."""
        if error.param and error.param.startswith(WIRE_PARAM):
            return InvalidRequest(error.message, self.param, error.code)
        return error


def request_constraint(req: SamplingFields) -> Constraint | None:
    """The constraint the request's own fields ask for (response_format / structured_outputs / guided_*)."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        assert rf.json_schema is not None  # the schema checks it
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}  # OpenAI: no schema = any
        found.append(("response_format.json_schema.schema", {"json": schema}))
    if req.structured_outputs is not None:
        so = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if so.get(k) not in (None, False)]
        found.append((f"structured_outputs.{kinds[0]}" if len(kinds) == 1 else "structured_outputs", so))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            found.append((f"guided_{kind}", {kind: value}))
    if not found:
        return None
    if len(found) > 1:
        raise InvalidRequest(
            "only one kind of structured output constraint may be given, not "
            + " and ".join(param for param, _ in found),
            found[1][0],
        )
    param, spec = found[0]
    return Constraint(_spec(spec, param), param)


def tool_call_constraint(spec_schema: dict[str, Any], param: str) -> Constraint:
    """The JSON schema a forced tool call must follow (tool_choice "required" or a named function)."""
    return Constraint(_spec({"json": spec_schema}, param), param)


def _spec(data: dict[str, Any], param: str) -> StructuredOutputs:
    try:
        return StructuredOutputs.from_dict(data)
    except InvalidRequestError as e:
        raise InvalidRequest(e.message, param) from None
