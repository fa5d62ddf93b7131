"""Decode-kernel benchmark (GPU only): achieved K/V bandwidth and speed vs a torch baseline.

For each dtype x batch x context (every sequence at the full context, blocks shuffled through
the block table) it times:
  kernel   kernels.paged_attention.paged_attention_decode with the split-K rule,
  nosplit  the same kernel forced to one split (shown when the rule split),
  torch    gather the blocks (k_cache[block_tables]) + F.scaled_dot_product_attention (enable_gqa).
Bandwidth = bytes of K and V read (B * context * KVH * D * 2 * itemsize) / kernel time, and its
fraction of the GPU's peak (H200: 4.8 TB/s; --peak-tbps to override). Prints a table and, last,
one JSON line with every row.

    python benchmarks/kernels_bench.py            # full grid: batch 1..256, context 512..32k, fp16+bf16
    python benchmarks/kernels_bench.py --quick    # the bounded grid scripts/gpu_check.sh runs
    python benchmarks/kernels_bench.py --dry-run  # no GPU: tiny grid in the Triton interpreter,
                                                  # checks this script only (times are meaningless)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

PEAK_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.0, "L40S": 0.864, "L4": 0.3}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="bounded grid (a couple of minutes)")
    p.add_argument("--batches", type=int, nargs="+", default=None)
    p.add_argument("--contexts", type=int, nargs="+", default=None)
    p.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=sorted(DTYPES))
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=1 << 22, help="skip cases with batch * context above this")
    p.add_argument("--max-ref-tokens", type=int, default=1 << 21, help="skip the torch baseline above this")
    p.add_argument("--peak-tbps", type=float, default=None, help="GPU peak memory bandwidth (TB/s)")
    p.add_argument("--json-out", default=None, help="also write the rows to this file")
    p.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    return p.parse_args()


def peak_tbps(name: str, override: float | None) -> float | None:
    if override is not None:
        return override
    for key, tbps in PEAK_TBPS.items():
        if key in name:
            return tbps
    return None


def torch_decode(q, k_cache, v_cache, block_tables, scale):
    """Baseline: gather every sequence's blocks, then SDPA (all sequences at full context: no mask)."""
    H, KVH = q.shape[1], k_cache.shape[2]
    k = k_cache[block_tables.long()].flatten(1, 2).transpose(1, 2)  # (B, KVH, L, D)
    v = v_cache[block_tables.long()].flatten(1, 2).transpose(1, 2)  # (B, KVH, L, D)
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, scale=scale, enable_gqa=H != KVH)  # (B, H, 1, D)
    return out[:, :, 0, :]


def main() -> int:
    args = parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module defines its kernels
        args.batches, args.contexts = args.batches or [1, 2], args.contexts or [64, 256]
        args.heads, args.kv_heads, args.head_dim = 8, 2, 64
        args.dtypes = ["fp16"]  # the interpreter's tl.dot mishandles bf16
    elif not torch.cuda.is_available():
        print(
            "kernels_bench: no CUDA device; this benchmark needs a GPU (the CPU path is kernels.reference; "
            "--dry-run checks the script in the Triton interpreter)."
        )
        return 2
    import triton.testing

    from kernels._common import num_sms
    from kernels.paged_attention import choose_num_splits, paged_attention_decode

    batches = args.batches or ([1, 16, 64, 256] if args.quick else [1, 4, 16, 64, 256])
    contexts = args.contexts or ([512, 4096, 32768] if args.quick else [512, 2048, 8192, 32768])
    if args.dry_run:
        dev, name, sms = torch.device("cpu"), "cpu (Triton interpreter, dry run)", 4

        def bench(fn):
            import time

            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
    else:
        dev = torch.device("cuda")
        name = torch.cuda.get_device_name(dev)
        sms = num_sms(dev.index or 0)
        bench = triton.testing.do_bench
    peak = peak_tbps(name, args.peak_tbps)
    H, KVH, D, BS = args.heads, args.kv_heads, args.head_dim, args.block_size
    scale = D**-0.5
    print(f"# {name}, {sms} SMs, peak {peak if peak else 'unknown'} TB/s; H={H} KVH={KVH} D={D} block={BS}")
    header = (
        f"{'dtype':>5} {'batch':>5} {'ctx':>6} {'splits':>6} {'kernel_us':>10} {'GB/s':>8} {'%peak':>6} "
        f"{'nosplit_us':>10} {'torch_us':>9} {'speedup':>7} {'max_err':>8}"
    )
    print(header)
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        for B in batches:
            for ctx in contexts:
                if B * ctx > args.max_tokens:
                    print(f"{dname:>5} {B:>5} {ctx:>6}  skipped (batch*context > --max-tokens)")
                    continue
                nb = math.ceil(ctx / BS)
                num_blocks = B * nb
                k_cache = torch.empty(num_blocks, BS, KVH, D, dtype=dtype, device=dev).normal_(generator=gen)
                v_cache = torch.empty_like(k_cache).normal_(generator=gen)
                block_tables = torch.randperm(num_blocks, device=dev, generator=gen).view(B, nb).to(torch.int32)
                seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
                q = torch.randn(B, H, D, dtype=dtype, device=dev, generator=gen)

                splits = choose_num_splits(B, KVH, nb * BS, sms)
                if args.dry_run:  # the interpreter has no SM count: force the rule's choice
                    splits = min(splits * 2, 4)
                inputs = (q, k_cache, v_cache, block_tables, seq_lens, scale)
                decode = functools.partial(paged_attention_decode, *inputs, num_splits=splits)
                out = decode()
                t_kernel = bench(decode)
                t_nosplit = None
                if splits > 1:
                    t_nosplit = bench(functools.partial(paged_attention_decode, *inputs, num_splits=1))
                t_torch = err = None
                if B * ctx <= args.max_ref_tokens:
                    baseline = functools.partial(torch_decode, q, k_cache, v_cache, block_tables, scale)
                    err = (out.float() - baseline().float()).abs().max().item()
                    t_torch = bench(baseline)
                    del baseline
                bytes_kv = B * ctx * KVH * D * 2 * k_cache.element_size()
                gbps = bytes_kv / (t_kernel * 1e-3) / 1e9
                row = {
                    "dtype": dname,
                    "batch": B,
                    "context": ctx,
                    "splits": splits,
                    "kernel_us": t_kernel * 1e3,
                    "gbps": gbps,
                    "frac_peak": (gbps / (peak * 1e3)) if peak else None,
                    "nosplit_us": t_nosplit * 1e3 if t_nosplit else None,
                    "torch_us": t_torch * 1e3 if t_torch else None,
                    "speedup_vs_torch": (t_torch / t_kernel) if t_torch else None,
                    "max_abs_err": err,
                }
                rows.append(row)

                def fmt(x, width, spec):
                    return format(x, f">{width}{spec}") if x is not None else format("-", f">{width}")

                print(
                    f"{dname:>5} {B:>5} {ctx:>6} {splits:>6} {row['kernel_us']:>10.1f} {gbps:>8.0f} "
                    f"{fmt(row['frac_peak'] and 100 * row['frac_peak'], 6, '.1f')} "
                    f"{fmt(row['nosplit_us'], 10, '.1f')} {fmt(row['torch_us'], 9, '.1f')} "
                    f"{fmt(row['speedup_vs_torch'], 7, '.2f')} {fmt(err, 8, '.1e')}",
                    flush=True,
                )
                del k_cache, v_cache, q, out, inputs, decode
                torch.cuda.empty_cache()
    result = {
        "bench": "paged_attention_decode",
        "device": name,
        "sms": sms,
        "peak_tbps": peak,
        "heads": H,
        "kv_heads": KVH,
        "head_dim": D,
        "block_size": BS,
        "rows": rows,
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
