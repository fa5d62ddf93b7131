"""Decode-step time of the Llama model (backend/models/llama.py) on SmolLM2 (forward + logits), batch B, context ~ctx tokens.
usage: PYTHONPATH=. .venv/bin/python benchmarks/model_step.py THREADS B
A/B against torch: LLM_CPU_KERNELS=0 (kernels/cpu_kernels.py) runs torch's matmuls and attention instead of ours."""
import os, sys, time, torch
nt, B = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(nt)
from backend.checkpoint import load_checkpoint
from backend.models import build_model
from kernels import cpu_kernels
from backend.attention import AttentionMetadata, allocate_kv_caches
cpu_kernels.load()
t = time.perf_counter(); c = load_checkpoint("smollm2"); t_load = time.perf_counter() - t
t = time.perf_counter(); m = build_model(c.config); m.load_weights(c.state_dict); t_build = time.perf_counter() - t
cfg = c.config; BS = 16; ctx = 128; nb = ctx // BS + 1
kv = allocate_kv_caches(cfg.num_hidden_layers, B * nb, BS, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
tables = torch.arange(B * nb, dtype=torch.int32).view(B, nb)
pos = torch.full((B,), ctx, dtype=torch.int64)
meta = AttentionMetadata(slot_mapping=tables[:, ctx // BS].long() * BS + ctx % BS, num_decode_seqs=B, block_tables=tables,
                         seq_lens=torch.full((B,), ctx + 1, dtype=torch.int32), query_start_loc=torch.arange(B + 1, dtype=torch.int32))
x = torch.randint(0, cfg.vocab_size, (B,))
torch.set_grad_enabled(False)  # forward runs under no_grad or inference_mode
step = lambda: m.compute_logits(m(x, pos, kv, meta))
for _ in range(3): step()
ts = []
for _ in range(int(os.environ.get("N", 30))):
    t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
ts.sort(); med = ts[len(ts) // 2]
print(f"threads={nt} B={B} ctx={ctx}{' LLM_CPU_KERNELS=0' if os.environ.get('LLM_CPU_KERNELS') == '0' else ''}: median {med*1e3:.1f} ms, min {ts[0]*1e3:.1f} ms"
      f" -> {B/med:.1f} tok/s (median), {B/ts[0]:.1f} (best) | load {t_load:.2f}s build {t_build:.2f}s | loadavg {os.getloadavg()[0]:.2f}")
