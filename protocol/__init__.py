"""What the engine and the frontend both speak: the boundary types and the wire codec.

Imports neither torch nor anything of backend/ or openai_frontend/: the Triton adapter, the engine
and the frontend all import it, and nothing here imports them.
- sampling.py: SamplingParams and StructuredOutputs (validated on construction)
- messages.py: GenerateRequest, Task, StepOutput, RequestTimings, TokenLogprobs, PromptLogprobs,
  RequestFailure
- errors.py: InvalidRequestError, EngineOverloaded
- wire.py: a StepOutput as Triton tensors, both ways (docs/wire-contract.md)
"""

from protocol.errors import EngineOverloaded, InvalidRequestError
from protocol.messages import (
    AdmissionGroup,
    EngineOutput,
    FinishReason,
    GenerateRequest,
    PromptLogprobs,
    RequestFailure,
    RequestTimings,
    StepOutput,
    Task,
    TokenLogprobs,
)
from protocol.sampling import MAX_LOGPROBS, STRUCTURED_OUTPUT_KINDS, SamplingParams, StructuredOutputs, schema_text

__all__ = [
    "MAX_LOGPROBS",
    "STRUCTURED_OUTPUT_KINDS",
    "AdmissionGroup",
    "EngineOutput",
    "EngineOverloaded",
    "FinishReason",
    "GenerateRequest",
    "InvalidRequestError",
    "PromptLogprobs",
    "RequestFailure",
    "RequestTimings",
    "SamplingParams",
    "StepOutput",
    "StructuredOutputs",
    "Task",
    "TokenLogprobs",
    "schema_text",
]
