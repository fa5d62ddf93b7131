"""Start and stop the real tritonserver and the OpenAI frontend as child processes.

Used by `make serve` (scripts/serve.py), by the end-to-end tests and by the benchmarks, so all
three run the servers the same way. The tritonserver binary and the Python backend come from the
`nvidia-pytriton` wheel (we never import pytriton): see ../shared/notes/triton-on-cpu.md.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
DEFAULT_MODEL = "smollm2-135m-instruct"


def _site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path
    library_path: str  # LD_LIBRARY_PATH for the binary and the Python backend stub

    @classmethod
    def find(cls) -> TritonInstall:
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

    def ensure_stub(self) -> None:
        """The wheel ships one Python backend stub per Python version beside the backend, not in it."""
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = self.backend_dir.parent / "python_backend_stubs" / version / "triton_python_backend_stub"
        target = self.backend_dir / "python" / "triton_python_backend_stub"
        if not target.exists():
            shutil.copy2(stub, target)
        target.chmod(0o755)
        self.binary.chmod(0o755)


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

    def _spawn(self, cmd: list[str], env: dict[str, str], log_path: Path | None) -> None:
        self.log_path = log_path
        out = open(log_path, "wb") if log_path else None  # noqa: SIM115 (closed by the child's exit)
        # A new session, so Ctrl-C in `make serve` reaches us first and we stop children in order.
        self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                     start_new_session=True, cwd=REPO_ROOT)

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
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class TritonServer(_Process):
    name = "tritonserver"

    def __init__(self, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 model_repository: Path = MODEL_REPOSITORY, extra_env: dict[str, str] | None = None) -> None:
        super().__init__()
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.model_repository = model_repository
        self.extra_env = extra_env or {}

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, log_path: Path | None = None, timeout: float = 180.0) -> TritonServer:
        install = TritonInstall.find()
        install.ensure_stub()
        env = dict(os.environ, LD_LIBRARY_PATH=install.library_path, **self.extra_env)
        # The stub imports numpy before model.py runs, so the venv (numpy<2) must precede the base
        # interpreter's site-packages from the start: PYTHONPATH does that. model.py also puts
        # the venv first itself, in case a stub ignores PYTHONPATH.
        env["PYTHONPATH"] = os.pathsep.join([str(_site_packages()), str(REPO_ROOT)])
        env["LLM_SERVING_SITE_PACKAGES"] = str(_site_packages())
        env["LLM_SERVING_REPO_ROOT"] = str(REPO_ROOT)
        cmd = [
            str(install.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={install.backend_dir}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--http-address=127.0.0.1",
            "--grpc-address=127.0.0.1",
            "--exit-timeout-secs=5",
            "--log-verbose=0",
        ]
        self._spawn(cmd, env, log_path)
        self.wait_ready(f"http://127.0.0.1:{self.http_port}/v2/health/ready", timeout)
        return self


class Frontend(_Process):
    name = "openai frontend"

    def __init__(self, triton_grpc_url: str, port: int = 9000, host: str = "127.0.0.1",
                 extra_args: list[str] | None = None) -> None:
        super().__init__()
        self.triton_grpc_url, self.port, self.host = triton_grpc_url, port, host
        self.extra_args = extra_args or []

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, log_path: Path | None = None, timeout: float = 60.0) -> Frontend:
        cmd = [sys.executable, "-m", "openai_frontend", "--triton-url", self.triton_grpc_url,
               "--host", self.host, "--port", str(self.port), *self.extra_args]
        self._spawn(cmd, dict(os.environ), log_path)
        self.wait_ready(f"{self.url}/health/ready", timeout)
        return self
