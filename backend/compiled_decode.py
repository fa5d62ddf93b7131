"""The decode-only forward compiled with torch.compile (inductor) for CPU serving.

Why: much of a batch-1 decode step on a CPU is per-op overhead. Its matrix work runs at the memory
bandwidth bound; eager mode with torch's ops adds ~25 small ops per layer at several microseconds
each. Inductor fuses the element-wise ops into C++ loops and runs the whole step as one graph.

What goes through it: decode-only steps (every scheduled sequence adds one token), the steps that
streaming users wait on. Steps with a prefill chunk stay eager: they are compute-bound, and the prefill
reference loops over sequences in Python. Shapes are dynamic (batch size, context length, block
table width), so two graphs serve every decode step: batch 1 (matrix-vector products) and batch >= 2.
`warm_up` compiles both when the engine starts, so no user request waits for the compiler.

The matrix products stay opaque calls: batch 1 the project's kernel (kernels/cpu_linear.cpp, or the split
bmm where it is not built), batch >= 2 the oneDNN linear (backend.layers.packed_linear: inductor cannot
lower it; the kernel is not used there, as it serves only up to cpu_kernels.MAX_LINEAR_ROWS rows and
the graph must not branch on the batch size). Inductor would fuse a plain one-row bmm into its own C++
loop, which reads the weights slower than MKL, hence split_matvec.

Cost: minutes of compiling at the first start, less later (inductor's on-disk cache). Off by default
(`EngineConfig.compile`): where the C++ CPU kernels are built, eager decode steps run each layer as one
C++ op (backend.layers `run_decoder_layer`), which a traced graph does not take, and the compiled
engine does not beat eager there (`make bench-engine` prints both; figures in docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._dynamo

from backend.attention import AttentionMetadata
from backend.layers import KVCache
from backend.models import CausalLM

DecodeForward = Callable[[torch.Tensor, torch.Tensor, list[KVCache], AttentionMetadata], torch.Tensor]


def compile_decode_forward(model: CausalLM) -> DecodeForward:
    """model.forward compiled for decode steps. Call it under torch.no_grad(), not inference_mode (the
    graph writes the KV cache in place, which inference tensors' version counters forbid)."""
    # rms_norm's eps and the attention scale are Python floats on the modules: constants, not graph
    # inputs (a float input would need a device-to-host read inside the repeated layer region).
    torch._dynamo.config.specialize_float = True
    compiled = torch.compile(model.forward, fullgraph=True)

    def forward(input_ids, positions, kv_caches, meta):
        # Only the per-step sizes are symbolic (batch, context, block-table width); weights and the
        # KV cache keep static shapes. (With dynamic=True every KV-cache dimension became a symbol
        # and tracing SmolLM2 ran for over 15 minutes.)
        for t in (input_ids, positions, meta.slot_mapping, meta.seq_lens, meta.query_start_loc):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        plan = meta.decode_plan  # None where the C++ decode kernel reads the block tables itself
        if plan is None:
            torch._dynamo.maybe_mark_dynamic(meta.block_tables, 0)
            # Unbacked: a table one block wide (every context <= block_size) must not be a new graph,
            # and only the kernel reads this size, so nothing needs its value while tracing.
            torch._dynamo.decorators.mark_unbacked(meta.block_tables, 1)
        else:
            for t in (meta.block_tables, plan.slots, plan.valid):
                torch._dynamo.maybe_mark_dynamic(t, 0)
                torch._dynamo.maybe_mark_dynamic(t, 1)
        return compiled(input_ids, positions, kv_caches, meta)

    return forward


WARM_UP_BATCHES = (1, 3)  # one per graph; 3, not 2, so the batch size differs from every other size
WARM_UP_BLOCKS = 2 * max(WARM_UP_BATCHES)  # two per sequence


@torch.no_grad()
def warm_up(forward: DecodeForward, kv_caches: list[KVCache], block_size: int, zero_slot: int) -> None:
    """Compile both graphs by running them on the first WARM_UP_BLOCKS blocks, then clear those blocks
    again. Run before the engine takes requests. The sizes used (batch 3, 2 blocks per sequence, context
    block_size + 3) are all different, so no two per-step sizes get tied together by the first trace."""
    if zero_slot // block_size < WARM_UP_BLOCKS:  # the null block (zero_slot) follows the usable ones
        raise ValueError(f"compile needs at least {WARM_UP_BLOCKS} KV blocks (the warm-up runs on them)")
    for batch in WARM_UP_BATCHES:
        # A tensor of its own, like the runner's (a view would add guards on its base).
        tables = torch.arange(2 * batch, dtype=torch.int32).view(batch, 2).clone()  # (B, 2)
        context = block_size + 3
        meta = AttentionMetadata(
            slot_mapping=tables[:, 1].long() * block_size + 2,  # the last position of each sequence
            num_decode_seqs=batch,
            block_tables=tables,
            seq_lens=torch.full((batch,), context, dtype=torch.int32),
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
            block_size=block_size,
            zero_slot=zero_slot,
        )
        input_ids = torch.zeros(batch, dtype=torch.int64)
        positions = torch.full((batch,), context - 1, dtype=torch.int64)
        forward(input_ids, positions, kv_caches, meta)
    for k_cache, v_cache in kv_caches:
        k_cache[:WARM_UP_BLOCKS].zero_()
        v_cache[:WARM_UP_BLOCKS].zero_()
