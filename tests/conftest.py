"""Test-session setup shared by every test module."""

from kernels import cpu_kernels

# The C++ CPU kernels load once for the session, before any module builds a model or asks for a kernel
# at import (as the engine does when it starts). `make test` has built them already; where they cannot
# load, tests run the torch paths and the kernel tests skip.
cpu_kernels.load()
