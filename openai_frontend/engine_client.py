"""The boundary between the HTTP service and the engine: the `EngineClient` protocol.

The service talks only to this protocol. `TritonEngineClient` (triton_client.py) is the real one,
speaking gRPC to Triton; the unit tests use a fake that replays scripted StepOutputs. Both raise the
typed errors of errors.py (ModelNotFound, EngineUnavailable, InvalidRequest, EngineFailure) and
never return error values.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from protocol import AdmissionGroup, SamplingParams, StepOutput, Task


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the frontend needs to know about one LLM model (Triton model config parameters)."""

    name: str
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    max_model_len: int | None = None
    tokenizer_source: str | None = None  # the engine's `model` parameter: where the frontend finds the tokenizer
    root: str | None = None  # the Triton model a served name stands for (served_names.py); None: `name` itself


class EngineClient(Protocol):
    async def ready(self) -> bool:
        """True when the engine server and at least one LLM model are ready to serve."""
        ...

    async def list_models(self) -> list[ModelInfo]:
        """The ready LLM models (model_type == "llm"); raises EngineUnavailable."""
        ...

    async def model_config(self, model: str) -> ModelInfo:
        """Raises ModelNotFound (not there or not an LLM) or EngineUnavailable."""
        ...

    def generate(
        self,
        model: str,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        admission_group: AdmissionGroup | None = None,
        task: Task = Task.GENERATE,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[StepOutput]:
        """One engine request: yields one StepOutput per sequence per step, in arrival order.

        Values are passed on as received (no checking of step order: the service does that).
        `admission_group`: the other engine requests of the same client request (a batch of prompts),
        which the engine's queue bound admits together with the first. `task` EMBED: the prompt is run
        and nothing generated (`params` unused); its one StepOutput carries the embedding. `headers` go with
        the request as its gRPC metadata (the W3C trace context of a traced request: tracing.py).
        Raises InvalidRequest (the engine refused it), EngineFailure or EngineUnavailable. Closing
        the iterator before the end (client gone) cancels the engine request.
        """
        ...

    def abort_all(self, reason: str) -> int:
        """Ends every open generate stream with EngineUnavailable(reason) (shutdown); returns how many."""
        ...

    async def close(self) -> None: ...
