"""One real tritonserver and one real OpenAI frontend on free loopback ports, shared by the e2e tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from scripts.servers import DEFAULT_MODEL, REPO_ROOT, Frontend, TritonServer, free_port


@dataclass(frozen=True)
class Servers:
    triton: TritonServer
    frontend: Frontend
    model: str = DEFAULT_MODEL

    @property
    def base_url(self) -> str:
        return f"{self.frontend.url}/v1"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def servers() -> Servers:
    logs = REPO_ROOT / "artifacts" / "test-logs"
    logs.mkdir(parents=True, exist_ok=True)
    triton = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    triton.start(log_path=logs / "tritonserver.log")
    frontend = Frontend(triton.grpc_url, port=free_port())
    try:
        frontend.start(log_path=logs / "frontend.log")
    except BaseException:
        triton.stop()
        raise
    yield Servers(triton, frontend)
    frontend.stop()
    triton.stop()
