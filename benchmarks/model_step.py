"""Decode-step time of the model alone (forward + logits) on SmolLM2: batch B, context ~ctx tokens.

usage: .venv/bin/python -m benchmarks.model_step THREADS B   (N=steps, default 30)
A/B against torch: LLM_CPU_KERNELS=0 (kernels/cpu_kernels.py) runs torch's matmuls and attention instead of ours.
"""

import os
import sys
import time

import torch

from backend.attention import AttentionMetadata, allocate_kv_caches
from backend.checkpoint import load_checkpoint
from backend.models import build_model
from kernels import cpu_kernels


def decode_batch(cfg, B: int, ctx: int, BS: int = 16):
    """A decode step's inputs for B sequences of `ctx` cached tokens each, in blocks of BS:
    (KV caches, positions (B,), AttentionMetadata). Each sequence owns its own ctx // BS + 1 blocks."""
    nb = ctx // BS + 1
    kv = allocate_kv_caches(cfg.num_hidden_layers, B * nb, BS, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
    tables = torch.arange(B * nb, dtype=torch.int32).view(B, nb)
    pos = torch.full((B,), ctx, dtype=torch.int64)
    meta = AttentionMetadata(
        slot_mapping=tables[:, ctx // BS].long() * BS + ctx % BS,
        num_decode_seqs=B,
        block_tables=tables,
        seq_lens=torch.full((B,), ctx + 1, dtype=torch.int32),
        query_start_loc=torch.arange(B + 1, dtype=torch.int32),
    )
    return kv, pos, meta


def main(threads: int, B: int, ctx: int = 128, BS: int = 16) -> None:
    torch.set_num_threads(threads)
    cpu_kernels.load()
    t = time.perf_counter()
    c = load_checkpoint("smollm2")
    t_load = time.perf_counter() - t
    t = time.perf_counter()
    m = build_model(c.config)
    m.load_weights(c.state_dict)
    t_build = time.perf_counter() - t
    cfg = c.config
    kv, pos, meta = decode_batch(cfg, B, ctx, BS)
    x = torch.randint(0, cfg.vocab_size, (B,))
    times = []
    with torch.inference_mode():
        for i in range(3 + int(os.environ.get("N", 30))):
            t = time.perf_counter()
            m.compute_logits(m(x, pos, kv, meta))
            if i >= 3:  # the first steps warm up
                times.append(time.perf_counter() - t)
    times.sort()
    med = times[len(times) // 2]
    off = " LLM_CPU_KERNELS=0" if os.environ.get("LLM_CPU_KERNELS") == "0" else ""
    print(
        f"threads={threads} B={B} ctx={ctx}{off}: median {med * 1e3:.1f} ms, min {times[0] * 1e3:.1f} ms"
        f" -> {B / med:.1f} tok/s (median), {B / times[0]:.1f} (best)"
        f" | load {t_load:.2f}s build {t_build:.2f}s | loadavg {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
