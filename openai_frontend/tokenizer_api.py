"""vLLM's tokenizer endpoints: POST /tokenize (a prompt, or chat messages through the template),
POST /detokenize and GET /tokenizer_info (what lm-eval's remote tokenizer reads).

Their shapes are vLLM's. `model` may be left out when the server serves one model.
"""

from __future__ import annotations

import json
from typing import Any

from openai_frontend.chat_prompt import ChatInput, Span, rendered_chat
from openai_frontend.engine_client import EngineClient, ModelInfo
from openai_frontend.errors import InvalidRequest
from openai_frontend.schemas import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from openai_frontend.tokenizers import Tokenizers
from openai_frontend.tool_calls import ToolPlan
from tokenization.tokenizer import Tokenizer


class TokenizerAPI:
    def __init__(self, engine: EngineClient, tokenizers: Tokenizers) -> None:
        self.engine, self.tokenizers = engine, tokenizers

    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> bytes:
        """The JSON body of /tokenize's answer (encoded with the tokenizing: a big prompt's ids take a while)."""
        model, tokenizer = await self._model(req.model)
        if isinstance(req, TokenizeChatRequest):
            plan = ToolPlan("auto", tuple(req.tools)) if req.tools else ToolPlan("none")
            chat = ChatInput(
                req.messages, plan, req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs
            )
            _, special_texts = await self.tokenizers.for_chat(model, needed=True)
            return await self.tokenizers.run(
                chat.work_chars(), _tokenized_chat, model, tokenizer, chat, special_texts, req
            )
        return await self.tokenizers.run(len(req.prompt), _tokenized, model, tokenizer, req.prompt, (), req)

    async def detokenize(self, req: DetokenizeRequest) -> bytes:
        """The JSON body of /detokenize's answer."""
        _, tokenizer = await self._model(req.model)
        return await self.tokenizers.run(len(req.tokens), _detokenized, tokenizer, req.tokens)

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
            served = {m.root or m.name for m in models}  # one model under several served names is one model
            if len(served) != 1:
                raise InvalidRequest(f"model is required: this server serves {len(served)} models", "model")
            model = models[0]
        else:
            model = await self.engine.model_config(name)  # ModelNotFound -> 404
        return model, await self.tokenizers.get(model)


def _tokenized_chat(
    model: ModelInfo, tokenizer: Tokenizer, chat: ChatInput, special_texts: frozenset[str], req: TokenizeChatRequest
) -> bytes:
    """What chat would send for the messages (chat_service._chat_prompt): the same rule for special tokens."""
    rendered = rendered_chat(model, chat, special_texts)
    return _tokenized(model, tokenizer, rendered.text, rendered.text_spans, req)


def _tokenized(
    model: ModelInfo,
    tokenizer: Tokenizer,
    text: str,
    text_spans: tuple[Span, ...],
    req: TokenizeCompletionRequest | TokenizeChatRequest,
) -> bytes:
    """/tokenize's answer for `text` (its spans' special-token texts read as text: chat_prompt.py)."""
    tokens = tokenizer.encode_with_text_spans(text, text_spans, add_special_tokens=req.add_special_tokens)
    strs = [tokenizer.token_text(t) for t in tokens] if req.return_token_strs else None
    head = _json({"count": len(tokens), "max_model_len": model.max_model_len})[:-1]
    return b"".join((head, b',"tokens":', _json_list(tokens), b',"token_strs":', _json_list(strs), b"}"))


def _detokenized(tokenizer: Tokenizer, tokens: list[int]) -> bytes:
    """/detokenize's answer for `tokens`."""
    bad = next((t for t in tokens if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"token id {bad} is outside the vocabulary (size {tokenizer.vocab_size}: "
            f"ids 0..{tokenizer.vocab_size - 1})",
            "tokens",
        )
    return _json({"prompt": tokenizer.decode(tokens, skip_special_tokens=False)})


# Items per piece of a long list's JSON: one encoder call holds the GIL throughout, a piece only briefly.
_JSON_PIECE_ITEMS = 16384


def _json_list(items: list[int] | list[str] | None) -> bytes:
    """`items` as JSON, encoded piece by piece so that the event loop's thread runs in between."""
    if items is None:
        return b"null"
    pieces = (_json(items[i : i + _JSON_PIECE_ITEMS])[1:-1] for i in range(0, len(items), _JSON_PIECE_ITEMS))
    return b"[" + b",".join(pieces) + b"]"


def _json(answer: Any) -> bytes:
    """A body as Starlette's JSONResponse encodes it."""
    return json.dumps(answer, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
