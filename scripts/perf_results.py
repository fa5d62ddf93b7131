"""Reading perf_analyzer's profile export and genai-perf-style tables: the numbers `make perf` prints."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass(frozen=True)
class ExportedRequest:
    """One request of a perf_analyzer profile export: when it was sent and when each of its responses
    came (ns, perf_analyzer's clock), and its output tokens (the final response's num_output_tokens)."""

    sent_ns: int
    responses_ns: tuple[int, ...]
    tokens: int


def exported_requests(path: Path) -> list[tuple[int, list[ExportedRequest]]]:
    """(concurrency, its requests that got a response) per experiment of a perf_analyzer profile export."""
    data = json.loads(path.read_text())
    experiments = []
    for exp in data["experiments"]:
        requests = []
        for r in exp["requests"]:
            ts = r["response_timestamps"]
            if not ts:
                continue
            outs = r.get("response_outputs") or []
            n = int(outs[-1].get("num_output_tokens", len(ts))) if outs else len(ts)
            requests.append(ExportedRequest(r["timestamp"], tuple(ts), n))
        experiments.append((exp["experiment"]["value"], requests))
    return experiments


def summarize_pa_export(path: Path) -> list[dict]:
    """One row per experiment of a perf_analyzer profile export of the Triton model.

    Per request: TTFT = first response - send; ITL = (last - first response) / (tokens - 1);
    tokens = the final response's num_output_tokens (the model's own count). Throughput over the
    span from the first send to the last response."""
    rows = []
    for concurrency, requests in exported_requests(path):
        ttft = [(r.responses_ns[0] - r.sent_ns) / 1e6 for r in requests]
        latency = [(r.responses_ns[-1] - r.sent_ns) / 1e6 for r in requests]
        itl = [(r.responses_ns[-1] - r.responses_ns[0]) / 1e6 / (r.tokens - 1) for r in requests if r.tokens > 1]
        tokens = [r.tokens for r in requests]
        start = min((r.sent_ns for r in requests), default=0)
        end = max((r.responses_ns[-1] for r in requests), default=0)
        span = (end - start) / 1e9 if tokens else float("nan")
        rows.append(
            {
                "concurrency": concurrency,
                "requests": len(tokens),
                "request_throughput": len(tokens) / span,
                "output_token_throughput": sum(tokens) / span,
                "output_tokens_mean": sum(tokens) / max(len(tokens), 1),
                "ttft_ms_p50": percentile(ttft, 50),
                "ttft_ms_p95": percentile(ttft, 95),
                "itl_ms_p50": percentile(itl, 50),
                "itl_ms_p95": percentile(itl, 95),
                "latency_ms_p50": percentile(latency, 50),
                "latency_ms_p95": percentile(latency, 95),
            }
        )
    return rows


def print_table(title: str, rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format)."""
    print(f"\n{title}")
    headers = [h for _, h, _ in columns]
    cells = [
        [format(row[k], f) if isinstance(row[k], (int, float)) else str(row[k]) for k, _, f in columns] for row in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print("| " + " | ".join(h.rjust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for c in cells:
        print("| " + " | ".join(v.rjust(w) for v, w in zip(c, widths)) + " |")
    sys.stdout.flush()
