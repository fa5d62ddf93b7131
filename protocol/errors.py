"""The errors both sides of the wire name: a request refused before it runs, and a full queue."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses before it runs; `param` names the offending field and `code` is
    OpenAI's error code where it has one (e.g. "context_length_exceeded")."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


# The code of a refusal of a client request's prompts together (more sequences than the server could ever
# hold), as opposed to one prompt's own (too long, an id outside the vocabulary): those name the prompt.
TOO_MANY_SEQUENCES = "too_many_sequences"


class EngineOverloaded(InvalidRequestError):
    """The engine's queue is full: the request is refused at once rather than queued without end."""
