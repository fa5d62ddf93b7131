"""The tools `make perf` and `make genai-perf` run, installed on first use (scripts/perf_tools.py).

The tools live in `.tools/` (gitignored), apart from the project's venv, whose pins they would clash
with (perf_analyzer comes from tritonclient 2.50.0, the last wheel whose binary runs on glibc 2.36;
the frontend uses a newer tritonclient):

- `.tools/venv/`: tritonclient==2.50.0 (its `bin/perf_analyzer`), genai-perf==0.0.16 and
  nvidia-cuda-runtime-cu12 (perf_analyzer links `libcudart.so.12`; loading it needs no GPU);
- `.tools/lib/libb64.so.0d`: perf_analyzer also links libb64. The nvidia-pytriton wheel the
  project already installs carries a copy (`nvidia_pytriton.libs/libb64-<hash>.so.0d`); without it,
  Debian's `libb64-0d` is installed with apt-get;
- `.tools/tokenizer/`: the model's tokenizer as a Hugging Face folder (genai-perf counts tokens with
  it and cannot fetch one from a hub), exported from the GGUF by `backend/checkpoint.py`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TOOLS = REPO_ROOT / ".tools"
TOOLS_VENV = TOOLS / "venv"
TOOLS_LIB = TOOLS / "lib"
TOKENIZER_DIR = TOOLS / "tokenizer"
PERF_INPUT = REPO_ROOT / "benchmarks" / "perf_input.json"
DEFAULT_MODEL = "smollm2-135m-instruct"

# The tools' venv, pinned as resolved here (`pip freeze` of a venv with the three top-level ones).
TOOLS_REQUIREMENTS = """\
tritonclient==2.50.0
genai-perf==0.0.16
nvidia-cuda-runtime-cu12==12.9.79
alembic==1.20.1
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
certifi==2026.10.19.post1
cffi==2.1.1
charset-normalizer==3.5.3
choreographer==1.4.0
click==8.5.1
colorlog==6.12.0
cramjam==2.14.0
fastparquet==2026.9.0
filelock==4.3.1
formulaic==1.2.2
fsspec==2026.9.0
h11==0.16.0
hf-xet==1.8.0
httpcore2==2.16.2
httpx2==2.16.2
huggingface_hub==2.4.0
idna==3.20
iniconfig==2.3.1
interface_meta==2.0.1
Jinja2==3.1.6
kaleido==1.5.1
logistro==2.0.1
Mako==1.4.3
markdown-it-py==4.3.0
MarkupSafe==3.0.4
mdurl==0.1.2
narwhals==2.29.0
numpy==1.26.4
optuna==3.6.1
orjson==3.13.0
packaging==26.4
pandas==3.0.6
patsy==1.0.3
perf_analyzer==0.1.0
pillow==13.0.0
platformdirs==4.14.9
plotly==7.1.0
pluggy==1.7.0
pyarrow==26.0.1
pycparser==3.12
pydantic==2.14.4
pydantic_core==2.50.5
Pygments==2.21.0
pytest==9.2.0
pytest-mock==3.17.0
python-dateutil==4.0.0
python-rapidjson==1.25
PyYAML==6.0.4
regex==2026.11.19
requests==2.34.2
responses==0.26.3
rich==15.0.0
safetensors==0.8.0
scipy==1.17.1
shellingham==1.5.4
simplejson==4.3.0
soundfile==0.14.0
SQLAlchemy==2.1.9
statsmodels==0.15.0
tokenizers==0.23.3
tqdm==4.70.1
transformers==5.24.0
truststore==0.10.5
typer==0.29.2
typing-inspection==0.4.5
typing_extensions==4.16.0
tzdata==2026.6
urllib3==2.8.0
wrapt==2.5.2
"""


class ToolError(RuntimeError):
    """Something the user has to act on; printed without a traceback."""


class ServerNotRunning(ToolError):
    pass


def log(message: str) -> None:
    print(f"[perf_tools] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ install


def _tools_python() -> Path:
    return TOOLS_VENV / "bin" / "python"


def perf_analyzer_binary() -> Path:
    return TOOLS_VENV / "bin" / "perf_analyzer"


def _tools_site_packages() -> Path:
    out = subprocess.run(
        [str(_tools_python()), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def ensure_tools_venv() -> None:
    """Create `.tools/venv` and install the pinned tools, again only when the pins change."""
    ensure_pinned_venv(
        TOOLS_VENV,
        TOOLS_REQUIREMENTS,
        TOOLS / "requirements.txt",
        perf_analyzer_binary(),
        "tritonclient 2.50.0 (perf_analyzer), genai-perf 0.0.16, nvidia-cuda-runtime-cu12 "
        "into .tools/venv (about 1 GB, once)",
    )


def ensure_pinned_venv(
    venv: Path,
    requirements: str,
    requirements_file: Path,
    binary: Path,
    what: str,
    pip_env: dict[str, str] | None = None,
) -> None:
    """A venv of the base interpreter holding exactly `requirements`; (re)installed only when the pins
    change (a stamp named by their hash) or `binary` is missing."""
    digest = hashlib.sha256(requirements.encode()).hexdigest()[:16]
    stamp = venv / f".installed-{digest}"
    if stamp.exists() and binary.exists():
        return
    venv.parent.mkdir(exist_ok=True)
    python = venv / "bin" / "python"
    if not python.exists():
        # The base interpreter, not the project's venv: a tools' venv must see none of its packages.
        base = getattr(sys, "_base_executable", None) or sys.executable
        log(f"creating {venv.relative_to(REPO_ROOT)} with {base}")
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
    requirements_file.write_text(requirements)
    log(f"installing {what}")
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r", str(requirements_file)],
        check=True,
        env=pip_env,
    )
    for old in venv.glob(".installed-*"):
        old.unlink()
    stamp.touch()


def _find_pytriton_libb64() -> Path | None:
    """The copy of libb64 inside the nvidia-pytriton wheel (installed in the project's venv)."""
    folders = [
        Path(sysconfig.get_paths()["purelib"]) / "nvidia_pytriton.libs",
        *(REPO_ROOT / ".venv" / "lib").glob("python3*/site-packages/nvidia_pytriton.libs"),
    ]
    for folder in folders:
        found = sorted(folder.glob("libb64*.so.0d")) if folder.is_dir() else []
        if found:
            return found[0]
    return None


def _system_has(soname: str) -> bool:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return False
    return soname in out


def ensure_libb64() -> None:
    target = TOOLS_LIB / "libb64.so.0d"
    if target.exists():
        return
    TOOLS_LIB.mkdir(parents=True, exist_ok=True)
    found = _find_pytriton_libb64()
    if found is not None:
        shutil.copy2(found, target)  # a copy, not a link: survives a rebuilt .venv
        log(f"libb64.so.0d: copied from {found}")
        return
    if _system_has("libb64.so.0d"):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ToolError("perf_analyzer needs libb64.so.0d: install Debian's libb64-0d (apt-get install libb64-0d)")
    log("libb64.so.0d: installing Debian's libb64-0d with apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "libb64-0d"]
    if subprocess.run(cmd, env=env, check=False).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, check=True)
        subprocess.run(cmd, env=env, check=True)


def tools_env() -> dict[str, str]:
    """Environment for perf_analyzer and genai-perf: their venv first on PATH, their libraries, offline hub."""
    cudart = _tools_site_packages() / "nvidia" / "cuda_runtime" / "lib"
    libs = [str(TOOLS_LIB), str(cudart)]
    if os.environ.get("LD_LIBRARY_PATH"):
        libs.append(os.environ["LD_LIBRARY_PATH"])
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    env.update(
        PATH=os.pathsep.join([str(TOOLS_VENV / "bin"), env.get("PATH", "")]),
        LD_LIBRARY_PATH=os.pathsep.join(libs),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        COLUMNS=env.get("COLUMNS", "160"),  # genai-perf's rich table: wide enough to read
    )
    return env


def ensure_tokenizer() -> Path:
    """The model's tokenizer as a HF folder (tokenizer.json + tokenizer_config.json) for genai-perf."""
    if (TOKENIZER_DIR / "tokenizer.json").is_file():
        return TOKENIZER_DIR
    log(f"exporting the model's tokenizer to {TOKENIZER_DIR.relative_to(REPO_ROOT)}")
    sys.path.insert(0, str(REPO_ROOT))
    from backend.checkpoint import load_checkpoint  # the project's venv; reads/writes the .cache/ checkpoint

    tmp = TOKENIZER_DIR.with_name(f"tokenizer.tmp-{os.getpid()}")
    load_checkpoint("smollm2").tokenizer.save(tmp)
    shutil.rmtree(TOKENIZER_DIR, ignore_errors=True)
    tmp.rename(TOKENIZER_DIR)
    return TOKENIZER_DIR


def install(tokenizer: bool = True) -> None:
    ensure_tools_venv()
    ensure_libb64()
    result = subprocess.run(
        [str(perf_analyzer_binary()), "--version"], env=tools_env(), capture_output=True, text=True, check=False
    )
    if result.returncode != 0 or "Perf Analyzer" not in result.stdout + result.stderr:
        raise ToolError(f"perf_analyzer does not start:\n{result.stdout}{result.stderr}")
    if tokenizer:
        ensure_tokenizer()
