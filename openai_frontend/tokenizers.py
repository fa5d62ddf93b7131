"""The frontend's own copy of each model's tokenizer, for what needs token ids before or beside the
engine: /tokenize, /detokenize, /tokenizer_info, echo of token-id prompts, `return_token_ids` and
`truncate_prompt_tokens`; and the threads that prompt work (tokenizing, chat templates) and the parsing
of big request bodies run on.

The engine tokenizes every prompt itself; the frontend loads the same tokenizer (tokenization.model_files,
no torch) from the source named by the model's Triton `model` parameter, or from `--tokenizer`.
Loaded once per source on first use, off the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from openai_frontend.engine_client import ModelInfo
from openai_frontend.errors import FrontendError
from tokenization.model_files import load_tokenizer
from tokenization.tokenizer import Tokenizer

log = logging.getLogger("openai_frontend")
P = ParamSpec("P")
T = TypeVar("T")

# Prompt work on at most this many characters runs on the event loop: it takes less time than a hop to a
# thread and back, and a small request never queues behind a big one.
INLINE_WORK_CHARS = 4096

# The worker threads run at this nice value: one request's big prompt or body takes the cores only when
# nothing else wants them, so on a machine the engine shares (the default deployment) the streams being
# decoded keep their pace while it is tokenized, rendered or parsed.
PROMPT_WORK_NICENESS = 10


def _lower_thread_priority() -> None:
    """Starts a worker thread at PROMPT_WORK_NICENESS (Linux: a nice value is per thread, kept by the
    threads it starts, such as the tokenizer's own pool). Raising one's own nice value needs no privilege."""
    try:
        thread = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, thread) < PROMPT_WORK_NICENESS:  # never above the process's own
            os.setpriority(os.PRIO_PROCESS, thread, PROMPT_WORK_NICENESS)
    except (AttributeError, OSError):  # no per-thread priority here: the threads run as the loop does
        pass


class TokenizerUnavailable(FrontendError):
    status_code = 501
    error_type = "server_error"


class Tokenizers:
    def __init__(
        self, override: str | None = None, threads: int = 2, *, special_tokens_in_content: bool = False
    ) -> None:
        self.override = override
        self.special_tokens_in_content = special_tokens_in_content  # --allow-special-tokens-in-content
        self._loaded: dict[str, asyncio.Task[Tokenizer]] = {}
        self._workers = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="prompt-work", initializer=_lower_thread_priority
        )
        self._warned: set[str] = set()  # models whose chats go without a tokenizer

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

    async def for_chat(self, model: ModelInfo, needed: bool) -> tuple[Tokenizer | None, frozenset[str]]:
        """(the tokenizer a chat's prompt needs, the special tokens' texts a user string must keep as text).
        `needed`: the prompt goes as ids (a 501 without a tokenizer). Else the tokenizer only tells which
        texts are special: without one the chat goes as rendered, and a warning says so once per model (which
        is not tried again)."""
        if not needed and (self.special_tokens_in_content or model.name in self._warned):
            return None, frozenset()
        try:
            tokenizer = await self.get(model)
        except TokenizerUnavailable as e:
            if needed:
                raise
            self._warned.add(model.name)
            log.warning(
                "special tokens typed in chats of model `%s` are read as control tokens: %s", model.name, e.message
            )
            return None, frozenset()
        return tokenizer, frozenset() if self.special_tokens_in_content else tokenizer.special_token_texts

    async def run(self, chars: int, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`work(*args, **kwargs)`, prompt work on about `chars` characters: on a worker thread unless it
        is small, so that tokenizing or rendering a big prompt never holds up the event loop (and with it
        every other request and the health probe)."""
        if chars <= INLINE_WORK_CHARS:
            return work(*args, **kwargs)
        return await self.run_on_thread(work, *args, **kwargs)

    async def run_on_thread(self, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`work(*args, **kwargs)` on a worker thread (also the parsing of big request bodies: routers/common.py)."""
        call = functools.partial(work, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._workers, call)
