"""The layers models are built from, and how each runs on CPU and GPU.

A model file (backend/models/) says what a layer computes; this module says how: which kernel a
matmul, a norm or a whole decoder layer takes on this device, dtype and batch. Model files call
these layers and never test the device themselves; the one choice they see is `cpu_decoder_layer`,
which offers a whole decoder layer as one C++ op where this step may take it (None elsewhere).

- `Linear`: y = x @ W.T (+ b) (+ residual). On CPU in fp32 it keeps packed copies of W for the
  project's kernel (kernels/cpu_linear.cpp, up to cpu_kernels.MAX_LINEAR_ROWS rows) and for oneDNN
  (longer prefills); elsewhere F.linear.
- `RMSNorm`: the C++ op of kernels/cpu_layer_ops.cpp on CPU where built, a four-op form without it
  or under torch.compile, F.rms_norm elsewhere.
- `silu_mul`: SwiGLU's silu(gate) * up from the stacked (gate | up) projection.
- `rope_tables`: the rotary cos/sin tables for every position.
- `DecoderLayerWeights` + `cpu_decoder_layer`: a whole pre-norm SwiGLU decoder layer of a decode
  step as one C++ call (kernels/cpu_decoder_layer.cpp), the same ops in the same order.

Which path is faster where, and by how much: docs/kernels.md.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from backend.attention import AttentionMetadata
from kernels import cpu_kernels
from kernels.cpu_kernels import CpuLinear

KVCache = tuple[torch.Tensor, torch.Tensor]  # (num_blocks, block_size, KVH, D) each


def parameter(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)  # inference only: weights never need gradients


class Linear(nn.Module):
    """y = x @ W.T (+ b), weights arriving through `load`. On CPU in fp32 three paths:

    - generated tokens' rows (`kernel_rows`, the step's decode rows) and rows of no step (logits): the
      kernel kernels/cpu_linear.cpp on a copy of W packed in 32-column panels, bias and residual added
      in its epilogue, up to cpu_kernels.MAX_LINEAR_ROWS rows a call. Where it could not be built, one
      row runs as a split bmm: W viewed as (S, N/S, K) for S threads, one batched matmul, each thread
      streaming its own slice of W (plain F.linear reads a single row's weights slower);
    - prompt rows, several rows without the kernel, or under torch.compile: W pre-packed for oneDNN
      (torch.ops.mkldnn, what torch.compile's CPU freezing uses).
    Neither path's row results depend on the other rows of the call, so in eager mode a generated token's
    row gets the same bits alone, beside a long prefill or among drafted tokens, and a prompt's rows the
    same bits however the prompt is chunked (speculative decoding and the Responses takeover rely on it).

    So on CPU the weight is held three times (plain, panels, oneDNN's). `.to(...)` drops and rebuilds
    the packed copies. A weight that is exactly d * q + m in every run of 32 k (what a Q4_1 GGUF
    dequantizes to), or d * q (Q8_0), is also held as Q4 or Q8 panels, which the kernel reads for few
    rows (cpu_kernels.Q4_MAX_ROWS, Q8_MAX_ROWS) with the same results, bit for bit, from a fifth or a
    quarter of the bytes (LLM_Q4_PANELS=0: not made).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None, dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))  # (N, K)
        self.bias = parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None  # (N,)
        self._packed: torch.Tensor | None = None  # oneDNN layout of weight (CPU fp32 only)
        self._split: tuple[int, torch.Tensor] | None = None  # (threads, weight viewed as (S, N/S, K))
        self._kernel: CpuLinear | None = None  # kernels/cpu_linear.cpp, where it was built (CPU fp32 only)
        self.panels: torch.Tensor | None = None  # weight packed for it: (ceil(N / 32), K, 32)
        self.quant_panels: torch.Tensor | None = None  # or as Q4 / Q8 panels (uint8), where it is exactly that
        self.quant_max_rows = 0  # up to how many rows they are read

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        assert weight.shape == self.weight.shape, f"weight {tuple(weight.shape)} != {tuple(self.weight.shape)}"
        self.weight.copy_(weight)
        if self.bias is not None:
            assert bias is not None and bias.shape == self.bias.shape, "missing or misshapen bias"
            self.bias.copy_(bias)
        self.repack()

    def repack(self) -> None:
        """Rebuild the packed copies after the weight changed (load, tying, .to())."""
        w = self.weight
        packable = w.device.type == "cpu" and w.dtype == torch.float32 and torch.backends.mkldnn.is_available()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None) if packable else None
        self._split = None
        self._kernel = cpu_kernels.linear() if packable else None
        self.panels = cpu_kernels.pack_linear_weight(w.detach()) if self._kernel is not None else None
        quantize = self._kernel is not None and cpu_kernels.q4_panels_on()
        quantized = cpu_kernels.pack_quantized_weight(w.detach()) if quantize else None
        self.quant_panels, self.quant_max_rows = quantized or (None, 0)
        if packable:
            self._split_weight()
            _PACKED_WEIGHTS[w.data_ptr()] = self._packed
            weakref.finalize(w, _PACKED_WEIGHTS.pop, w.data_ptr(), None)  # no packed copy outlives its weight

    def _split_weight(self) -> None:
        N, K, S = self.out_features, self.in_features, torch.get_num_threads()
        parts = S if N % S == 0 else 1
        self._split = (S, self.weight.view(parts, N // parts, K))  # (S, N/S, K) view

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, kernel_rows: int | None = None
    ) -> torch.Tensor:
        """x (T, K) -> (T, N); with `residual` (T, N), returns residual + x @ W.T in one op.
        kernel_rows: the leading rows that take the kernel (the rest take oneDNN); None: every row."""
        if self._packed is None:
            y = F.linear(x, self.weight, self.bias)  # (T, N)
            return y if residual is None else residual + y
        T = x.shape[0]
        if torch.compiler.is_compiling():
            # A compiled graph serves every batch size >= 2 with one trace, so it must not branch on T there.
            if T == 1 and self._kernel is not None:
                return self._kernel_rows(x, residual)  # (1, N)
            return self._onednn(x, residual, compiling=True)  # (T, N)
        if self._kernel is None:
            return self._one_row(x, residual) if T == 1 else self._onednn(x, residual)  # (T, N)
        k = T if kernel_rows is None else kernel_rows
        if k >= T:
            return self._kernel_rows(x, residual)  # (T, N)
        if k <= 0:
            return self._onednn(x, residual)  # (T, N)
        return torch.cat(
            [
                self._kernel_rows(x[:k], None if residual is None else residual[:k]),  # (k, N)
                self._onednn(x[k:], None if residual is None else residual[k:]),  # (T - k, N)
            ]
        )

    def _kernel_rows(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """x (T, K) -> (T, N) through the kernel, MAX_LINEAR_ROWS rows a call."""
        x = x.contiguous()
        residual = None if residual is None else residual.contiguous()
        num_rows, rows = x.shape[0], cpu_kernels.MAX_LINEAR_ROWS
        if num_rows <= rows:
            return self._kernel(x, self.panels_for(num_rows), self.out_features, self.bias, residual)  # (T, N)
        return torch.cat(
            [
                self._kernel(
                    x[i : i + rows],
                    self.panels_for(min(rows, num_rows - i)),
                    self.out_features,
                    self.bias,
                    None if residual is None else residual[i : i + rows],
                )
                for i in range(0, num_rows, rows)
            ]
        )  # (T, N)

    def _onednn(self, x: torch.Tensor, residual: torch.Tensor | None, compiling: bool = False) -> torch.Tensor:
        """x (T, K) -> (T, N) through oneDNN's packed weight."""
        if compiling:  # inductor cannot lower the oneDNN op itself: an opaque call
            y = packed_linear(x, self.weight)  # (T, N)
            y = y if self.bias is None else y + self.bias
        else:
            y = torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")  # (T, N)
        return y if residual is None else residual + y

    def panels_for(self, rows: int) -> torch.Tensor | None:
        """What the kernel reads for `rows` x rows: the Q4 / Q8 panels where there are any and they are
        faster (few rows: reading the weight is the cost), else the fp32 panels. The same results either way."""
        return self.quant_panels if rows <= self.quant_max_rows else self.panels

    def _one_row(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The split bmm, where the kernel is not built."""
        N, K = self.out_features, self.in_features
        if self._split is None or (not torch.compiler.is_compiling() and self._split[0] != torch.get_num_threads()):
            self._split_weight()  # (a compiled graph keeps the split it was traced with)
        w = self._split[1]
        S = w.shape[0]
        if x.stride(-1) != 1:
            x = x.contiguous()
        # x as a (K, 1) column with strides (1, K), MKL's fast path, shared by the S slices (stride 0).
        col = x.as_strided((S, K, 1), (0, 1, K))  # (S, K, 1)
        if residual is not None and self.bias is None:
            return torch.baddbmm(residual.reshape(S, N // S, 1), w, col).view(1, N)  # (1, N)
        if torch.compiler.is_compiling():
            # Opaque to inductor, which would otherwise fuse this bmm with the element-wise ops
            # around it into its own C++ loop, slower than MKL's at the bandwidth bound.
            y = split_matvec(col, w).view(1, N)  # (1, N)
        else:
            y = torch.bmm(w, col).view(1, N)  # (1, N)
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None else y + residual

    def _apply(self, fn, recurse: bool = True):  # behind .to(), .cuda(), .half(), ...
        self._packed, self._split, self._kernel, self.panels, self.quant_panels = None, None, None, None, None
        super()._apply(fn, recurse)
        self.repack()
        return self

    def extra_repr(self) -> str:
        packed = self._packed is not None
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, packed={packed}"


# oneDNN copies by the data pointer of their plain weight, for `packed_linear` (a compiled graph
# carries the plain weight; an opaque-layout tensor cannot pass through torch.compile's fake tensors).
_PACKED_WEIGHTS: dict[int, torch.Tensor] = {}


@torch.library.custom_op("llm_backend::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (T, K) @ weight (N, K).T through weight's oneDNN-packed copy -> (T, N)."""
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED_WEIGHTS[weight.data_ptr()], None, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("llm_backend::split_matvec", mutates_args=())
def split_matvec(col: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight (S, N/S, K) @ col (S, K, 1) -> (S, N/S, 1): torch.bmm, kept whole under torch.compile."""
    return torch.bmm(weight, col)


@split_matvec.register_fake
def _(col: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return col.new_empty(weight.shape[0], weight.shape[1], 1)


class RMSNorm(nn.Module):
    """x * weight / sqrt(mean(x^2) + eps) over the last dim (weights arrive through `load`).

    On CPU in fp32: the C++ op of kernels/cpu_layer_ops.cpp where it is built; without it, and under
    torch.compile, (x * weight*sqrt(C)) / hypot(||x||, sqrt(C*eps)): the same value (3e-7 relative) in
    four ops instead of F.rms_norm's eight dispatches on CPU. Elsewhere F.rms_norm (one fused kernel on CUDA).
    """

    def __init__(self, dim: int, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = parameter(torch.empty(dim, device=device, dtype=dtype))  # (C,)
        self._scaled: tuple[torch.Tensor, torch.Tensor] | None = None  # (weight * sqrt(C), sqrt(C * eps))

    @property
    def cpu_fp32(self) -> bool:
        return self._scaled is not None

    def load(self, weight: torch.Tensor) -> None:
        self.weight.copy_(weight)
        self._rescale()

    def _rescale(self) -> None:
        w = self.weight.detach()
        C = w.shape[0]
        cpu_fp32 = w.device.type == "cpu" and w.dtype == torch.float32
        self._scaled = (w * math.sqrt(C), torch.tensor(math.sqrt(C * self.eps), dtype=w.dtype)) if cpu_fp32 else None

    def _apply(self, fn, recurse: bool = True):  # behind .to(): rebuild for the new device and dtype
        super()._apply(fn, recurse)
        self._rescale()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, C) -> (T, C)."""
        if self._scaled is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        if (ops := cpu_kernels.layer_ops_for(x)) is not None:
            return ops.rms_norm(x, self.weight, self.eps)  # (T, C)
        weight, eps_norm = self._scaled
        return torch.div(x * weight, torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), eps_norm))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2F), gate then up -> silu(gate) * up (T, F)."""
    if (ops := cpu_kernels.layer_ops_for(gate_up)) is not None:
        return ops.silu_mul(gate_up)  # (T, F)
    gate, up = gate_up.chunk(2, dim=-1)  # (T, F), (T, F)
    return F.silu(gate) * up


def rope_tables(head_dim: int, theta: float, max_positions: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin: (max_positions, D) fp32, so that rope(x) = x * cos + roll_half(x) * sin.

    HF computes x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1); roll_half(x) = (x2, x1)
    with sin's first half negated gives the same products, bit for bit.
    """
    D = head_dim
    exponents = torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D  # (D/2,)
    inv_freq = 1.0 / (theta**exponents)  # (D/2,)
    pos = torch.arange(max_positions, device=device).float()  # (P,)
    freqs = pos[:, None] * inv_freq[None, :]  # (P, D/2)
    cos, sin = freqs.cos(), freqs.sin()  # (P, D/2)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # (P, D), (P, D)


# ------------------------------------------------------------------------ one decoder layer in one call


@dataclass(frozen=True, slots=True)
class DecoderLayerWeights:
    """One pre-norm decoder layer as llm_cpu::decoder_layer reads it:
    x += o(attention(rope(qkv(norm1(x))))); x += down(silu_mul(gate_up(norm2(x))))."""

    input_norm: RMSNorm
    qkv: Linear  # q, k, v stacked (bias optional)
    o: Linear
    post_norm: RMSNorm
    gate_up: Linear  # gate, up stacked
    down: Linear
    num_heads: int
    num_kv_heads: int
    scale: float


DecoderLayerOp = Callable[..., torch.Tensor]


def cpu_decoder_layer(
    first: DecoderLayerWeights, x: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
) -> DecoderLayerOp | None:
    """llm_cpu::decoder_layer where this step may take it, else None: eager, decode only, up to
    MAX_LINEAR_ROWS rows, CPU fp32 with every op the layer would run in C++ there (packed linears,
    the C++ norm, contiguous caches the decode kernel reads). `first`: the model's first layer."""
    if torch.compiler.is_compiling() or meta.num_decode_seqs != meta.num_seqs or meta.decode_plan is not None:
        return None
    if x.shape[0] > cpu_kernels.MAX_LINEAR_ROWS or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    if first.qkv.panels is None or not first.input_norm.cpu_fp32:
        return None
    k_cache, v_cache = kv_caches[0]
    if k_cache.dtype != torch.float32 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    return cpu_kernels.decoder_layer()


def run_decoder_layer(
    op: DecoderLayerOp,
    w: DecoderLayerWeights,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: KVCache,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """x (T, C) -> the layer's output (T, C), in cpu_decoder_layer.cpp's argument order."""
    n1, qkv, o, n2, gate_up, down = w.input_norm, w.qkv, w.o, w.post_norm, w.gate_up, w.down
    T = x.shape[0]
    return op(
        x,
        n1.weight, n1.eps, qkv.panels_for(T), qkv.out_features, qkv.bias, o.panels_for(T), o.out_features,
        n2.weight, n2.eps, gate_up.panels_for(T), gate_up.out_features, down.panels_for(T), down.out_features,
        cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping, meta.block_tables, meta.seq_lens,
        w.num_heads, w.num_kv_heads, w.scale,
    )  # fmt: skip
