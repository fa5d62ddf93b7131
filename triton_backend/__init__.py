"""The Triton adapter, written once: a Python-based Triton backend named "llm".

Triton runs `<backend-directory>/llm/model.py` for every model whose config.pbtxt says `backend: "llm"`;
that folder is a link to this package (scripts/servers.py makes it). Adding a model is a config.pbtxt
and an empty version folder under model_repository/, no code.
- model.py: Triton's entry point; puts this checkout and its venv on the stub's sys.path, then delegates
- adapter.py: Triton requests -> GenerateRequests for the engine loop, StepOutputs -> Triton responses
- metrics.py: the engine's statistics as Triton custom metrics (llm_*)
"""

BACKEND_NAME = "llm"
