"""Triton's entry point for every model whose config.pbtxt says `backend: "llm"` (triton_backend/__init__.py).

python_backend's stub runs the base interpreter with a sys.path of its own (it does not read PYTHONPATH), so
importing this file puts this checkout and its venv's site-packages on it: at import, because the stub loads
numpy (through triton_python_backend_utils) right after this file and before `initialize`, and its bindings
need the venv's numpy (<2). Nothing else happens at import; the project loads in `initialize`.
"""

import os
import site
import sys
from pathlib import Path


def add_project_to_sys_path() -> None:
    """This checkout (found through the link Triton loads this file by) and its venv, ahead of the base
    interpreter's site-packages. The launcher may name the site-packages in LLM_SERVING_SITE_PACKAGES."""
    repo_root = Path(__file__).resolve().parents[1]
    site_packages = os.environ.get("LLM_SERVING_SITE_PACKAGES") or next(
        iter(sorted((repo_root / ".venv" / "lib").glob("python3*/site-packages"))), None
    )
    if site_packages and str(site_packages) not in sys.path:
        before = list(sys.path)
        site.addsitedir(str(site_packages))  # (also runs the venv's .pth files)
        sys.path[:] = [p for p in sys.path if p not in before] + [p for p in before if p != str(site_packages)]
    if str(repo_root) not in sys.path:
        sys.path.insert(0, str(repo_root))


add_project_to_sys_path()


class TritonPythonModel:
    def initialize(self, args):
        from triton_backend.adapter import EngineAdapter

        self.adapter = EngineAdapter(args)

    def execute(self, requests):
        return self.adapter.execute(requests)

    def finalize(self):
        self.adapter.finalize()
