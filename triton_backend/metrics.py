"""The engine's statistics as Triton custom metrics (`llm_*` on Triton's /metrics), one set per instance."""

import triton_python_backend_utils as pb_utils

GAUGES = {
    "num_running": "Sequences in the running batch",
    "num_waiting": "Sequences waiting to be scheduled",
    "kv_blocks_used": "KV cache blocks in use",
    "kv_blocks_free": "KV cache blocks free (including cached ones)",
    "kv_blocks_cached": "Free KV cache blocks that still hold a reusable prefix",
    "prefix_cache_hit_ratio": "Prompt tokens found in the prefix cache over tokens looked up, since start",
}
COUNTERS = {
    "prompt_tokens": "Prompt tokens received",
    "generation_tokens": "Tokens generated",
    "num_preemptions": "Sequences preempted (recomputed later)",
    "aborted_requests": "Requests aborted (client cancelled)",
    "rejected_requests": "Requests refused because too many sequences were waiting (max_waiting_seqs)",
    "spec_draft_tokens": "Drafted tokens verified (speculative decoding)",
    "spec_accepted_tokens": "Drafted tokens accepted (speculative decoding)",
}


class EngineMetrics:
    """Gauges and counters labelled with the model and instance; `publish` runs on the engine thread."""

    def __init__(self, model_name: str, instance_name: str) -> None:
        labels = {"model": model_name, "instance": instance_name}
        kind = pb_utils.MetricFamily
        # The families must outlive their metrics, so they are kept too.
        self._families = {
            name: kind(name=f"llm_{name}", description=desc, kind=kind.GAUGE) for name, desc in GAUGES.items()
        }
        self._families.update(
            {
                name: kind(name=f"llm_{name}_total", description=desc, kind=kind.COUNTER)
                for name, desc in COUNTERS.items()
            }
        )
        self._gauges = {name: self._families[name].Metric(labels=labels) for name in GAUGES}
        self._counters = {name: self._families[name].Metric(labels=labels) for name in COUNTERS}
        self._last_counts = dict.fromkeys(COUNTERS, 0)
        self._last_gauges: dict[str, float] = {}

    def publish(self, stats) -> None:  # backend.engine.EngineStats
        # Each set() and increment() is a round trip to tritonserver: only changes go.
        for name, metric in self._gauges.items():
            if name == "prefix_cache_hit_ratio":
                value = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
            else:
                value = getattr(stats, name)
            value = float(value)
            if self._last_gauges.get(name) != value:
                metric.set(value)
                self._last_gauges[name] = value
        for name, metric in self._counters.items():
            value = getattr(stats, name)
            if value > self._last_counts[name]:
                metric.increment(float(value - self._last_counts[name]))
                self._last_counts[name] = value
