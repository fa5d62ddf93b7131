"""`make bench-engine`: our engine and transformers `generate` on the same weights, in one run.

(a) batch-1 decode tokens/s, beside the memory-bandwidth bound (the weight bytes a decode step reads,
    Q4 / Q8 panels where a matrix is exactly that and fp32 elsewhere, over the read bandwidth this script
    measures on this machine: the best of torch.mv, a plain sum and the engine's linear kernel, before
    and after the run);
(b) 32 requests, 128-token prompts, output lengths mixed 16..128 (ignore_eos), concurrency 16:
    aggregate output tokens/s. The engine batches continuously (a finished request's seat is
    refilled at once); transformers runs static batches of 16 padded to the longest output, and
    only the requested tokens count as output.
(c) one long prompt (--long-prompt-tokens, 4096 by default; 0 skips it), one output token: time to
    first token. The engine prefills in chunks of 2048 tokens through the paged cache; transformers
    runs `generate(max_new_tokens=1)` on the whole prompt (its default SDPA attention).
With --compile (`make bench-engine` passes it), (a) and (b) run again on an engine with
EngineConfig(compile=True) (backend/compiled_decode.py); the plain keys stay the default engine's.

The last line printed is one JSON object (see the keys at the end). Numbers, not tests.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.checkpoint import load_checkpoint
from backend.config import EngineConfig
from backend.engine import LLMEngine
from benchmarks.bandwidth import measure_read_bandwidth_gb_s
from benchmarks.hf_peer import build_hf_model
from kernels import cpu_kernels
from protocol import SamplingParams, StepOutput

WORDS = (
    "alpha river stone light quick brown fox jumps over lazy dog market signal garden orbit paper "
    "window silver echo forest number winter copper ladder candle harbor"
).split()


def make_prompt_ids(tokenizer, rng: random.Random, num_tokens: int) -> list[int]:
    """A varied prompt of exactly num_tokens tokens (varied, so no run looks instant through prefix caching)."""
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids.extend(tokenizer.encode(" " + " ".join(rng.choice(WORDS) for _ in range(32))))
    return ids[:num_tokens]


def decode_weight_bytes(state_dict: dict[str, torch.Tensor]) -> int:
    """The bytes one batch-1 decode step reads: every matrix once (as Q4 / Q8 panels where it packs as
    such, backend.layers.Linear; fp32 otherwise); the embedding table only as the (tied) LM head."""
    embed = "model.embed_tokens.weight"

    def read(t: torch.Tensor) -> int:
        packed = cpu_kernels.pack_quantized_weight(t) if t.dim() == 2 and cpu_kernels.q4_panels_on() else None
        return packed[0].numel() if packed is not None else t.numel() * 4  # (uint8 panels: one byte each)

    total = sum(read(t) for name, t in state_dict.items() if name != embed)
    return total if "lm_head.weight" in state_dict else total + read(state_dict[embed])


def run_engine(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int], concurrency: int
) -> tuple[int, float, float]:
    """Continuous batching at a fixed concurrency. Returns (output tokens, seconds, decode-only seconds)."""
    pending = list(range(len(prompts)))
    active = 0
    produced = 0
    first_token_at: float | None = None

    def submit(i: int) -> None:
        params = SamplingParams(max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True)
        engine.add_request(engine.make_request(f"bench-{i}-{time.monotonic_ns()}", prompts[i], params))

    t0 = time.perf_counter()
    while pending and active < concurrency:
        submit(pending.pop(0))
        active += 1
    while engine.has_work():
        for out in engine.step():
            assert isinstance(out, StepOutput), out
            produced += len(out.token_ids)
            if first_token_at is None and out.token_ids:
                first_token_at = time.perf_counter()
            if out.request_finished:
                active -= 1
                if pending:
                    submit(pending.pop(0))
                    active += 1
    end = time.perf_counter()
    return produced, end - t0, end - (first_token_at or t0)


def run_hf(model, prompts: list[list[int]], max_tokens: list[int], batch: int) -> tuple[int, float]:
    """Static batches: left-padded prompts, every row generates the batch's longest output."""
    useful = 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        rows = prompts[start : start + batch]
        lengths = max_tokens[start : start + batch]
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=max(lengths),
                min_new_tokens=max(lengths),
                do_sample=False,
                pad_token_id=0,
            )
        useful += sum(lengths)
    return useful, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch1-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--long-prompt-tokens", type=int, default=4096)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--compile", action="store_true", help="also run (a) and (b) on an engine with EngineConfig(compile=True)"
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    rng = random.Random(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    checkpoint = load_checkpoint("smollm2", dtype=torch.float32)
    engine = LLMEngine(
        EngineConfig(max_num_seqs=args.concurrency, max_num_batched_tokens=2048, enable_prefix_caching=False),
        checkpoint=checkpoint,
    )
    tok = engine.tokenizer
    weight_bytes = decode_weight_bytes(checkpoint.state_dict)
    # (a) batch 1, between two bandwidth measurements (this VM's bandwidth drifts by 10-30% over
    # minutes); the bound takes the higher of the two.
    before = measure_read_bandwidth_gb_s()
    prompt = make_prompt_ids(tok, rng, 16)
    run_engine(engine, [prompt], [8], 1)  # warm-up
    n, _, decode_s = run_engine(engine, [prompt], [args.batch1_tokens], 1)
    engine_b1 = (n - 1) / decode_s
    after = measure_read_bandwidth_gb_s()
    reads = {name: max(before[name], after[name]) for name in before}
    bandwidth = max(reads.values())
    bound = bandwidth * 1e9 / weight_bytes
    print(
        f"weights {weight_bytes / 1e6:.0f} MB read per step; read bandwidth GB/s (before, after (a)): "
        + ", ".join(f"{name} {before[name]:.1f}/{after[name]:.1f}" for name in before)
        + f"; bound {bound:.1f} tok/s at {bandwidth:.1f} GB/s",
        flush=True,
    )
    print(
        f"(a) engine batch-1 decode: {engine_b1:.1f} tok/s ({engine_b1 / bound:.0%} of the bound; "
        f"{engine_b1 * weight_bytes / 1e9:.1f} GB/s of weights)",
        flush=True,
    )

    hf_b1 = hf_mixed = float("nan")
    hf = None
    if not args.skip_hf:
        hf = build_hf_model(checkpoint.config, checkpoint.state_dict)
        run_hf(hf, [prompt], [8], 1)  # warm-up
        n, secs = run_hf(hf, [prompt], [args.batch1_tokens], 1)
        hf_b1 = n / secs
        print(f"(a) transformers batch-1 generate: {hf_b1:.1f} tok/s", flush=True)

    # (b) mixed lengths at concurrency 16
    prompts = [make_prompt_ids(tok, rng, args.prompt_tokens) for _ in range(args.requests)]
    lengths = [rng.randint(16, 128) for _ in range(args.requests)]
    n, secs, _ = run_engine(engine, prompts, lengths, args.concurrency)
    engine_mixed = n / secs
    print(
        f"(b) engine, {args.requests} requests at concurrency {args.concurrency}: {n} tokens in {secs:.1f} s "
        f"= {engine_mixed:.1f} tok/s",
        flush=True,
    )
    if hf is not None:
        n, secs = run_hf(hf, prompts, lengths, args.concurrency)
        hf_mixed = n / secs
        print(
            f"(b) transformers, static batches of {args.concurrency}: {n} tokens in {secs:.1f} s "
            f"= {hf_mixed:.1f} tok/s",
            flush=True,
        )
    # (c) one long prompt: time to first token
    long_prompt: dict[str, float | None] = {}
    if args.long_prompt_tokens > 0:
        long_ids = make_prompt_ids(tok, rng, args.long_prompt_tokens)
        _, secs, _ = run_engine(engine, [long_ids], [1], 1)
        long_prompt["engine_long_prompt_ttft_s"] = round(secs, 2)
        print(f"(c) engine, one {len(long_ids)}-token prompt: first token after {secs:.2f} s", flush=True)
        if hf is not None:
            _, hf_secs = run_hf(hf, [long_ids], [1], 1)
            long_prompt["hf_long_prompt_ttft_s"] = round(hf_secs, 2)
            long_prompt["long_prompt_speedup"] = round(hf_secs / secs, 2)
            print(
                f"(c) transformers generate(max_new_tokens=1): {hf_secs:.2f} s; engine {hf_secs / secs:.2f}x faster",
                flush=True,
            )
    compiled: dict[str, float] = {}
    if args.compile:
        del engine
        t0 = time.perf_counter()
        engine = LLMEngine(
            EngineConfig(
                max_num_seqs=args.concurrency, max_num_batched_tokens=2048, enable_prefix_caching=False, compile=True
            ),
            checkpoint=checkpoint,
        )
        compiled["compile_start_s"] = round(time.perf_counter() - t0, 1)
        run_engine(engine, [prompt], [8], 1)  # warm-up
        n, _, decode_s = run_engine(engine, [prompt], [args.batch1_tokens], 1)
        compiled["engine_compiled_batch1_tok_s"] = round((n - 1) / decode_s, 2)
        compiled["engine_compiled_batch1_fraction_of_bound"] = round((n - 1) / decode_s / bound, 3)
        n, secs, _ = run_engine(engine, prompts, lengths, args.concurrency)
        compiled["engine_compiled_mixed_tok_s"] = round(n / secs, 2)
        print(
            f"(a, b) engine with compile=True (start {compiled['compile_start_s']} s): batch-1 "
            f"{compiled['engine_compiled_batch1_tok_s']:.1f} tok/s "
            f"({compiled['engine_compiled_batch1_fraction_of_bound']:.0%} of the bound), "
            f"mixed {compiled['engine_compiled_mixed_tok_s']:.1f} tok/s",
            flush=True,
        )
    print(
        json.dumps(
            {
                "engine_batch1_tok_s": round(engine_b1, 2),
                "hf_batch1_tok_s": round(hf_b1, 2),
                "bandwidth_gb_s": round(bandwidth, 2),
                **{f"bandwidth_{name}_gb_s": round(gb_s, 2) for name, gb_s in reads.items()},
                "bandwidth_bound_tok_s": round(bound, 2),
                "engine_batch1_fraction_of_bound": round(engine_b1 / bound, 3),
                "engine_mixed_tok_s": round(engine_mixed, 2),
                "hf_mixed_tok_s": round(hf_mixed, 2),
                "mixed_ratio": round(engine_mixed / hf_mixed, 2) if hf is not None else None,
                "batch1_ratio": round(engine_b1 / hf_b1, 2) if hf is not None else None,
                **long_prompt,
                **compiled,
            }
        )
    )


if __name__ == "__main__":
    main()
