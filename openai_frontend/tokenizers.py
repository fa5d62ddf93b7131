"""The frontend's own copy of each model's tokenizer, for what needs token ids before or beside the
engine: /tokenize, /detokenize, /tokenizer_info, echo of token-id prompts and `return_token_ids`.

The engine tokenizes every prompt itself; the frontend loads the same tokenizer (tokenization.model_files,
no torch) from the source named by the model's Triton `model` parameter, or from `--tokenizer`.
Loaded once per source on first use, off the event loop.
"""

from __future__ import annotations

import asyncio

from openai_frontend.engine_client import ModelInfo
from openai_frontend.errors import FrontendError
from tokenization.model_files import load_tokenizer
from tokenization.tokenizer import Tokenizer


class TokenizerUnavailable(FrontendError):
    status_code = 501
    error_type = "server_error"


class Tokenizers:
    def __init__(self, override: str | None = None) -> None:
        self.override = override
        self._loaded: dict[str, asyncio.Task[Tokenizer]] = {}

    async def get(self, model: ModelInfo) -> Tokenizer:
        source = self.override or model.tokenizer_source
        if not source:
            raise TokenizerUnavailable(
                f"the frontend has no tokenizer for model `{model.name}`: start it with "
                "--tokenizer (the model's tokenizer source)"
            )
        task = self._loaded.get(source)
        if task is None or (task.done() and task.exception() is not None):
            task = self._loaded[source] = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, source))
        try:
            return await asyncio.shield(task)
        except (OSError, ValueError) as e:
            raise TokenizerUnavailable(
                f"cannot load the tokenizer of model `{model.name}` from {source!r}: {e}"
            ) from None
