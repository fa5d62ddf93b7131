"""Test-session setup shared by every test module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from kernels import cpu_kernels

if TYPE_CHECKING:
    from scripts.postgres_server import PostgresServer

# The C++ CPU kernels load once for the session, before any module builds a model or asks for a kernel
# at import (as the engine does when it starts). `make test` has built them already; where they cannot
# load, tests run the torch paths and the kernel tests skip.
cpu_kernels.load()


@pytest.fixture(scope="session")
def postgresql() -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL server for the session, started when a test first asks for it; each test makes its
    own database in it. It runs without fsync: its data need not outlive the session. Its folder is a new one under
    the system's temporary folder rather than under pytest's, which pytest keeps closed to other users (as root,
    the server runs as another user)."""
    from scripts.postgres_server import temporary_postgres  # (imported here: most sessions never start one)

    with temporary_postgres(durable=False) as server:
        yield server
