"""`make bench-score`: scoring prompts (lm-eval's loglikelihood requests) served, against transformers.

    python benchmarks/score_bench.py                       # starts tritonserver + the frontend itself
    python benchmarks/score_bench.py --url http://127.0.0.1:9000 --prompts 64 --batch 8 --concurrency 2

The served side sends what lm-eval's `local-completions` sends for a loglikelihood task: `prompt` a
list of `--batch` token-id prompts, `echo: true`, `logprobs: 1`, `max_tokens: 1`, `temperature: 0`,
`--concurrency` such requests in flight (lm-eval's `batch_size` and `num_concurrent`). The prompts are
`--prompt-tokens` tokens of seeded single-token words, salted per run so that no run reads another's
prefix cache (prompt-logprob requests do not read it anyway). The peer scores the same prompts in the
same process afterwards, as lm-eval's `hf` model does: transformers forward passes over batches of
`--batch`, log-softmax, the logprob of each next token and the top-1 at each position.

Between the two, the engine alone (`LLMEngine` with config.pbtxt's settings, in this process, the
frontend's engine settings for such a request, as many prompts in flight as the served side) scores
them too: what the served path costs.

Printed: prompt tokens scored per second each way and the ratios, and the largest difference between
the served and transformers token logprobs (a check that both scored the same thing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_bench import make_prompts, run_inprocess_level
from scripts.servers import DEFAULT_MODEL, REPO_ROOT, running_servers


async def score_served(
    url: str, model: str, prompts: list[list[int]], batch: int, concurrency: int
) -> tuple[float, list[list[float | None]]]:
    """(seconds, each prompt's token logprobs) for every prompt scored through the frontend."""
    batches = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    results: list[list[list[float | None]]] = [[] for _ in batches]
    todo = iter(range(len(batches)))

    async def worker(http: httpx.AsyncClient) -> None:
        for k in todo:
            body = {
                "model": model,
                "prompt": batches[k],
                "echo": True,
                "logprobs": 1,
                "max_tokens": 1,
                "temperature": 0,
            }
            r = await http.post("/v1/completions", json=body)
            r.raise_for_status()
            choices = sorted(r.json()["choices"], key=lambda c: c["index"])
            # echo's logprobs: the prompt's tokens, then the one generated token
            results[k] = [c["logprobs"]["token_logprobs"][: len(batches[k][c["index"]])] for c in choices]

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return seconds, [lp for rs in results for lp in rs]


def score_in_process(engine, prompts: list[list[int]], in_flight: int) -> float:
    """Seconds for the engine alone to score `prompts` with the frontend's settings for lm-eval's
    requests, `in_flight` prompts at a time (what the served side keeps in flight)."""
    from protocol import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1, prompt_logprobs=1)
    start = time.perf_counter()
    records = run_inprocess_level(engine, prompts, 1, in_flight, params)
    seconds = time.perf_counter() - start
    failed = [r.error for r in records if r.error]
    if failed:
        raise RuntimeError(f"in-process scoring failed: {failed[0]}")
    return seconds


def score_transformers(model, prompts: list[list[int]], batch: int) -> tuple[float, list[list[float | None]]]:
    """(seconds, each prompt's token logprobs): lm-eval's hf model's work for equal-length prompts."""
    out: list[list[float | None]] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i : i + batch])  # [B, T]
            logprobs = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)  # [B, T, V]
            picked = logprobs[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
            logprobs[:, :-1].max(dim=-1)  # the top-1 at each position, as logprobs: 1 returns
            out.extend([None, *row] for row in picked.tolist())
    return time.perf_counter() - start, out


def largest_difference(a: list[list[float | None]], b: list[list[float | None]]) -> tuple[float, float]:
    """The largest |a - b| over all tokens, and b's logprob there (a very unlikely token differs more)."""
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True) if x is not None]
    x, y = max(pairs, key=lambda p: abs(p[0] - p[1]))
    return abs(x - y), y


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="prompts per request (lm-eval's batch_size)")
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight (lm-eval's num_concurrent)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", default=None, help="a running frontend (default: start the servers here)")
    args = parser.parse_args(argv)

    from backend.checkpoint import load_checkpoint
    from benchmarks.hf_peer import build_hf_model

    checkpoint = load_checkpoint("smollm2", dtype=torch.float32)
    tok = checkpoint.tokenizer
    salt = random.randrange(2**31)
    texts = make_prompts(tok, args.prompts, args.prompt_tokens, seed=args.seed, salt=salt)
    prompts = [tok.encode(t) for t in texts]
    warm = [tok.encode(t) for t in make_prompts(tok, 2, 16, seed=args.seed + 1, salt=salt + 1)]
    tokens = sum(len(p) for p in prompts)
    print(
        f"{args.prompts} prompts of {args.prompt_tokens} tokens, {args.batch} a request, {args.concurrency} in flight",
        flush=True,
    )

    def served(url: str) -> tuple[float, list[list[float | None]]]:
        asyncio.run(score_served(url, DEFAULT_MODEL, warm, 2, 1))  # not measured
        return asyncio.run(score_served(url, DEFAULT_MODEL, prompts, args.batch, args.concurrency))

    if args.url is not None:
        served_s, served_lp = served(args.url.rstrip("/"))
    else:
        with running_servers(REPO_ROOT / "artifacts" / "bench-logs", "-score") as (_, frontend):
            served_s, served_lp = served(frontend.url.rstrip("/").removesuffix("/v1"))
    print(f"served       {tokens} prompt tokens in {served_s:.2f} s = {tokens / served_s:.0f} tok/s", flush=True)

    from backend.config import EngineConfig
    from backend.engine import LLMEngine

    engine = LLMEngine(EngineConfig(), checkpoint=checkpoint)  # config.pbtxt's settings
    score_in_process(engine, warm, 2)  # not measured
    in_process_s = score_in_process(engine, prompts, args.batch * args.concurrency)
    del engine
    print(
        f"in-process   {tokens} prompt tokens in {in_process_s:.2f} s = {tokens / in_process_s:.0f} tok/s", flush=True
    )

    model = build_hf_model(checkpoint.config, checkpoint.state_dict)
    score_transformers(model, warm, 2)  # not measured
    hf_s, hf_lp = score_transformers(model, prompts, args.batch)
    print(f"transformers {tokens} prompt tokens in {hf_s:.2f} s = {tokens / hf_s:.0f} tok/s", flush=True)
    diff, where = largest_difference(served_lp, hf_lp)
    ratio = hf_s / served_s
    print(
        f"served / in-process: {in_process_s / served_s:.2f}; served / transformers: {ratio:.2f}x; "
        f"largest token logprob difference {diff:.2e} (at logprob {where:.1f})"
    )
    print(
        json.dumps(
            {
                "prompts": args.prompts,
                "prompt_tokens": args.prompt_tokens,
                "batch": args.batch,
                "concurrency": args.concurrency,
                "served_tok_s": round(tokens / served_s, 1),
                "in_process_tok_s": round(tokens / in_process_s, 1),
                "served_over_in_process": round(in_process_s / served_s, 3),
                "transformers_tok_s": round(tokens / hf_s, 1),
                "served_over_transformers": round(ratio, 3),
                "max_logprob_difference": diff,
                "at_logprob": where,
            }
        )
    )
    return 0 if diff < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
