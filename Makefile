# Two commands on a fresh machine: `make serve` and `make test`. Everything else is installed here.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TOOLS := .tools
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: venv cpu-kernels lint serve test test-fast bench-engine bench-serve bench-wire bench-profile bench-ab bench-spec bench-frontend-ab bench-structured bench-responses bench-score bench-embed perf genai-perf lm-eval soak clean

# The venv is (re)built only when the pinned requirements change. The machine's pip config
# (extra local indexes, a torch cap) is left out: requirements.txt says all pip needs.
PIP := PIP_CONFIG_FILE=/dev/null $(PY) -m pip install -q --disable-pip-version-check
$(STAMP): requirements.txt requirements-nodeps.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements.txt
	$(PIP) --no-deps -r requirements-nodeps.txt
	$(PY) -c "from scripts.servers import TritonInstall; TritonInstall.find().ensure_backends()"
	@touch $(STAMP)

venv: $(STAMP)

# The C++ CPU kernels (kernels/cpu_kernels.py) are built before anything needs them: ~30 s once,
# a no-op later (and a warning, not a failure, where they cannot be built: torch runs instead).
cpu-kernels: venv
	$(PY) -m kernels.cpu_kernels

serve: cpu-kernels
	$(PY) -m scripts.serve

# ruff (pinned in requirements.txt, configured in pyproject.toml): lint, and the formatter's check.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint cpu-kernels
	$(PY) -m pytest

test-fast: cpu-kernels
	$(PY) -m pytest -m "not slow and not e2e"

bench-engine: cpu-kernels
	$(PY) benchmarks/engine_bench.py --compile

bench-serve: cpu-kernels
	$(PY) benchmarks/serve_bench.py $(ARGS)

# The response path alone: real tritonserver + frontend, a stand-in engine (no model), 64/256/1024 streams.
bench-wire: venv
	$(PY) -m benchmarks.wire_bench

# Where served time goes: per-step timestamps and CPU per thread, served vs in-process (concurrency 1 and 8).
bench-profile: cpu-kernels
	$(PY) -m benchmarks.serve_profile

# An A/B of the served path: two server sets, B changed by ARGS (e.g. ARGS="--param-b stream_interval=4"
# or ARGS="--env-b GOMP_SPINCOUNT=50000"; none: two identical sets, the method's own spread).
bench-ab: cpu-kernels
	$(PY) -m benchmarks.serve_ab $(ARGS)

# Speculative decoding (n-gram prompt lookup) served: A off, B speculative=ngram (plus ARGS="--param-b KEY=VALUE"),
# on a repetition-friendly greedy chat load (B's answers compared with A's token by token) and bench-serve's load.
bench-spec: cpu-kernels
	$(PY) -m benchmarks.spec_bench $(ARGS)

# A frontend change measured: two frontends on one tritonserver, B from a git revision (ARGS="--base HEAD~1")
# or with other environment (ARGS="--env-b KEY=VALUE"); the frontend's CPU per token and tok/s, paired.
bench-frontend-ab: cpu-kernels
	$(PY) -m benchmarks.frontend_ab $(ARGS)

# Output tok/s at concurrency 8 with a json_schema constraint against the same load without one (same run).
bench-structured: cpu-kernels
	$(PY) benchmarks/serve_bench.py --structured --concurrency 8 --requests 16 --skip-inprocess

# /v1/responses (streamed, stored in SQLite and in PostgreSQL) against chat completions in the same run: output
# tok/s at 8 streams, the frontend's CPU per token at 64, resume latency (benchmarks/responses_bench.py).
bench-responses: cpu-kernels
	$(PY) benchmarks/responses_bench.py $(ARGS)

# Scoring prompts as lm-eval's loglikelihood requests do (echo + logprobs), served, against transformers.
bench-score: cpu-kernels
	$(PY) benchmarks/score_bench.py $(ARGS)

bench-embed: cpu-kernels
	$(PY) benchmarks/embed_bench.py $(ARGS)

perf: venv
	$(PY) -m scripts.perf_tools perf

genai-perf: venv
	$(PY) -m scripts.perf_tools genai-perf

# Mixed traffic against the real servers for MINUTES (10), then one JSON line: errors, integrity
# violations and KV blocks left in use must be none (benchmarks/soak.py).
soak: cpu-kernels
	$(PY) benchmarks/soak.py --minutes $(or $(MINUTES),10)

# lm-evaluation-harness (pinned, in .tools/lm-eval) against a running `make serve`: make lm-eval TASKS=hellaswag LIMIT=100
lm-eval: venv
	$(PY) -m scripts.lm_eval --tasks $(or $(TASKS),$(error give TASKS=<lm-eval task names>)) $(if $(LIMIT),--limit $(LIMIT))

clean:
	rm -rf $(VENV) $(TOOLS) .cache .pytest_cache .hypothesis artifacts
