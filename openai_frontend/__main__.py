"""`python -m openai_frontend --help`: serve the OpenAI API for the models of one or more Triton servers."""

from __future__ import annotations

from openai_frontend.settings import parse_settings, set_grpc_environment

set_grpc_environment()  # before the app's imports start gRPC

import uvicorn  # noqa: E402

from openai_frontend.app import create_app  # noqa: E402
from openai_frontend.connection_limits import ReadLimits, bounded_protocol  # noqa: E402
from openai_frontend.request_log import configure_access_log  # noqa: E402
from openai_frontend.server_pool import ServerPool  # noqa: E402
from openai_frontend.shutdown import GracefulServer  # noqa: E402


def main() -> None:
    settings = parse_settings()
    app = create_app(ServerPool(settings.triton_urls), settings)
    # uvloop and httptools (both pinned): every streamed chunk crosses the event loop and the HTTP writer,
    # and in C they take less of the cores the engine shares (docs/performance.md); the protocol is httptools'
    # with read bounds for slow and malformed clients.
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=5,
        loop="uvloop",
        http=bounded_protocol(
            ReadLimits(settings.header_timeout_s, settings.body_timeout_s, settings.max_header_bytes)
        ),
        timeout_keep_alive=settings.keep_alive_timeout_s,
        limit_concurrency=settings.max_connections,
    )
    configure_access_log(settings.log_level)  # after uvicorn's Config, which configures its own loggers
    GracefulServer(config, app.state.drain).run()


if __name__ == "__main__":
    main()
