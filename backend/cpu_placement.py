"""Where a served CPU engine's threads and tritonserver run: the response's round trip on one core.

python_backend's `send()` is a synchronous round trip: the engine thread hands the response to
tritonserver (its stub-message thread, then a pool thread that gives it to the gRPC frontend) and waits
for the answer. Each hop wakes a thread of the other process. When that thread waits on another core,
the hop takes an inter-processor interrupt and, on a VM, an exit to the hypervisor. When tritonserver
runs on the engine thread's core, each hop is a local context switch: the core the engine thread leaves
idle while it waits runs tritonserver's side of the send. The engine's OpenMP workers keep the other
cores. Figures: docs/performance.md (CPU placement).

Two halves, both needed (either alone measured as nothing):
- the launcher (scripts/servers.py) starts tritonserver on the first of its CPUs and tells the stubs,
  which inherit that one-CPU mask, all of them (ENGINE_CPUS_ENV); not for a repository with a GPU
  model, whose path may need tritonserver on more than one core;
- the Triton adapter (triton_backend/adapter.py) calls `place_engine` before torch loads: it widens
  the stub back to those CPUs and, for a single CPU instance, binds OpenMP's threads one per CPU, the
  team's master (the engine thread) first, on the CPU tritonserver runs on.

A user who runs tritonserver by hand gets the same with
`LLM_ENGINE_CPUS=0,1 taskset -c 0 tritonserver --model-repository model_repository`. No torch here.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

# The CPUs the engine may use (a list such as "0,1" or "0-3"), set by the launcher for the stubs.
ENGINE_CPUS_ENV = "LLM_ENGINE_CPUS"
# The launcher's switch: "shared-core" (the default) or "off".
PLACEMENT_ENV = "LLM_CPU_PLACEMENT"
# OpenMP affinity settings of the user's (or a container's) that this module must not override.
_USER_OPENMP_AFFINITY = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def parse_cpus(text: str) -> list[int]:
    """'0,2-4' -> [0, 2, 3, 4] (sorted, no repeats); ValueError for anything else."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if low < 0 or high < low:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(low, high + 1))
    if not cpus:
        raise ValueError(f"no CPUs in {text!r}")
    return sorted(cpus)


def launch_placement(model_repository: Path, environ: dict[str, str] | None = None) -> tuple[int, list[int]] | None:
    """For the launcher: (the CPU tritonserver runs on, the engine's CPUs), or None where there is
    nothing to place: fewer than two CPUs, PLACEMENT_ENV "off", or a model with a KIND_GPU instance
    group in the repository (a GPU engine's path may need more than one core for tritonserver)."""
    environ = os.environ if environ is None else environ
    mode = environ.get(PLACEMENT_ENV, "shared-core").strip().lower()
    if mode == "off":
        return None
    if mode != "shared-core":
        raise ValueError(f"{PLACEMENT_ENV} must be shared-core or off, not {mode!r}")
    if any(_has_gpu_instances(config.read_text()) for config in model_repository.glob("*/config.pbtxt")):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return cpus[0], cpus


def _has_gpu_instances(config_pbtxt: str) -> bool:
    """Whether a config.pbtxt (its text, comments left out) gives an instance group `kind: KIND_GPU`."""
    code = "\n".join(line.split("#", 1)[0] for line in config_pbtxt.splitlines())
    return re.search(r"\bkind\s*:\s*KIND_GPU\b", code) is not None


def place_engine(kind: str, cpu_instances: int, environ: dict[str, str] | None = None) -> list[int] | None:
    """In the stub, before torch (and so libgomp) loads: the engine's CPUs from ENGINE_CPUS_ENV, or None
    when the launcher gave none. Widens this thread's CPU mask to them (the stub inherited
    tritonserver's one CPU; threads started from here on inherit the wider mask). For a single CPU
    instance, also binds OpenMP's threads one per CPU in that order (OMP_PLACES, OMP_PROC_BIND=close):
    libgomp puts the master of every team on the first, where tritonserver runs. Several instances, a
    GPU instance or OpenMP affinity the user set: the threads float on the CPUs."""
    environ = os.environ if environ is None else environ
    text = environ.get(ENGINE_CPUS_ENV, "").strip()
    if not text:
        return None
    try:
        cpus = parse_cpus(text)
        os.sched_setaffinity(0, cpus)
    except (ValueError, OSError) as e:  # (a bad value, or CPUs this process may not use): no placement
        logger.warning("%s=%r not applied: %s", ENGINE_CPUS_ENV, text, e)
        return None
    reasons = []
    if kind != "CPU":
        reasons.append(f"a {kind} instance")
    if cpu_instances != 1:
        reasons.append(f"{cpu_instances} CPU instances")
    if any(name in environ for name in _USER_OPENMP_AFFINITY):
        reasons.append("OpenMP affinity set by the user")
    if "torch" in sys.modules:
        reasons.append("torch already loaded")
    if reasons:
        logger.info("engine on CPUs %s, OpenMP threads not bound (%s)", cpus, ", ".join(reasons))
        return cpus
    environ["OMP_PLACES"] = ",".join(f"{{{cpu}}}" for cpu in cpus)
    environ["OMP_PROC_BIND"] = "close"
    logger.info("engine on CPUs %s, OpenMP threads bound one per CPU from CPU %d", cpus, cpus[0])
    return cpus
