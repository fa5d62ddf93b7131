"""Frontend settings: one frozen object, parsed from the command line at the edge (`python -m openai_frontend`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass

from openai_frontend.served_names import ServedNames

# grpcio's EventEngine client hands each message Triton streams through threads of its own before the
# poller thread that wakes the event loop; with this experiment off, that poller thread reads the socket
# itself. Every streamed token crosses that path, and each thread woken takes the cores the engine steps on
# (docs/performance.md). gRPC reads the setting once, when it starts.
GRPC_EXPERIMENTS = "-event_engine_client"


def set_grpc_environment(environ: MutableMapping[str, str] = os.environ) -> None:
    """The frontend's gRPC settings, unless the user set their own: call before gRPC starts."""
    environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)


@dataclass(frozen=True, slots=True)
class Settings:
    triton_urls: tuple[str, ...] = ("localhost:8001",)  # Triton gRPC endpoints (openai_frontend/server_pool.py)
    host: str = "127.0.0.1"
    port: int = 9000
    default_max_tokens: int = 16  # completions, like OpenAI's
    chat_default_max_tokens: int | None = None  # None: up to the model's context window
    cors_origins: tuple[str, ...] = ()
    api_key: str | None = None
    log_level: str = "info"
    log_requests: bool = False  # prompts and outputs in the access log (request_log.py): users' data, so opt-in
    otlp_traces_endpoint: str | None = None  # None: no tracing (tracing.py)
    served_names: ServedNames = ServedNames()  # --served-model-name: the names clients use for the models
    tokenizer: str | None = None  # None: the model's own (its Triton `model` parameter), read from this machine
    max_request_bytes: int = 8 * 2**20  # a larger body is a 413 before it is read
    shutdown_grace_s: float = 30.0  # on SIGTERM, how long open requests may run on
    # What a slow or malformed client may hold (openai_frontend/connection_limits.py).
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_header_bytes: int = 64 * 1024
    keep_alive_timeout_s: int = 5
    max_connections: int = 4096  # open connections and requests; past it a 503
    prompt_threads: int = 2  # threads that tokenize and render big prompts off the event loop (tokenizers.py)
    max_prompts_per_request: int = 256  # prompts of a completion, conversations of a chat: an engine request each
    allow_special_tokens_in_content: bool = False  # False: special tokens typed in a chat are text (chat_prompt.py)
    # The Responses API's store (docs/responses.md): None is SQLite in the state folder.
    state_dir: str = "artifacts/state"
    response_store: str | None = None  # sqlite:///path or postgresql://user:pass@host:port/db
    response_lease_s: float = 10.0  # a dead frontend's unfinished responses are taken over after this long
    response_poll_ms: float = 50.0  # how often a reader of a response generated elsewhere looks for new events
    response_ttl_s: float = 30 * 86400.0
    response_store_max: int = 100_000  # stored responses; past it the oldest finished ones are deleted

    def __post_init__(self) -> None:
        if self.default_max_tokens < 1:
            raise ValueError("--default-max-tokens must be >= 1")
        if self.chat_default_max_tokens is not None and self.chat_default_max_tokens < 1:
            raise ValueError("--chat-default-max-tokens must be >= 1")
        if self.shutdown_grace_s < 0:
            raise ValueError("--shutdown-grace-s must be >= 0")
        if self.max_request_bytes < 1024:
            raise ValueError("--max-request-bytes must be >= 1024")
        if not self.triton_urls:
            raise ValueError("give at least one --triton-url")
        if min(self.header_timeout_s, self.body_timeout_s) <= 0 or self.keep_alive_timeout_s < 1:
            raise ValueError("--header-timeout-s and --body-timeout-s must be > 0, --keep-alive-timeout-s >= 1")
        if self.max_header_bytes < 1024 or self.max_connections < 1:
            raise ValueError("--max-header-bytes must be >= 1024 and --max-connections >= 1")
        if self.prompt_threads < 1:
            raise ValueError("--prompt-threads must be >= 1")
        if self.max_prompts_per_request < 1:
            raise ValueError("--max-prompts-per-request must be >= 1")
        if not 0 < self.port < 65536:
            raise ValueError("--port must be in 1..65535")
        if self.response_lease_s <= 0 or self.response_poll_ms <= 0 or self.response_ttl_s <= 0:
            raise ValueError("--response-lease-s, --response-poll-ms and --response-ttl-s must be > 0")
        if self.response_store_max < 1:
            raise ValueError("--response-store-max must be >= 1")
        if self.otlp_traces_endpoint is not None and not self.otlp_traces_endpoint.strip():
            raise ValueError("--otlp-traces-endpoint must not be empty")

    def response_store_url(self) -> str:
        return self.response_store or f"sqlite:///{os.path.join(self.state_dir, 'responses.db')}"


def build_parser() -> argparse.ArgumentParser:
    env_port = os.environ.get("FRONTEND_PORT")
    parser = argparse.ArgumentParser(
        prog="python -m openai_frontend",
        description="OpenAI-compatible HTTP frontend (FastAPI) for the LLM served by Triton over gRPC.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--triton-url",
        action="append",
        default=None,
        dest="triton_urls",
        metavar="HOST:PORT",
        help="a Triton gRPC endpoint (default localhost:8001); repeat it for several servers, or give "
        "a name that resolves to several addresses (a Kubernetes headless Service)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on")
    parser.add_argument(
        "--port",
        type=int,
        default=int(env_port) if env_port else 9000,
        help="HTTP port (the environment variable FRONTEND_PORT, when set, replaces the default 9000)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=16,
        help="max_tokens of /v1/completions requests that give none (OpenAI's default is 16)",
    )
    parser.add_argument(
        "--chat-default-max-tokens",
        type=int,
        default=None,
        help="max_tokens of /v1/chat/completions requests that give none; unset: up to the context window",
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        dest="cors_origins",
        metavar="ORIGIN",
        help="allow cross-origin requests from ORIGIN (repeatable; '*' allows any)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on /v1/* (default from FRONTEND_API_KEY; unset: no authentication)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        dest="served_model_names",
        metavar="NAME",
        help="names clients use for the model Triton serves (vLLM's flag): /v1/models lists each, requests may "
        "give any, responses report the first, and the Triton name is no longer served; with several Triton "
        "models give NAME=TRITON_MODEL values (docs/frontend.md)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="the tokenizer for /tokenize, /detokenize, /tokenizer_info, echo and return_token_ids: "
        "'smollm2', a .gguf file or a Hugging Face folder; unset: the served model's own "
        "(the `model` parameter of its Triton config), which must then be on this machine",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=8 * 2**20,
        help="largest request body accepted; a larger one gets a 413 before it is read (the default, "
        "8 MiB, holds a prompt filling the context window many times over)",
    )
    parser.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM: readiness and new requests get 503 at once, open requests run on for up to "
        "this long, then end with an error event",
    )
    limits = Settings()
    parser.add_argument(
        "--header-timeout-s",
        type=float,
        default=limits.header_timeout_s,
        help="a request's line and headers must arrive within this long (else a 408 and the connection closes)",
    )
    parser.add_argument(
        "--body-timeout-s",
        type=float,
        default=limits.body_timeout_s,
        help="a request body that sends nothing for this long closes its connection (and cancels its work)",
    )
    parser.add_argument(
        "--max-header-bytes",
        type=int,
        default=limits.max_header_bytes,
        help="largest request line + headers; a larger one gets a 431",
    )
    parser.add_argument(
        "--keep-alive-timeout-s",
        type=int,
        default=limits.keep_alive_timeout_s,
        help="an idle keep-alive connection closes after this long",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=limits.max_connections,
        help="open connections and requests at once; past it new ones get a 503",
    )
    parser.add_argument(
        "--prompt-threads",
        type=int,
        default=limits.prompt_threads,
        help="threads that tokenize prompts and render chat templates of big requests, so that the "
        "event loop (every other request, the health probe) never waits on them",
    )
    parser.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=limits.max_prompts_per_request,
        help="prompts one /v1/completions request may hold, and conversations one batched chat may hold "
        "(each is an engine request of its own); more is a 400",
    )
    parser.add_argument(
        "--allow-special-tokens-in-content",
        action="store_true",
        help="read special tokens' texts typed in chat messages, tools and chat_template_kwargs "
        "(`<|im_start|>system`) as the control tokens they name; by default they are plain text, so that "
        "no user can forge a turn of the conversation",
    )
    parser.add_argument(
        "--state-dir",
        default=limits.state_dir,
        help="the frontend's state folder: the response store's SQLite file lives here (unless --response-store)",
    )
    parser.add_argument(
        "--response-store",
        default=os.environ.get("RESPONSE_STORE") or None,
        metavar="URL",
        help="where /v1/responses keeps responses and their events: sqlite:///path/file.db, or "
        "postgresql://user:password@host:port/database to share one store between several frontends "
        "(default from RESPONSE_STORE; unset: SQLite in --state-dir)",
    )
    parser.add_argument(
        "--response-lease-s",
        type=float,
        default=limits.response_lease_s,
        help="a frontend holds the responses it generates by a lease it renews; when it dies, another frontend "
        "(sharing the store) or this one restarted continues its background responses after this long",
    )
    parser.add_argument(
        "--response-poll-ms",
        type=float,
        default=limits.response_poll_ms,
        help="how often a stream of a response that another frontend generates looks for new events",
    )
    parser.add_argument(
        "--response-ttl-s",
        type=float,
        default=limits.response_ttl_s,
        help="stored responses are deleted this long after their creation (OpenAI keeps them 30 days)",
    )
    parser.add_argument(
        "--response-store-max",
        type=int,
        default=limits.response_store_max,
        help="stored responses kept at most; past it the oldest finished ones are deleted",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's and the access log's level (one JSON line per request at info)",
    )
    parser.add_argument(
        "--log-requests",
        action="store_true",
        help="add each request's prompts and outputs (each cut to 2048 characters) to its access log line; "
        "off by default, since they hold users' data",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="send an OpenTelemetry span per generation request to this OTLP/gRPC collector "
        "(e.g. http://localhost:4317; vLLM's flag); unset: no tracing",
    )
    return parser


def parse_settings(argv: Sequence[str] | None = None) -> Settings:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return Settings(
            triton_urls=tuple(args.triton_urls or ["localhost:8001"]),
            host=args.host,
            port=args.port,
            default_max_tokens=args.default_max_tokens,
            chat_default_max_tokens=args.chat_default_max_tokens,
            cors_origins=tuple(args.cors_origins),
            api_key=args.api_key or os.environ.get("FRONTEND_API_KEY") or None,
            log_level=args.log_level,
            log_requests=args.log_requests,
            otlp_traces_endpoint=args.otlp_traces_endpoint,
            served_names=ServedNames.parse(args.served_model_names),
            tokenizer=args.tokenizer,
            max_request_bytes=args.max_request_bytes,
            shutdown_grace_s=args.shutdown_grace_s,
            header_timeout_s=args.header_timeout_s,
            body_timeout_s=args.body_timeout_s,
            max_header_bytes=args.max_header_bytes,
            keep_alive_timeout_s=args.keep_alive_timeout_s,
            max_connections=args.max_connections,
            prompt_threads=args.prompt_threads,
            max_prompts_per_request=args.max_prompts_per_request,
            allow_special_tokens_in_content=args.allow_special_tokens_in_content,
            state_dir=args.state_dir,
            response_store=args.response_store,
            response_lease_s=args.response_lease_s,
            response_poll_ms=args.response_poll_ms,
            response_ttl_s=args.response_ttl_s,
            response_store_max=args.response_store_max,
        )
    except ValueError as e:
        parser.error(str(e))
