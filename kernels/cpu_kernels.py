"""The project's C++ CPU kernels: build, load, and the torch references they must match.

Ops in one library (`llm_cpu`), all fp32, AVX2 + FMA (the linear tiles AVX-512 where the CPU has it),
threaded with torch's intra-op threads:
- `llm_cpu::linear(x (M, K), packed_weight, n, bias (n,)?, residual (M, n)?) -> (M, n)` (cpu_linear.cpp):
  the matmuls of decode steps and short prefill chunks, M <= MAX_LINEAR_ROWS (above, oneDNN's GEMM is
  faster: long prefills), with the (n, K) weight packed once by
  `llm_cpu::pack_linear_weight(weight) -> (ceil(n / 32), K, 32)`, or, where the weight is exactly Q4 or
  Q8 (what a Q4_1 / Q8_0 GGUF dequantizes to), as Q4 / Q8 panels by `pack_q4_weight` / `pack_q8_weight`
  (a fifth / a quarter of the bytes; the same results, bit for bit). Reference: `linear_ref`.
- `llm_cpu::paged_decode(q (B, H, D), k_cache, v_cache (NB, BS, KVH, D), block_tables (B, max_blocks) int32,
  seq_lens (B,) int32, scale) -> (B, H, D)` (cpu_paged_attention.cpp): decode attention straight from
  the paged cache. Reference: kernels.reference.paged_attention_decode_ref. `paged_attention_decode_cpu`
  is the CPU decode entry point backend.attention dispatches to.
- `llm_cpu::paged_prefill(q (T, H, D), k_cache, v_cache, block_tables (B, max_blocks) int32, query_start_loc
  (B + 1,) int32, seq_lens (B,) int32, scale) -> (T, H, D)` (cpu_paged_prefill.cpp): ragged causal prefill
  attention over cached prefix + new tokens, head_dim % 32 == 0. Reference: kernels.reference.paged_prefill_ref;
  `paged_prefill_cpu` is the CPU prefill entry point.
- `llm_cpu::rms_norm`, `llm_cpu::rope_store_kv`, `llm_cpu::silu_mul` (cpu_layer_ops.cpp): a layer's
  element-wise steps, one op each instead of ~40 small torch ops per layer. References: `rms_norm_ref`,
  `rope_store_kv_ref`, `silu_mul_ref`. With them `llm_cpu::argmax_rows` (the sampler's greedy choice;
  reference torch.argmax) and `llm_cpu::logsumexp_rows` (the logprobs' normalizer; reference torch.logsumexp).
- `llm_cpu::decoder_layer` (cpu_decoder_layer.cpp): a whole decoder layer of a decode-only step, the ops
  above called from C++ in LlamaDecoderLayer.forward's order (its reference: that forward itself).

`load()` builds and loads the library, explicitly: the engine calls it when it starts, tests and
benchmarks that build a model themselves call it first. After it, `linear()`, `paged_decode()`,
`paged_prefill()`, `decoder_layer()` and `layer_ops()` return the ops; they return None before it and
where the library cannot run (a CPU without AVX2, no C++ compiler, a failed build, LLM_CPU_KERNELS=0).
Callers then use torch.

Built with torch.utils.cpp_extension into `$LLM_CACHE_DIR/cpu_kernels` (default
`<repo>/.cache/cpu_kernels`): tens of seconds once, then milliseconds per process (rebuilt when a source
changes). `make test` and `make serve` build it up front (`python -m kernels.cpu_kernels`), so neither
a test nor the Triton model's start waits for the compiler.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import reference

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "cpu_linear.cpp",
        "cpu_linear_avx512.cpp",
        "cpu_paged_attention.cpp",
        "cpu_paged_attention_avx512.cpp",
        "cpu_paged_prefill.cpp",
        "cpu_paged_prefill_avx512.cpp",
        "cpu_layer_ops.cpp",
        "cpu_decoder_layer.cpp",
    )
]
CpuLinear = Callable[..., torch.Tensor]
# Above this many rows oneDNN's packed GEMM beats the linear kernel's tiles (benchmarks/cpu_linear_bench.py
# finds the crossover; figures in docs/kernels.md).
MAX_LINEAR_ROWS = 160


def build_dir() -> Path:
    return Path(os.environ.get("LLM_CACHE_DIR") or SOURCES[0].parents[1] / ".cache") / "cpu_kernels"


@dataclass(frozen=True, slots=True)
class LayerOps:
    """cpu_layer_ops.cpp's ops (signatures: their references below)."""

    rms_norm: Callable[..., torch.Tensor]
    rope_store_kv: Callable[..., torch.Tensor]
    silu_mul: Callable[..., torch.Tensor]
    argmax_rows: Callable[..., torch.Tensor]  # reference: torch.argmax(x, dim=-1)
    logsumexp_rows: Callable[..., torch.Tensor]  # reference: torch.logsumexp(x, dim=-1)


@dataclass(frozen=True, slots=True)
class CpuKernels:
    """The loaded library's ops."""

    linear: CpuLinear
    paged_decode: Callable[..., torch.Tensor]
    paged_prefill: Callable[..., torch.Tensor]
    decoder_layer: Callable[..., torch.Tensor]
    layer_ops: LayerOps


# load()'s result: a plain global, which torch.compile's tracing reads as a constant. Nothing else in
# this module builds or loads; before load() (or where it failed) every accessor answers None.
_kernels: CpuKernels | None = None
_load_attempted = False


def load() -> bool:
    """Builds the library if its sources changed (seconds to a minute; once per machine) and loads it.
    The one place that does: the engine calls it at start, `python -m kernels.cpu_kernels` ahead of
    `make test` / `make serve`, the test suite's conftest, benchmarks that build a model themselves.
    Later calls return the first answer. False, with the reason logged, where it cannot be loaded."""
    global _kernels, _load_attempted
    if not _load_attempted:
        _load_attempted = True
        if _build():
            ops = torch.ops.llm_cpu
            _kernels = CpuKernels(
                linear=ops.linear.default,
                paged_decode=ops.paged_decode.default,
                paged_prefill=ops.paged_prefill.default,
                decoder_layer=ops.decoder_layer.default,
                layer_ops=LayerOps(
                    ops.rms_norm.default,
                    ops.rope_store_kv.default,
                    ops.silu_mul.default,
                    ops.argmax_rows.default,
                    ops.logsumexp_rows.default,
                ),
            )
    return _kernels is not None


def _build() -> bool:
    if os.environ.get("LLM_CPU_KERNELS", "1") == "0":
        return False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        logger.info("no AVX2 on this CPU: the C++ CPU kernels are not built, torch runs instead")
        return False
    try:
        from torch.utils.cpp_extension import load as build_extension

        build_dir().mkdir(parents=True, exist_ok=True)
        with _ninja_on_path():
            build_extension(
                name="llm_cpu_kernels",
                sources=[str(s) for s in SOURCES],
                build_directory=str(build_dir()),
                extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
            )
    except Exception as exc:  # noqa: BLE001 - any build failure leaves the torch paths, which are correct
        logger.warning("C++ CPU kernels not built (%s: %s); torch runs instead", type(exc).__name__, exc)
        return False
    # Shapes for torch.compile's tracing.
    torch.library.register_fake("llm_cpu::linear")(
        lambda x, packed_weight, n, bias=None, residual=None: x.new_empty(x.shape[0], n)
    )
    torch.library.register_fake("llm_cpu::paged_decode")(lambda q, *args: torch.empty_like(q))
    torch.library.register_fake("llm_cpu::paged_prefill")(lambda q, *args: torch.empty_like(q))
    torch.library.register_fake("llm_cpu::rms_norm")(lambda x, weight, eps: torch.empty_like(x))
    torch.library.register_fake("llm_cpu::rope_store_kv")(
        lambda qkv, cos, sin, k_cache, v_cache, slots, H, KVH: qkv.new_empty(qkv.shape[0], H, k_cache.shape[-1])
    )
    torch.library.register_fake("llm_cpu::argmax_rows")(lambda x: x.new_empty(x.shape[0], dtype=torch.int64))
    torch.library.register_fake("llm_cpu::logsumexp_rows")(lambda x: x.new_empty(x.shape[0]))
    torch.library.register_fake("llm_cpu::silu_mul")(
        lambda gate_up: gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    )
    return True


def linear() -> CpuLinear | None:
    """`llm_cpu::linear(x, packed_weight, n, bias=None, residual=None)`, or None where not loaded."""
    return None if _kernels is None else _kernels.linear


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight (N, K) -> the (ceil(N / 32), K, 32) panels `linear()` takes (needs the library loaded)."""
    return torch.ops.llm_cpu.pack_linear_weight(weight.contiguous())


Q4_BLOCK = 32  # k per Q4 block (cpu_linear_tiles.h: kQ4Block)
# Up to this many rows the Q4 panels beat the fp32 ones (they read a fifth of the bytes, but turn every
# q into a weight: arithmetic that more rows make the bound); benchmarks/cpu_linear_bench.py's kernel_q4.
Q4_MAX_ROWS = 10
# The same for Q8 panels (1.125 bytes a weight; measured on SmolLM2's lm_head: docs/kernels.md).
Q8_MAX_ROWS = 6


def q4_panels_on() -> bool:
    """Whether Linear makes Q4 / Q8 panels: the library is loaded and LLM_Q4_PANELS is not 0 (read at each
    call)."""
    return _kernels is not None and os.environ.get("LLM_Q4_PANELS", "1") != "0"


def pack_quantized_weight(weight: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(Q4 or Q8 panels, the most rows they are read for) where the weight is exactly one of them; else None."""
    for pack, max_rows in ((pack_q4_weight, Q4_MAX_ROWS), (pack_q8_weight, Q8_MAX_ROWS)):
        panels = pack(weight)
        if panels is not None:
            return panels, max_rows
    return None


def _blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """weight (N, K) as (N, K / 32, 32), its runs of 32 k; None where it cannot be Q4 / Q8 panels (not fp32 on
    the CPU, or K not a multiple of 32)."""
    N, K = weight.shape
    if K % Q4_BLOCK or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    return weight.detach().reshape(N, K // Q4_BLOCK, Q4_BLOCK)


def pack_q8_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """weight (N, K) -> Q8 panels, uint8 (ceil(N / 32), K / 32, 1152), when every run of 32 k of each row is
    exactly d * q (fp32 d, q in -127..127: what a Q8_0 GGUF dequantizes to, d an fp16 value; d * q is exact
    in fp32); None for any other weight. Checked bit for bit, as pack_q4_weight."""
    w = _blocks(weight)  # (N, blocks, 32)
    if w is None:
        return None
    N, nb, _ = w.shape
    d = (w.abs().amax(-1, keepdim=True) / 127).half().float()  # the block's largest |q| is 127
    q = torch.where(d > 0, torch.round(w / torch.where(d > 0, d, 1.0)), 0.0).clamp_(-127, 127)
    if not torch.equal((d * q).view(torch.int32), w.view(torch.int32)):
        return None
    P = -(-N // 32)
    pad = P * 32 - N
    d = F.pad(d.reshape(N, nb), (0, 0, 0, pad)).view(P, 32, nb).transpose(1, 2).contiguous()  # (P, nb, 32) fp32
    q = F.pad(q.reshape(N, nb, Q4_BLOCK), (0, 0, 0, 0, 0, pad)).to(torch.int8).view(P, 32, nb, Q4_BLOCK)
    q = q.permute(0, 2, 3, 1).reshape(P, nb, Q4_BLOCK * 32)  # (P, nb, k * column)
    return torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1).contiguous()  # (P, nb, 1152)


def pack_q4_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """weight (N, K) -> the Q4 panels `linear()` also takes, uint8 (ceil(N / 32), K / 32, 768), when every
    run of 32 k of each row is exactly d * q + m (fp32 d and m, q in 0..15: what a Q4_1 GGUF dequantizes
    to, d and m being fp16 values); None for any other weight. `linear()` returns the same bits from
    either packing; this one reads 0.75 bytes per weight instead of 4. Checked bit for bit here: a weight
    is packed only if d * q + m rebuilds every one of its values (K a multiple of 32)."""
    w = _blocks(weight)  # (N, blocks, 32)
    if w is None:
        return None
    N, nb, _ = w.shape
    m = w.amin(-1, keepdim=True)  # q = 0 is the block's least value
    d = ((w.amax(-1, keepdim=True) - m) / 15).half().float()  # q = 15 its greatest; d is an fp16 value
    q = torch.where(d > 0, torch.round((w - m) / torch.where(d > 0, d, 1.0)), 0.0).clamp_(0, 15)
    rebuilt = d * q + m  # d * q is exact in fp32: one rounding, as fma(d, q, m) in the kernel
    if not torch.equal(rebuilt.view(torch.int32), w.view(torch.int32)):
        return None
    P = -(-N // 32)
    pad = P * 32 - N  # zero columns past N: d = m = q = 0
    d, m, q = (F.pad(t.reshape(N, -1), (0, 0, 0, pad)) for t in (d, m, q))
    scales = torch.cat([t.view(P, 32, nb).transpose(1, 2) for t in (d, m)], dim=-1).contiguous()  # (P, nb, 64) fp32
    q = q.to(torch.uint8).view(P, 32, nb, Q4_BLOCK).permute(0, 2, 3, 1)  # (P, nb, k, column)
    nibbles = (q[..., :16] | (q[..., 16:] << 4)).reshape(P, nb, Q4_BLOCK * 16)  # byte i: column i, i + 16
    return torch.cat([scales.view(torch.uint8), nibbles], dim=-1).contiguous()  # (P, nb, 768)


def paged_decode() -> Callable[..., torch.Tensor] | None:
    return None if _kernels is None else _kernels.paged_decode


def paged_prefill() -> Callable[..., torch.Tensor] | None:
    return None if _kernels is None else _kernels.paged_prefill


def decoder_layer() -> Callable[..., torch.Tensor] | None:
    """`llm_cpu::decoder_layer` (cpu_decoder_layer.cpp; arguments: backend.layers.run_decoder_layer)."""
    return None if _kernels is None else _kernels.decoder_layer


def layer_ops() -> LayerOps | None:
    return None if _kernels is None else _kernels.layer_ops


def layer_ops_for(*tensors: torch.Tensor) -> LayerOps | None:
    """layer_ops() where every tensor is a contiguous CPU fp32 one, outside torch.compile's tracing
    (a compiled graph fuses these steps itself); else None (the caller runs torch)."""
    if _kernels is None or torch.compiler.is_compiling():
        return None
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
            return None
    return _kernels.layer_ops


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (T, C), weight (C,) -> x * weight / sqrt(mean(x^2) + eps): (T, C)."""
    return F.rms_norm(x, weight.shape, weight, eps)


def rope_store_kv_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """qkv (T, (H + 2 KVH) * D) rows [q heads | k heads | v heads]; cos, sin (T, D) (sin signed as in
    backend.layers.rope_tables); caches (NB, BS, KVH, D); slot_mapping (T,) int64.
    Rotates q and k, stores k and v at their slots (negative: skipped) -> rotated q (T, H, D)."""
    T, H, KVH, D = qkv.shape[0], num_heads, num_kv_heads, k_cache.shape[-1]
    x = qkv.view(T, H + 2 * KVH, D)  # (T, heads, D)
    cos, sin = cos.reshape(T, 1, D), sin.reshape(T, 1, D)
    qk = reference.apply_rope(x[:, : H + KVH], cos, sin)  # (T, H + KVH, D)
    reference.store_kv_ref(qk[:, H:], x[:, H + KVH :], k_cache, v_cache, slot_mapping)
    return qk[:, :H].contiguous()  # (T, H, D)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2F) -> silu(gate) * up (T, F)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x (M, K) @ weight (N, K).T (+ bias (N,)) (+ residual (M, N)) -> (M, N)."""
    y = x @ weight.T  # (M, N)
    if bias is not None:
        y = y + bias
    return y if residual is None else y + residual


def paged_attention_decode_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    plan: reference.DecodePlan | None = None,
) -> torch.Tensor:
    """paged_attention_decode_ref's contract (q (B, H, D) -> (B, H, D)): the C++ kernel for fp32 with
    unit head_dim stride where it is built, the reference (with its `plan`) otherwise."""
    op = paged_decode()
    if op is None or q.dtype != torch.float32 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return reference.paged_attention_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, plan=plan)
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    return op(q, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_prefill_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """paged_prefill_ref's contract (q (T, H, D) -> (T, H, D)): the C++ kernel for fp32, head_dim % 32 == 0
    and unit head_dim stride where it is built, the reference otherwise."""
    op = paged_prefill()
    if (
        op is None
        or q.dtype != torch.float32
        or q.shape[-1] % 32 != 0
        or k_cache.stride(-1) != 1
        or v_cache.stride(-1) != 1
    ):
        return reference.paged_prefill_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
    return op(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """cpp_extension runs `ninja` from PATH; the venv's ninja (requirements.txt) is not on it unless the
    venv is activated. PATH is extended for the build only."""
    if shutil.which("ninja") is not None:
        yield
        return
    import ninja

    path = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


if __name__ == "__main__":  # `python -m kernels.cpu_kernels`: build now (the Makefile does, before tests and serving)
    logging.basicConfig(level=logging.INFO)
    print("llm_cpu kernels", "ready" if load() else "unavailable: torch runs instead")
