"""Shared test builders: the real SmolLM2 tokenizer and a tiny random Llama that uses it.

The tiny model keeps engine tests fast (milliseconds per step) while everything else, the
tokenizer, scheduler, KV cache, sampler and output processor, is the real thing.
"""

from __future__ import annotations

import functools

import torch

from backend.checkpoint import Checkpoint, load_checkpoint
from backend.coalescing import PendingResponses
from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.models import LlamaConfig
from protocol import EngineOutput, RequestFailure, StepOutput
from tokenization.tokenizer import Tokenizer


@functools.cache
def smollm2_checkpoint() -> Checkpoint:
    return load_checkpoint("smollm2", dtype=torch.float32)


def smollm2_tokenizer() -> Tokenizer:
    return smollm2_checkpoint().tokenizer


def tiny_checkpoint(seed: int = 0, head_dim: int = 16) -> Checkpoint:
    """head_dim 32: the shape the C++ attention kernels take (16 runs the torch references)."""
    tok = smollm2_tokenizer()
    cfg = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.5

    sd = {
        "model.embed_tokens.weight": w(cfg.vocab_size, cfg.hidden_size),
        "model.norm.weight": torch.ones(cfg.hidden_size),
    }
    kv = cfg.num_key_value_heads * cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        sd |= {
            p + "self_attn.q_proj.weight": w(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size),
            p + "self_attn.k_proj.weight": w(kv, cfg.hidden_size),
            p + "self_attn.v_proj.weight": w(kv, cfg.hidden_size),
            p + "self_attn.o_proj.weight": w(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim),
            p + "mlp.gate_proj.weight": w(cfg.intermediate_size, cfg.hidden_size),
            p + "mlp.up_proj.weight": w(cfg.intermediate_size, cfg.hidden_size),
            p + "mlp.down_proj.weight": w(cfg.hidden_size, cfg.intermediate_size),
            p + "input_layernorm.weight": torch.ones(cfg.hidden_size),
            p + "post_attention_layernorm.weight": torch.ones(cfg.hidden_size),
        }
    return Checkpoint(config=cfg, state_dict=sd, tokenizer=tok)


def tiny_engine(head_dim: int = 16, **overrides) -> LLMEngine:
    settings = dict(block_size=8, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=64)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), checkpoint=tiny_checkpoint(head_dim=head_dim))


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> list[EngineOutput]:
    outputs: list[EngineOutput] = []
    for _ in range(max_steps):
        if not engine.has_work():
            return outputs
        outputs.extend(engine.step())
    raise AssertionError("engine did not finish")


def check_stream_invariants(
    outputs: list[EngineOutput], n_by_request: dict[str, int]
) -> dict[tuple[str, int], list[StepOutput]]:
    """Invariants 2-5 of docs/contract.md over everything an engine emitted; returns messages per sequence."""
    per_seq: dict[tuple[str, int], list[StepOutput]] = {}
    ended: set[str] = set()
    for out in outputs:
        assert out.request_id not in ended, f"output after the end of {out.request_id}"
        if isinstance(out, RequestFailure):
            ended.add(out.request_id)
            continue
        msgs = per_seq.setdefault((out.request_id, out.seq_index), [])
        assert not (msgs and msgs[-1].finished), "a message after the sequence finished"
        assert out.step == sum(m.num_steps for m in msgs), "steps must be contiguous from 0"
        msgs.append(out)
        assert out.num_output_tokens == sum(len(m.token_ids) for m in msgs)
        if out.logprobs is not None:
            assert len(out.logprobs.logprobs) == len(out.token_ids) == len(out.logprobs.top_token_ids)
        if out.request_finished:
            ended.add(out.request_id)
    for request_id, n in n_by_request.items():
        assert request_id in ended, f"{request_id} never ended"
        seqs = [per_seq.get((request_id, i), []) for i in range(n)]
        if any(seqs):  # (a request that failed may have no messages at all)
            finished = [m for msgs in seqs for m in msgs if m.finished]
            assert all(msgs and msgs[-1].finished for msgs in seqs) or any(
                isinstance(o, RequestFailure) and o.request_id == request_id for o in outputs
            )
            assert len(finished) <= n
    return per_seq


def coalesce(pending: list[tuple[object, EngineOutput]]) -> list[tuple[object, EngineOutput, int]]:
    """Queued (sink, message) pairs -> (sink, message, queued messages it covers), in the order the
    engine loop's sender sends them when it finds them all queued at once."""
    responses: PendingResponses[object] = PendingResponses()
    for sink, output in pending:
        responses.add(sink, output)
    sent = []
    while responses:
        sent += responses.take()
    return sent
