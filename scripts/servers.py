"""Start and stop the real tritonserver and the OpenAI frontend as child processes.

Used by `make serve` (scripts/serve.py), by the end-to-end tests and by the benchmarks, so all
three run the servers the same way. The tritonserver binary and the Python backend come from the
`nvidia-pytriton` wheel (we never import pytriton), or from NVIDIA's Triton container when it is there
(/opt/tritonserver); README.md ("The Triton model") says how it runs without the container.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from backend.cpu_placement import ENGINE_CPUS_ENV, launch_placement
from protocol.wire import CONTROL_KEY_ENV, CONTROL_KEY_HEADER
from scripts.stub_supervisor import StubSupervisor
from triton_backend import BACKEND_NAME

log = logging.getLogger("servers")
REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
DEFAULT_MODEL = "smollm2-135m-instruct"


def control_key() -> str:
    """The key of Triton's model-repository API for every server this process starts: the operator's
    (CONTROL_KEY_ENV, shared by several launchers and frontends) or one made for this process."""
    if not os.environ.get(CONTROL_KEY_ENV):
        os.environ[CONTROL_KEY_ENV] = secrets.token_urlsafe(24)  # (the frontends it starts inherit it)
    return os.environ[CONTROL_KEY_ENV]


def copy_model_repository(folder: Path, added: dict[str, str] | None = None, **settings: str) -> Path:
    """The default model's repository copied into `folder`, its config.pbtxt parameters (or `instance_group`)
    in `settings` replaced and the parameters in `added` (absent from it) added: for tests and benchmarks
    that need other engine settings."""
    shutil.copytree(MODEL_REPOSITORY / DEFAULT_MODEL, folder / DEFAULT_MODEL)
    config = folder / DEFAULT_MODEL / "config.pbtxt"
    text = config.read_text()
    for key, value in settings.items():
        if key == "instance_group":
            text, count = re.subn(r"instance_group \[.*\]", f"instance_group [ {value} ]", text)
        else:
            text, count = re.subn(rf'(key: "{key}" value: {{ string_value: )"[^"]*"', rf'\1"{value}"', text)
        if count != 1:
            raise ValueError(f"config.pbtxt has no single {key!r} to replace")
    for key, value in (added or {}).items():
        text += f'\nparameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
    config.write_text(text + "\n")
    return folder


def _site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path
    library_path: str  # LD_LIBRARY_PATH for the binary and the Python backend stub

    @classmethod
    def find(cls) -> TritonInstall:
        ngc = Path("/opt/tritonserver")
        if (ngc / "bin" / "tritonserver").exists():  # NVIDIA's Triton container (docker/Dockerfile.gpu)
            return cls(ngc / "bin" / "tritonserver", ngc / "backends", os.environ.get("LD_LIBRARY_PATH", ""))
        site = _site_packages()
        root = site / "pytriton" / "tritonserver"
        binary = root / "bin" / "tritonserver"
        if not binary.exists():
            raise FileNotFoundError(f"{binary} not found: run `make venv` (installs nvidia-pytriton --no-deps)")
        # The stub runs the base interpreter found through LD_LIBRARY_PATH: the Python we run
        # under comes first, before any system libpython of another patch release.
        python_lib = sysconfig.get_config_var("LIBDIR") or ""
        libs = [python_lib, str(site / "nvidia_pytriton.libs")]
        existing = os.environ.get("LD_LIBRARY_PATH", "")
        return cls(binary, root / "backends", ":".join([p for p in libs if p] + ([existing] if existing else [])))

    def ensure_backends(self) -> None:
        """Our backend linked in, and the Python backend stub for this Python: the wheel ships one per version
        beside the backend, not in it."""
        self.link_backend()
        if (self.backend_dir / "python" / "triton_python_backend_stub").exists() and os.access(self.binary, os.X_OK):
            return
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = self.backend_dir.parent / "python_backend_stubs" / version / "triton_python_backend_stub"
        target = self.backend_dir / "python" / "triton_python_backend_stub"
        if not target.exists():
            shutil.copy2(stub, target)
        target.chmod(0o755)
        self.binary.chmod(0o755)

    def link_backend(self) -> None:
        """Our Triton backend (triton_backend/) in the backend directory, as a link to this checkout: Triton
        runs `<backend-directory>/llm/model.py` for the models whose config.pbtxt says `backend: "llm"`."""
        link, target = self.backend_dir / BACKEND_NAME, REPO_ROOT / "triton_backend"
        if link.is_symlink() and link.resolve() == target.resolve():
            return
        if link.is_symlink():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


class _Process:
    name = "process"

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    def _spawn(
        self,
        cmd: list[str],
        env: dict[str, str],
        log_path: Path | None,
        cwd: Path = REPO_ROOT,
        cpus: list[int] | None = None,
    ) -> None:
        """`cpus`: the CPUs the process (and every thread and child it starts) may run on; default all ours."""
        self.log_path = log_path
        out = open(log_path, "wb") if log_path else None  # noqa: SIM115 (closed by the child's exit)
        # A new session, so Ctrl-C in `make serve` reaches us first and we stop children in order.
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
            cwd=cwd,
            # (Set in the child before exec, so that no thread of it starts with a wider mask.)
            preexec_fn=None if cpus is None else (lambda: os.sched_setaffinity(0, cpus)),
        )

    def log_tail(self, chars: int = 4000) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def wait_ready(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if _http_ok(url):
                return
            time.sleep(0.25)
        raise TimeoutError(f"{self.name} not ready at {url} after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        # Children (tritonserver's Python-backend stubs) share the process group we started; one
        # left behind by a server that died hard would keep its engine and memory.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


class TritonServer(_Process):
    name = "tritonserver"

    def __init__(
        self,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        model_repository: Path = MODEL_REPOSITORY,
        extra_env: dict[str, str] | None = None,
        supervise: bool = True,
        address: str = "127.0.0.1",
    ) -> None:
        super().__init__()
        self.address = address  # where its HTTP and gRPC endpoints listen (0.0.0.0 in a container)
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.model_repository = model_repository
        self.extra_env = extra_env or {}
        self.supervise = supervise
        self.supervisor: StubSupervisor | None = None
        self.placement: tuple[int, list[int]] | None = None  # (its CPU, the engine's CPUs), once started

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, log_path: Path | None = None, timeout: float = 180.0) -> TritonServer:
        install = TritonInstall.find()
        install.ensure_backends()
        env = dict(os.environ, LD_LIBRARY_PATH=install.library_path, **self.extra_env)
        # The stub does not read PYTHONPATH: triton_backend/model.py puts these site-packages on its sys.path.
        env["LLM_SERVING_SITE_PACKAGES"] = str(_site_packages())
        # The response's round trip on one core (backend/cpu_placement.py): tritonserver on the first of
        # our CPUs, its stubs told the rest, so the engine thread shares that CPU and its workers do not.
        self.placement = placement = launch_placement(self.model_repository, env)
        if placement is not None:
            env[ENGINE_CPUS_ENV] = ",".join(map(str, placement[1]))
        cmd = [
            str(install.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={install.backend_dir}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--http-address={self.address}",
            f"--grpc-address={self.address}",
            "--exit-timeout-secs=5",
            "--log-verbose=0",
            # Explicit model control, every model loaded at start: the supervisor reloads a model
            # whose engine process died (StubSupervisor). Only a caller with the control key may
            # list, load or unload models: loading a model runs its code.
            "--model-control-mode=explicit",
            "--load-model=*",
            f"--http-restricted-api=model-repository:{CONTROL_KEY_HEADER}={control_key()}",
            f"--grpc-restricted-protocol=model-repository:{CONTROL_KEY_HEADER}={control_key()}",
        ]
        self._spawn(cmd, env, log_path, cpus=None if placement is None else [placement[0]])
        self.wait_ready(f"http://127.0.0.1:{self.http_port}/v2/health/ready", timeout)
        if self.supervise:
            self.supervisor = StubSupervisor(self)
            self.supervisor.start()
        return self

    def stop(self, timeout: float = 20.0) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        super().stop(timeout)

    def model_state(self, model: str) -> str | None:
        """READY, LOADING, UNLOADING, UNAVAILABLE, or None when Triton does not list it."""
        try:
            index = json.loads(self._post("/v2/repository/index", timeout=5))
        except (OSError, ValueError):
            return None
        return next((m.get("state") for m in index if m.get("name") == model), None)

    def model_control(self, model: str, action: str, timeout: float = 60) -> None:
        self._post(f"/v2/repository/models/{model}/{action}", timeout=timeout)

    def _post(self, path: str, timeout: float) -> bytes:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.http_port}{path}",
            data=b"{}",
            headers={"Content-Type": "application/json", CONTROL_KEY_HEADER: control_key()},
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()


class Frontend(_Process):
    name = "openai frontend"

    def __init__(
        self,
        triton_grpc_url: str,
        port: int = 9000,
        host: str = "127.0.0.1",
        extra_args: list[str] | None = None,
        extra_env: dict[str, str] | None = None,
        tree: Path = REPO_ROOT,
    ) -> None:
        super().__init__()
        self.triton_grpc_url, self.port, self.host = triton_grpc_url, port, host
        self.extra_args = extra_args or []
        self.extra_env = extra_env or {}
        self.tree = tree  # the checkout whose openai_frontend runs (benchmarks/frontend_ab.py: another revision)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, log_path: Path | None = None, timeout: float = 60.0) -> Frontend:
        cmd = [
            sys.executable,
            "-m",
            "openai_frontend",
            "--triton-url",
            self.triton_grpc_url,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.extra_args,
        ]
        env = dict(os.environ, **{CONTROL_KEY_ENV: control_key()}, **self.extra_env)
        self._spawn(cmd, env, log_path, cwd=self.tree)
        self.wait_ready(f"{self.url}/health/ready", timeout)
        return self

    def stop(self, timeout: float = 45.0) -> None:
        """SIGTERM: the frontend drains (up to its shutdown grace period, 30 s by default) and exits."""
        super().stop(timeout)


@contextlib.contextmanager
def running_servers(logs: Path, suffix: str = "", **triton_args) -> Iterator[tuple[TritonServer, Frontend]]:
    """tritonserver on free ports (`triton_args` for TritonServer: model_repository, extra_env, ...) and a
    frontend on it, both started, both stopped on leaving; logs: `logs`/tritonserver{suffix}.log and
    frontend{suffix}.log."""
    logs.mkdir(parents=True, exist_ok=True)
    triton = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), **triton_args)
    triton.start(log_path=logs / f"tritonserver{suffix}.log")
    # A fresh state folder: the response store of one run holds nothing another run left unfinished.
    state = tempfile.mkdtemp(prefix="frontend-state-")
    frontend = Frontend(triton.grpc_url, port=free_port(), extra_args=["--state-dir", state])
    try:
        frontend.start(log_path=logs / f"frontend{suffix}.log")
        yield triton, frontend
    finally:
        frontend.stop()
        triton.stop()
