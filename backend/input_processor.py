"""Requests from prompts: the tokenizing and validating a request gets before the engine admits it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from backend.bad_words import bad_words_token_ids
from protocol import GenerateRequest, InvalidRequestError, SamplingParams, Task

if TYPE_CHECKING:
    from backend.config import RuntimeInfo
    from backend.grammar_compiler import StructuredOutputCompiler
    from tokenization.tokenizer import Tokenizer


class InputProcessor:
    """Makes the GenerateRequest the engine runs from a prompt and its SamplingParams, or refuses it.
    Safe to call from any thread while the engine steps: it reads only what is fixed at start."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        runtime: RuntimeInfo,
        max_num_seqs: int,
        structured_outputs: StructuredOutputCompiler,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab = runtime.vocab_size
        self._max_len = runtime.max_model_len
        self._num_kv_tokens = runtime.num_kv_blocks * runtime.block_size
        self._block_size = runtime.block_size
        self._max_num_seqs = max_num_seqs
        self._structured_outputs = structured_outputs  # (its check is thread-safe)
        self._max_token_chars = tokenizer.max_token_chars

    def make_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, task: Task = Task.GENERATE
    ) -> GenerateRequest:
        """Tokenizes and validates; raises InvalidRequestError for anything the engine cannot run."""
        vocab, max_len = self._vocab, self._max_len
        if task is Task.EMBED and params != SamplingParams():
            # An embedding runs the prompt alone: nothing is sampled for these fields to shape.
            raise InvalidRequestError("an embedding request takes no sampling_params", "sampling_params")
        # A prompt to embed may fill the context; one to continue must leave a token to generate.
        room = 0 if task is Task.EMBED else 1
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", "prompt")
            if len(prompt) > max_len * self._max_token_chars - room:  # refused without spending time tokenizing it
                raise InvalidRequestError(
                    f"the prompt is {len(prompt)} characters, at least {len(prompt) // self._max_token_chars} "
                    f"tokens; this model's context is {max_len} tokens",
                    "prompt",
                    "context_length_exceeded",
                )
            token_ids = tuple(self._tokenizer.encode(prompt))
        else:
            token_ids = tuple(int(t) for t in prompt)
            bad = next((t for t in token_ids if t < 0 or t >= vocab), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"prompt holds token id {bad}, outside the vocabulary (size {vocab}: ids 0..{vocab - 1})", "prompt"
                )
        if not token_ids:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if len(token_ids) > max_len - room:
            raise InvalidRequestError(
                f"the prompt is {len(token_ids)} tokens; this model's context is {max_len} tokens"
                + (", and at least one must be left to generate" if room else ""),
                "prompt",
                "context_length_exceeded",
            )
        if task is Task.EMBED:
            return GenerateRequest(request_id, token_ids, params, (), task)
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > max_len:
            # vLLM and OpenAI refuse this too: cutting the answer short at the window would look like
            # a choice of the model's ("length") when the request could never have been met.
            raise InvalidRequestError(
                f"max_tokens is too large: {params.max_tokens}. This model's context is {max_len} tokens and "
                f"the prompt is {len(token_ids)} tokens ({params.max_tokens} > {max_len} - {len(token_ids)})",
                "max_tokens",
                "context_length_exceeded",
            )
        for field_name, ids in (
            ("logit_bias", [t for t, _ in params.logit_bias]),
            ("stop_token_ids", params.stop_token_ids),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"{field_name} holds token id {bad}, outside the vocabulary (size {vocab}: ids 0..{vocab - 1})",
                    field_name,
                )
        if params.n > self._max_num_seqs:
            raise InvalidRequestError(f"n must be at most {self._max_num_seqs} on this server", "n")
        if params.use_beam_search:
            self._check_beams_fit(len(token_ids), params)
        if params.structured_outputs is not None:
            # a constraint over a size limit, or that does not parse, is refused here; it starts compiling
            self._structured_outputs.check(params.structured_outputs)
        bad = bad_words_token_ids(params.bad_words, lambda w: self._tokenizer.encode(w, add_special_tokens=False))
        return GenerateRequest(request_id, token_ids, params, bad, task)

    def _check_beams_fit(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """A beam search advances its beams together: all n must fit in the KV pool at once, even
        when preemption has taken the blocks they shared, or it could never finish."""
        length = num_prompt_tokens + (params.max_tokens or self._max_len - num_prompt_tokens)
        bs = self._block_size
        needed = params.n * -(-length // bs) * bs
        if needed > self._num_kv_tokens:
            raise InvalidRequestError(
                f"use_beam_search with n={params.n} beams of up to {length} tokens needs {needed} KV cache "
                f"slots; this server has {self._num_kv_tokens}: lower n or max_tokens",
                "max_tokens",
            )
