"""`--served-model-name`: the names clients use for the served models (vLLM's flag).

As in vLLM, a model's served names replace its Triton name for clients: `/v1/models` lists each name, a
request may give any of them, and every response reports the model's first name (vLLM's
`OpenAIServingModels.model_name()`). `NamedEngine` holds the whole mapping, in front of the engine client:
the services see served names only, and Triton sees its own names only.

The flag takes one of two forms:
- `NAME [NAME ...]`: the names of the one LLM model Triton serves. The frontend finds that model when a
  request or `/v1/models` first needs it, and keeps it while Triton serves it; if Triton serves several
  LLM models then, the error says to name them with the second form.
- `NAME=TRITON_MODEL [...]`: names of the given Triton models; the models not named keep their own names.
A served name hides a Triton model of the same name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

from openai_frontend.engine_client import EngineClient, ModelInfo
from openai_frontend.errors import FrontendError, ModelNotFound
from protocol import AdmissionGroup, SamplingParams, StepOutput, Task


@dataclass(frozen=True, slots=True)
class ServedNames:
    """The flag's names in its order, each with its Triton model (None: the one model Triton serves)."""

    names: tuple[tuple[str, str | None], ...] = ()

    @classmethod
    def parse(cls, values: Sequence[str]) -> ServedNames:
        """`NAME` or `NAME=TRITON_MODEL` values; raises ValueError."""
        names: list[tuple[str, str | None]] = []
        for value in values:
            name, sep, model = value.partition("=")
            names.append((name, model if sep else None))
        return cls(tuple(names))

    def __post_init__(self) -> None:
        served = [name for name, _ in self.names]
        if any(not name or model == "" for name, model in self.names):
            raise ValueError("--served-model-name: empty name (give NAME or NAME=TRITON_MODEL)")
        if len(set(served)) != len(served):
            raise ValueError("--served-model-name: a name is given twice")
        if len({model is None for _, model in self.names}) > 1:
            raise ValueError(
                "--served-model-name: give either NAME ... (names of the one model served) "
                "or NAME=TRITON_MODEL ..., not both"
            )

    def wrap(self, engine: EngineClient) -> EngineClient:
        return NamedEngine(engine, self) if self.names else engine


class NamedEngine:
    """The EngineClient that serves models under their served names (module docstring)."""

    def __init__(self, engine: EngineClient, served: ServedNames) -> None:
        self._engine = engine
        self._models = dict(served.names)  # served name -> Triton model (None: the one model)
        self._one = all(model is None for model in self._models.values())
        self._only: str | None = None  # the one model's Triton name, once found

    async def ready(self) -> bool:
        return await self._engine.ready()

    async def list_models(self) -> list[ModelInfo]:
        models = await self._engine.list_models()
        if self._one and models and self._only not in {m.name for m in models}:
            self._only = _single(models)  # found, or found again: the one model was replaced
        served: list[ModelInfo] = []
        for model in models:
            names = self._names_of(model.name)
            if names:
                served.extend(dataclasses.replace(model, name=name, root=model.name) for name in names)
            elif model.name not in self._models:
                served.append(model)
        return served

    async def model_config(self, model: str) -> ModelInfo:
        if self._one and self._only is None:
            models = await self._engine.list_models()
            self._only = _single(models) if models else None
        target = self._target(model)
        if target is None:
            raise ModelNotFound(model)
        try:
            info = await self._engine.model_config(target)
        except ModelNotFound:
            if target == self._only:
                self._only = None  # unloaded: the next request looks for the one model again
            raise ModelNotFound(model) from None
        names = self._names_of(target)
        return dataclasses.replace(info, name=names[0], root=target) if names else info

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
        target = self._target(model)  # known: the services ask model_config first
        if target is None:
            raise ModelNotFound(model)
        return self._engine.generate(target, prompt, params, request_id, admission_group, task, headers)

    def abort_all(self, reason: str) -> int:
        return self._engine.abort_all(reason)

    async def close(self) -> None:
        await self._engine.close()

    def _target(self, name: str) -> str | None:
        """The Triton model a request's name reaches; None: none (a Triton name that served names replace)."""
        if name in self._models:
            return self._models[name] or self._only
        hidden = {model or self._only for model in self._models.values()}
        return None if name in hidden else name

    def _names_of(self, triton_model: str) -> list[str]:
        """The served names of a Triton model, first the one responses report."""
        return [name for name, model in self._models.items() if (model or self._only) == triton_model]


def _single(models: list[ModelInfo]) -> str:
    if len(models) > 1:
        raise FrontendError(
            f"--served-model-name gives names to the one model served, but Triton serves {len(models)} LLM models "
            f"({', '.join(m.name for m in models)}): give them as NAME=TRITON_MODEL"
        )
    return models[0].name
