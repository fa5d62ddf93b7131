"""The service layer the routers call: the completions, chat, Responses and embeddings services, over one engine
client, settings, metrics and tokenizers. Each turns a request into typed chunks or one typed response
(responses.py); SSE framing and JSON encoding are the routers'."""

from __future__ import annotations

from openai_frontend.chat_service import ChatService
from openai_frontend.completion_service import CompletionService
from openai_frontend.embeddings import EmbeddingService
from openai_frontend.engine_client import EngineClient
from openai_frontend.metrics import Metrics
from openai_frontend.responses_api.service import ResponsesService
from openai_frontend.settings import Settings
from openai_frontend.tokenizers import Tokenizers


class Service:
    def __init__(self, engine: EngineClient, settings: Settings, metrics: Metrics) -> None:
        self.tokenizers = Tokenizers(
            settings.tokenizer,
            settings.prompt_threads,
            special_tokens_in_content=settings.allow_special_tokens_in_content,
        )
        self.completions = CompletionService(engine, settings, metrics, self.tokenizers)
        self.chat = ChatService(engine, settings, metrics, self.tokenizers)
        self.responses = ResponsesService(engine, settings, metrics, self.chat)
        self.embeddings = EmbeddingService(engine, settings, metrics)
