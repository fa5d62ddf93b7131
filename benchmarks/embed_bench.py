"""`make bench-embed`: /v1/embeddings served, against transformers on the same weights, in the same run.

    python benchmarks/embed_bench.py                       # starts tritonserver + the frontend itself
    python benchmarks/embed_bench.py --url http://127.0.0.1:9000 --requests 64 --prompt-tokens 128

The served side sends `--requests` embedding requests of one input each (`--prompt-tokens` tokens of
seeded single-token words, salted per run and per level, so that no request reads another's prefix
cache), first one at a time, then 8 in flight. The peer embeds the same inputs afterwards, in the same
process, as a transformers user would: `LlamaModel` forward passes over batches of the level's size
(1, then 8; the inputs are of one length, so there is no padding), the last position's
last_hidden_state, L2-normalised (the engine's pooling).

Printed: embeddings per second each way at each level and their ratios (served / transformers), and
the smallest cosine between a served vector and transformers' for the same input (a check that both
computed the same thing).
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_bench import make_prompts
from scripts.servers import DEFAULT_MODEL, REPO_ROOT, running_servers

LEVELS = (1, 8)


async def embed_served(url: str, model: str, texts: list[str], concurrency: int) -> tuple[float, list[list[float]]]:
    """(seconds, each text's vector) for every text embedded through the frontend, `concurrency` in flight."""
    vectors: list[list[float]] = [[] for _ in texts]
    todo = iter(range(len(texts)))

    async def worker(http: httpx.AsyncClient) -> None:
        for k in todo:
            r = await http.post("/v1/embeddings", json={"model": model, "input": texts[k], "encoding_format": "float"})
            r.raise_for_status()
            vectors[k] = r.json()["data"][0]["embedding"]

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return seconds, vectors


def embed_transformers(model, prompts: list[list[int]], batch: int) -> tuple[float, torch.Tensor]:
    """(seconds, (N, hidden) vectors): batches of `batch` equal-length prompts through the base model."""
    out = []
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i : i + batch])  # (B, T)
            hidden = model.model(input_ids=ids).last_hidden_state[:, -1]  # (B, C), after the final norm
            out.append(F.normalize(hidden.float(), dim=-1))  # (B, C)
    return time.perf_counter() - start, torch.cat(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32, help="embedding requests per level")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", default=None, help="a running frontend (default: start the servers here)")
    parser.add_argument(
        "--hf-threads",
        type=int,
        default=None,
        help="torch threads for transformers (default: torch's own; on a busy machine 1 may be faster)",
    )
    args = parser.parse_args(argv)

    from backend.checkpoint import load_checkpoint
    from benchmarks.hf_peer import build_hf_model

    checkpoint = load_checkpoint("smollm2", dtype=torch.float32)
    tok = checkpoint.tokenizer
    salt = random.randrange(2**31)
    texts = {c: make_prompts(tok, args.requests, args.prompt_tokens, seed=args.seed + c, salt=salt + c) for c in LEVELS}
    warm = make_prompts(tok, 2, 16, seed=args.seed + 100, salt=salt + 100)
    print(f"{args.requests} embedding requests of {args.prompt_tokens} tokens per level, levels {LEVELS}", flush=True)

    def served(url: str) -> dict[int, tuple[float, list[list[float]]]]:
        asyncio.run(embed_served(url, DEFAULT_MODEL, warm, 1))  # not measured
        return {c: asyncio.run(embed_served(url, DEFAULT_MODEL, texts[c], c)) for c in LEVELS}

    if args.url is not None:
        served_runs = served(args.url.rstrip("/"))
    else:
        with running_servers(REPO_ROOT / "artifacts" / "bench-logs", "-embed") as (_, frontend):
            served_runs = served(frontend.url.rstrip("/").removesuffix("/v1"))

    if args.hf_threads is not None:
        torch.set_num_threads(args.hf_threads)
    model = build_hf_model(checkpoint.config, checkpoint.state_dict)
    embed_transformers(model, [tok.encode(t) for t in warm], 2)  # not measured
    result: dict[str, object] = {
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "hf_threads": torch.get_num_threads(),
    }
    worst = 1.0
    for c in LEVELS:
        served_s, served_vectors = served_runs[c]
        hf_s, hf_vectors = embed_transformers(model, [tok.encode(t) for t in texts[c]], c)
        cosines = F.cosine_similarity(torch.tensor(served_vectors), hf_vectors, dim=-1)
        worst = min(worst, cosines.min().item())
        served_rate, hf_rate = args.requests / served_s, args.requests / hf_s
        print(
            f"concurrency {c}: served {served_rate:.1f} embeddings/s, transformers (batch {c}) {hf_rate:.1f} "
            f"embeddings/s, served / transformers {served_rate / hf_rate:.2f}x",
            flush=True,
        )
        result |= {
            f"served_embed_s_c{c}": round(served_rate, 2),
            f"transformers_embed_s_b{c}": round(hf_rate, 2),
            f"served_over_transformers_c{c}": round(served_rate / hf_rate, 3),
        }
    print(f"smallest cosine served vs transformers: {worst:.6f}")
    print(json.dumps(result | {"min_cosine": worst}))
    return 0 if worst >= 0.9999 else 1


if __name__ == "__main__":
    sys.exit(main())
