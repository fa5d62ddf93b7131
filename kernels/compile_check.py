"""Compile every Triton kernel ahead of time for a GPU architecture, with no GPU present.

Triton's wheel bundles ptxas, so `triton.compile` can lower the kernels to a cubin on a CPU-only
machine. That catches what the interpreter cannot: tl.dot shape / dtype limits, constexpr
handling, bf16 lowering, shared-memory size. It does not run anything.

    python -m kernels.compile_check              # sm_90 (H100 / H200)
    python -m kernels.compile_check --arch 80    # A100
Must run without TRITON_INTERPRET=1 (the kernels must be JIT functions, not interpreted ones).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

# The variants below repeat the wrappers' launch choices (num_warps / num_stages, tile sizes via the
# modules' own constants): keep them in step when a wrapper changes.
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _signature(fn, consts: dict, ptr_types: dict, dt: str) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptr_types.get(name, f"*{dt}")
        elif name == "scale_log2e":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def variants(dtypes=("fp16", "bf16", "fp32")):
    """(label, jit fn, pointer dtypes, constexprs, compile options) for each launch the wrappers make."""
    from kernels import paged_attention as pa
    from kernels import paged_prefill as pp
    from kernels import store_kv as sk
    from kernels._common import dot_precision, next_pow2

    tables = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32"}
    partials = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
    # (H, KVH, D, block_size): Llama-8B-like and SmolLM2-like heads.
    shapes = [(32, 8, 128, 16), (9, 3, 64, 32)]
    for dt in dtypes:
        prec = dot_precision(DTYPES[dt])
        for H, KVH, D, BS in shapes:
            G = H // KVH
            for splits in (1, 4):
                consts = {
                    "H": H,
                    "BLOCK_SIZE": BS,
                    "G": G,
                    "G_PAD": max(16, next_pow2(G)),
                    "D": D,
                    "D_PAD": next_pow2(D),
                    "BLOCK_N": pa.BLOCK_N,
                    "NUM_SPLITS": splits,
                    "DOT_PRECISION": prec,
                }
                yield (
                    f"decode {dt} H{H}/KVH{KVH} D{D} splits={splits}",
                    pa._paged_decode_kernel,
                    {**tables, **partials},
                    consts,
                    {"num_warps": 4, "num_stages": 2},
                )
            consts = {"H": H, "NUM_SPLITS": 4, "S_PAD": 4, "D": D, "D_PAD": next_pow2(D)}
            yield (
                f"decode-reduce {dt} D{D}",
                pa._decode_reduce_kernel,
                partials,
                consts,
                {"num_warps": 1 if next_pow2(D) <= 128 else 2},
            )
            block_m, block_n = pp.tile_sizes(DTYPES[dt], on_gpu=True)
            consts = {
                "BLOCK_SIZE": BS,
                "G": G,
                "D": D,
                "D_PAD": next_pow2(D),
                "BLOCK_M": block_m,
                "BLOCK_N": block_n,
                "DOT_PRECISION": prec,
            }
            yield (
                f"prefill {dt} H{H}/KVH{KVH} D{D}",
                pp._paged_prefill_kernel,
                tables,
                consts,
                {"num_warps": 4, "num_stages": 2},
            )
            consts = {"BLOCK_SIZE": BS, "KVH": KVH, "KVH_PAD": next_pow2(KVH), "D": D, "D_PAD": next_pow2(D)}
            yield (
                f"store_kv {dt} KVH{KVH} D{D}",
                sk._store_kv_kernel,
                {"slot_ptr": "*i64"},
                consts,
                {"num_warps": 4 if KVH * D >= 1024 else 1},
            )


def compile_all(arch: int = 90, dtypes=("fp16", "bf16", "fp32"), log=print) -> list[dict]:
    """Compile every variant for cuda sm_<arch>; raises on the first failure. Returns one dict per kernel."""
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET for a compile check"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    results = []
    for label, fn, ptr_types, consts, options in variants(dtypes):
        dt = label.split()[1]
        t0 = time.perf_counter()
        src = ASTSource(fn, _signature(fn, consts, ptr_types, dt), constexprs=consts)
        compiled = triton.compile(src, target=target, options=options)
        row = {"kernel": label, "shared_bytes": compiled.metadata.shared, "seconds": time.perf_counter() - t0}
        results.append(row)
        log(f"ok  {label:<42} shared {row['shared_bytes']:>6} B  {row['seconds']:.1f}s")
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    p.add_argument("--dtypes", nargs="+", default=["fp16", "bf16", "fp32"], choices=sorted(DTYPES))
    args = p.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    compile_all(args.arch, tuple(args.dtypes))
    print(f"all kernels compiled for sm_{args.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
