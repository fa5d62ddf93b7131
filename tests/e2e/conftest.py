"""One real tritonserver and one real OpenAI frontend on free loopback ports, shared by the e2e tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from scripts.servers import DEFAULT_MODEL, Frontend, TritonServer, running_servers
from tests.e2e.helpers import LOGS


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
    with running_servers(LOGS) as (triton, frontend):
        yield Servers(triton, frontend)
