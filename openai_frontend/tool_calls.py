"""Tool calling for chat: the tools in the prompt, the forced-call schema, and the calls in the output.

Prompt. A chat template that knows tools (it reads `tools`) gets them as Hugging Face templates
expect. One that does not, such as SmolLM2's, gets the rendering SmolLM2 was trained with: a system
prompt that lists the tools inside <tools>...</tools> and asks for
`<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`; earlier assistant calls are written
back in that form and tool results go in as user turns inside <tool_response>...</tool_response>.

Output, per tool_choice (vLLM's behaviour):
- "none": tools are not shown and nothing is parsed.
- "auto": text before a `<tool_call>` streams as content; what follows is held and, at the end,
  parsed into calls (finish_reason "tool_calls"), or released as content if it is not a valid call.
- "required": the engine enforces a JSON array of 1+ calls (of one call when parallel_tool_calls
  is false), each `{"name": <a tool>, "arguments": <that tool's parameters>}`; finish_reason "tool_calls".
- a named function: the engine enforces that function's parameters schema; the whole output is
  its arguments, streamed as argument fragments; finish_reason "stop" (as OpenAI does).

`ToolCallStream` turns one choice's text deltas into chat deltas. The non-streamed response is the
merge of the same deltas, so the streamed calls join to exactly the non-streamed ones.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from openai_frontend.schemas import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool
from tokenization.stop_strings import partial_prefix_length

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

TOOLS_SYSTEM_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the functions can be used, point it out and refuse to answer.\n"
    "If the given question lacks the parameters required by the function, also point it out.\n\n"
    "You have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct. If no function call "
    "is needed, please make the tool calls an empty list '[]'.\n"
    "<tool_call>[\n"
    '{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},\n'
    "... (more tool calls as required)\n"
    "]</tool_call>"
)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one chat request uses tools."""

    mode: str  # "none", "auto", "required" or "named"
    tools: tuple[Tool, ...] = ()
    named: str | None = None  # the forced function's name (mode "named")
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.mode != "none"


def tool_plan(req: ChatCompletionRequest) -> ToolPlan:
    """The request's tool mode; raises LookupError for a tool_choice that names no tool or has no tools."""
    tools = tuple(req.tools or ())
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        names = {t.function.name for t in tools}
        if choice.function.name not in names:
            raise LookupError(f"tool_choice names function `{choice.function.name}`, which is not in tools")
        return ToolPlan("named", tools, choice.function.name, parallel)
    if choice != "none" and not tools:
        raise LookupError(f'tool_choice "{choice}" needs tools')
    return ToolPlan(choice if tools else "none", tools, None, parallel)


def forced_call_schema(plan: ToolPlan) -> dict[str, Any] | None:
    """The JSON schema the output must follow for "required" or a named function; None otherwise."""
    if plan.mode == "named":
        tool = next(t for t in plan.tools if t.function.name == plan.named)
        return _parameters(tool)
    if plan.mode != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t.function.name]}, "arguments": _parameters(t)},
            "required": ["name", "arguments"],
        }
        for t in plan.tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }
    if not plan.parallel:
        schema["maxItems"] = 1
    return schema


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object", "properties": {}}


# -- the prompt -------------------------------------------------------------------------------------


def template_messages(messages: list[ChatMessage], plan: ToolPlan, template_knows_tools: bool) -> list[dict[str, Any]]:
    """The messages as the chat template sees them (developer -> system; tool turns rendered)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": m.text()}
        if m.name:
            msg["name"] = m.name
        if template_knows_tools:
            if m.tool_calls:
                msg["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": _arguments_value(c.function.arguments)},
                    }
                    for c in m.tool_calls
                ]
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
        elif m.tool_calls:
            calls = ",\n".join(
                json.dumps(
                    {"name": c.function.name, "arguments": _arguments_value(c.function.arguments)}, ensure_ascii=False
                )
                for c in m.tool_calls
            )
            msg["content"] = (msg["content"] + "\n" if msg["content"] else "") + f"{CALL_OPEN}[\n{calls}\n]{CALL_CLOSE}"
        elif role == "tool":
            msg = {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
        out.append(msg)
    if plan.active and not template_knows_tools:
        tools = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in plan.tools)
        prompt = TOOLS_SYSTEM_PROMPT.format(tools=tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def template_tools(plan: ToolPlan) -> list[dict[str, Any]] | None:
    """`tools` for a template that reads them (OpenAI's shape, as Hugging Face templates expect)."""
    return [t.model_dump(exclude_none=True) for t in plan.tools] if plan.active else None


def _arguments_value(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


# -- the output -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


def parse_call_list(text: str) -> list[ParsedCall] | None:
    """`[{"name": ..., "arguments": {...}}, ...]` (or one such object) -> calls; None if it is not that."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        calls.append(ParsedCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


def parse_tagged_calls(text: str) -> list[ParsedCall] | None:
    """Every `<tool_call>...</tool_call>` block of text (the last may lack its closing tag); None
    unless every block parses."""
    calls: list[ParsedCall] = []
    rest = text
    while (start := rest.find(CALL_OPEN)) >= 0:
        rest = rest[start + len(CALL_OPEN) :]
        end = rest.find(CALL_CLOSE)
        block, rest = (rest, "") if end < 0 else (rest[:end], rest[end + len(CALL_CLOSE) :])
        parsed = parse_call_list(block.strip())
        if parsed is None:
            return None
        calls.extend(parsed)
    return calls or None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCallStream:
    """One choice's text -> chat deltas: `feed` per engine step, `finish` once at the end.

    Each returns a list of deltas (dicts for `choices[i].delta`); the caller sends them in order.
    """

    plan: ToolPlan
    _text: str = ""
    _released: int = 0  # characters of _text already sent as content
    _started_named: bool = False
    called: bool = field(default=False, init=False)  # some call was sent

    def feed(self, text_delta: str) -> list[dict[str, Any]]:
        if self.plan.mode == "named":
            deltas = []
            if not self._started_named:
                self._started_named, self.called = True, True
                deltas.append(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": new_call_id(),
                                "type": "function",
                                "function": {"name": self.plan.named, "arguments": ""},
                            }
                        ]
                    }
                )
            if text_delta:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text_delta}}]})
            return deltas
        self._text += text_delta
        if self.plan.mode != "auto":  # "required": all held until the end
            return []
        start = self._text.find(CALL_OPEN)
        # Release what cannot be part of a call: up to the tag, or up to a possible start of one.
        limit = start if start >= 0 else len(self._text) - partial_prefix_length(self._text, (CALL_OPEN,))
        return self._release(limit)

    def finish(self) -> list[dict[str, Any]]:
        if self.plan.mode == "named":
            return self.feed("") if not self._started_named else []
        held = self._text[self._released :]
        calls = parse_call_list(held) if self.plan.mode == "required" else parse_tagged_calls(held)
        if not calls:
            return self._release(len(self._text))
        if self.plan.mode == "auto" and not self.plan.parallel:
            calls = calls[:1]
        self._released = len(self._text)
        self.called = True
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(calls):
            deltas.append(
                {
                    "tool_calls": [
                        {
                            "index": i,
                            "id": new_call_id(),
                            "type": "function",
                            "function": {"name": call.name, "arguments": ""},
                        }
                    ]
                }
            )
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
        return deltas

    def _release(self, limit: int) -> list[dict[str, Any]]:
        if limit <= self._released:
            return []
        text, self._released = self._text[self._released : limit], limit
        return [{"content": text}]
