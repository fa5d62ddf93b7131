"""The stub supervisor: brings back a model whose Python-backend stub (its engine process) died."""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scripts.servers import TritonServer

log = logging.getLogger("servers")


def stub_processes(parent_pid: int) -> dict[int, str]:
    """The Python-backend stubs tritonserver `parent_pid` runs: pid -> model name (its folder's name)."""
    stubs: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != parent_pid:
                continue
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if argv and argv[0].endswith(b"triton_python_backend_stub") and len(argv) > 1:
            stubs[int(entry)] = Path(argv[1].decode()).parents[1].name
    return stubs


class StubSupervisor:
    """Brings back a model whose Python-backend stub died, through Triton's model-control API.

    Triton does not restart the stub of a decoupled model: the model stays READY, its requests hang
    and new ones fail. So this watches the stubs (children of tritonserver) twice a second; when a
    READY model has lost one, it unloads the model (Triton then reports it not ready) and loads it
    again (a fresh stub and engine, the time of a model load). tritonserver must run with
    `--model-control-mode=explicit`. The frontend ends the streams the dead engine held (its engine
    watchdog); unloading does not wait for them.
    """

    def __init__(self, server: TritonServer, interval_s: float = 0.5) -> None:
        self.server, self.interval_s = server, interval_s
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stub-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(10)

    def _run(self) -> None:
        proc = self.server.proc
        assert proc is not None
        known = stub_processes(proc.pid)
        while not self._stop.wait(self.interval_s) and proc.poll() is None:
            current = stub_processes(proc.pid)
            lost = {model for pid, model in known.items() if pid not in current}
            for model in sorted(lost):
                if self._stop.is_set() or self.server.model_state(model) != "READY":
                    continue  # unloaded on purpose, or already being reloaded
                log.error("the stub of model %s died: reloading the model", model)
                print(f"[servers] the engine process of {model} died; reloading it", file=sys.stderr, flush=True)
                try:
                    self.server.model_control(model, "unload")
                    self.server.model_control(model, "load", timeout=600)
                    self.restarts += 1
                    print(f"[servers] {model} reloaded", file=sys.stderr, flush=True)
                except OSError as e:
                    log.error("reloading %s failed: %s", model, e)
            known = stub_processes(proc.pid) if lost else current
