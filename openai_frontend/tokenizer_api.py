"""vLLM's tokenizer endpoints: POST /tokenize (a prompt, or chat messages through the template),
POST /detokenize and GET /tokenizer_info (what lm-eval's remote tokenizer reads).

Their shapes are vLLM's. `model` may be left out when the server serves one model.
"""

from __future__ import annotations

from typing import Any

from openai_frontend.chat_template import render_chat, template_reads_tools
from openai_frontend.engine_client import EngineClient, ModelInfo
from openai_frontend.errors import InvalidRequest
from openai_frontend.schemas import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from openai_frontend.tokenizers import Tokenizers
from openai_frontend.tool_calls import ToolPlan, template_messages, template_tools
from tokenization.tokenizer import Tokenizer


class TokenizerAPI:
    def __init__(self, engine: EngineClient, tokenizers: Tokenizers) -> None:
        self.engine, self.tokenizers = engine, tokenizers

    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
        model, tokenizer = await self._model(req.model)
        if isinstance(req, TokenizeChatRequest):
            plan = ToolPlan("auto", tuple(req.tools)) if req.tools else ToolPlan("none")
            knows_tools = bool(model.chat_template) and template_reads_tools(model.name, model.chat_template)
            text = render_chat(
                model,
                template_messages(req.messages, plan, knows_tools),
                template_tools(plan) if knows_tools else None,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                template_kwargs=req.chat_template_kwargs,
            )
        else:
            text = req.prompt
        tokens = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        return {
            "count": len(tokens),
            "max_model_len": model.max_model_len,
            "tokens": tokens,
            "token_strs": [tokenizer.token_text(t) for t in tokens] if req.return_token_strs else None,
        }

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        _, tokenizer = await self._model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"token id {bad} is outside the vocabulary (size {tokenizer.vocab_size}: "
                f"ids 0..{tokenizer.vocab_size - 1})",
                "tokens",
            )
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}

    async def tokenizer_info(self, model_name: str | None) -> dict[str, Any]:
        model, tokenizer = await self._model(model_name)
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model": model.name,
            "eos_token": tokenizer.eos_token,
            "eos_token_id": tokenizer.eos_token_ids[0],
            "bos_token": tokenizer.bos_token or None,
            "bos_token_id": tokenizer.bos_token_id,
            "pad_token": None,
            "add_bos_token": tokenizer.add_bos_token,
            "vocab_size": tokenizer.vocab_size,
            "model_max_length": model.max_model_len,
            # The template this server renders chats with (the model's Triton parameter), else the tokenizer's.
            "chat_template": model.chat_template or tokenizer.chat_template,
        }

    async def _model(self, name: str | None) -> tuple[ModelInfo, Tokenizer]:
        if name is None:
            models = await self.engine.list_models()
            if len(models) != 1:
                raise InvalidRequest(f"model is required: this server serves {len(models)} models", "model")
            model = models[0]
        else:
            model = await self.engine.model_config(name)  # ModelNotFound -> 404
        return model, await self.tokenizers.get(model)
