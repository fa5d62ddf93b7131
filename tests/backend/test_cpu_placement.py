"""backend/cpu_placement.py: which CPUs the launcher gives tritonserver and the engine, and what the stub
sets before torch loads (tests/e2e/test_cpu_placement.py checks the real processes' threads)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from backend import cpu_placement
from backend.cpu_placement import ENGINE_CPUS_ENV, PLACEMENT_ENV, launch_placement, parse_cpus, place_engine
from scripts.servers import MODEL_REPOSITORY

OURS = sorted(os.sched_getaffinity(0))  # (place_engine sets this thread's mask: only to what it has)
OURS_TEXT = ",".join(map(str, OURS))


def test_parse_cpus_reads_lists_and_ranges():
    assert parse_cpus("0,1") == [0, 1]
    assert parse_cpus("2-4, 0") == [0, 2, 3, 4]
    assert parse_cpus("3,3,1-2") == [1, 2, 3]
    for bad in ("", ",", "a", "3-1", "-1"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def repository(tmp_path: Path, *kinds: str) -> Path:
    for i, kind in enumerate(kinds):
        (tmp_path / f"model{i}").mkdir(parents=True)
        (tmp_path / f"model{i}" / "config.pbtxt").write_text(
            f"# device: cpu, or cuda with instance_group KIND_GPU\ninstance_group [ {{ count: 1 kind: {kind} }} ]\n"
        )
    return tmp_path


def test_launch_placement_puts_tritonserver_on_the_first_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_placement.os, "sched_getaffinity", lambda pid: {3, 1, 2})
    cpu_models = repository(tmp_path, "KIND_CPU", "KIND_CPU")
    assert launch_placement(cpu_models, {}) == (1, [1, 2, 3])
    assert launch_placement(cpu_models, {PLACEMENT_ENV: "shared-core"}) == (1, [1, 2, 3])
    assert launch_placement(cpu_models, {PLACEMENT_ENV: "off"}) is None
    with pytest.raises(ValueError, match=PLACEMENT_ENV):
        launch_placement(cpu_models, {PLACEMENT_ENV: "pinned"})


def test_launch_placement_leaves_gpu_models_and_a_single_cpu_alone(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_placement.os, "sched_getaffinity", lambda pid: {0, 1})
    assert launch_placement(repository(tmp_path, "KIND_CPU", "KIND_GPU"), {}) is None
    monkeypatch.setattr(cpu_placement.os, "sched_getaffinity", lambda pid: {0})
    assert launch_placement(repository(tmp_path / "other", "KIND_CPU"), {}) is None


@pytest.mark.skipif(len(OURS) < 2, reason="one CPU: nothing to place")
def test_the_default_repository_is_placed():
    assert launch_placement(MODEL_REPOSITORY, {}) == (OURS[0], OURS)


def test_place_engine_binds_openmp_one_thread_per_cpu_from_tritonservers(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # (as in a stub: torch not loaded yet)
    environ = {ENGINE_CPUS_ENV: OURS_TEXT}
    assert place_engine("CPU", 1, environ) == OURS
    assert environ["OMP_PLACES"] == ",".join(f"{{{cpu}}}" for cpu in OURS)
    assert environ["OMP_PROC_BIND"] == "close"
    assert sorted(os.sched_getaffinity(0)) == OURS


@pytest.mark.parametrize(
    ("kind", "instances", "extra"),
    [
        ("GPU", 1, {}),  # a GPU engine: its CPU threads float
        ("CPU", 2, {}),  # several engines: binding each from the first CPU would stack them
        ("CPU", 1, {"OMP_PROC_BIND": "spread"}),  # the user's OpenMP affinity wins
        ("CPU", 1, {"GOMP_CPU_AFFINITY": "0-1"}),
    ],
)
def test_place_engine_widens_but_does_not_bind(monkeypatch, kind, instances, extra):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    environ = {ENGINE_CPUS_ENV: OURS_TEXT, **extra}
    assert place_engine(kind, instances, environ) == OURS
    assert environ == {ENGINE_CPUS_ENV: OURS_TEXT, **extra}


def test_place_engine_cannot_bind_once_torch_is_loaded(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", object())  # libgomp read its settings when torch loaded
    environ = {ENGINE_CPUS_ENV: OURS_TEXT}
    assert place_engine("CPU", 1, environ) == OURS
    assert "OMP_PLACES" not in environ


def test_place_engine_does_nothing_without_the_launchers_word():
    environ: dict[str, str] = {}
    assert place_engine("CPU", 1, environ) is None
    assert environ == {}


def test_place_engine_ignores_cpus_it_cannot_have():
    environ = {ENGINE_CPUS_ENV: "100000"}  # no such CPU: sched_setaffinity refuses it
    assert place_engine("CPU", 1, environ) is None
    assert sorted(os.sched_getaffinity(0)) == OURS
    assert place_engine("CPU", 1, {ENGINE_CPUS_ENV: "zero"}) is None
