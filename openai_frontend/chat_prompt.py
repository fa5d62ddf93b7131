"""A chat request's prompt: its messages and tools as the model's template renders them, the same for
/v1/chat/completions and /tokenize with messages (whose purpose is to show what chat sends)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from openai_frontend.chat_template import render_chat, template_reads_tools
from openai_frontend.engine_client import ModelInfo
from openai_frontend.schemas import ChatMessage
from openai_frontend.tool_calls import ToolPlan, template_messages, template_tools

# What one message or tool costs the template beside its text, counted in characters of text.
_ITEM_CHARS = 64


@dataclass(frozen=True, slots=True)
class ChatInput:
    """What a chat request gives the template."""

    messages: Sequence[ChatMessage]
    tools: ToolPlan
    add_generation_prompt: bool
    continue_final_message: bool
    template_kwargs: dict[str, Any] | None

    def work_chars(self) -> int:
        """About how much text rendering and tokenizing this chat handles (tokenizers.Tokenizers.run)."""
        return sum(len(m.text()) + _ITEM_CHARS for m in self.messages) + _ITEM_CHARS * len(self.tools.tools)


def rendered_text(model: ModelInfo, chat: ChatInput) -> str:
    """The prompt text of `chat` (tools in the template's `tools` where it reads them, else in a system prompt)."""
    knows_tools = bool(model.chat_template) and template_reads_tools(model.name, model.chat_template)
    return render_chat(
        model,
        template_messages(list(chat.messages), chat.tools, knows_tools),
        template_tools(chat.tools) if knows_tools else None,
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_final_message,
        template_kwargs=chat.template_kwargs,
    )
