"""Embedding requests (Task.EMBED) in the engine, with the tiny model: one message with the pooled,
L2-normalised last hidden state; the same vector alone, in a batch, chunked and from the prefix cache;
generations beside them exactly as alone."""

from __future__ import annotations

import math

import pytest
import torch

from backend.sequence import SequenceStatus
from protocol import FinishReason, InvalidRequestError, SamplingParams, StepOutput, Task, wire
from tests.engine_helpers import check_stream_invariants, run_to_completion, tiny_engine

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "hello",
    "A somewhat longer prompt, long enough to span several KV blocks of eight tokens each, and then some more",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=10, temperature=0.9, seed=7, ignore_eos=True, logprobs=2)


def embed_alone(engine, prompt, request_id="e") -> StepOutput:
    engine.add_request(engine.make_request(request_id, prompt, SamplingParams(), Task.EMBED))
    (out,) = run_to_completion(engine)
    return out


def generations(outputs) -> dict[str, list[tuple]]:
    """Per generating request, what its stream carried (tokens, texts, logprobs, finish)."""
    per: dict[str, list[tuple]] = {}
    for out in outputs:
        if out.embedding is None:
            per.setdefault(out.request_id, []).append(
                (out.seq_index, out.token_ids, out.text_delta, out.logprobs, out.finish_reason)
            )
    return per


@pytest.mark.parametrize("head_dim", [16, 32])  # 32: the C++ attention kernels; 16: the torch references
def test_one_message_with_a_unit_vector_and_nothing_kept(head_dim):
    engine = tiny_engine(head_dim=head_dim)
    out = embed_alone(engine, PROMPTS[0])
    num_prompt = len(engine.tokenizer.encode(PROMPTS[0]))
    assert out.step == 0 and out.token_ids == () and out.text_delta == "" and out.logprobs is None
    assert out.finish_reason is FinishReason.STOP and out.request_finished and out.num_output_tokens == 0
    assert out.num_prompt_tokens == num_prompt
    assert len(out.embedding) == engine.runner.model.config.hidden_size
    assert math.isclose(math.fsum(x * x for x in out.embedding), 1.0, rel_tol=1e-5)
    assert engine.block_manager.stats().used == 0 and not engine.has_work()
    assert engine.stats().generation_tokens == 0


def test_the_vector_is_the_last_tokens_final_norm_hidden_state():
    engine = tiny_engine()
    ids = engine.tokenizer.encode(PROMPTS[2])
    out = embed_alone(engine, ids)
    # The same model run alone over the whole prompt (one prefill, fresh KV cache).
    from backend.attention import AttentionMetadata, allocate_kv_caches

    model, bs = engine.runner.model, 8
    cfg = model.config
    blocks = -(-len(ids) // bs)
    caches = allocate_kv_caches(
        cfg.num_hidden_layers, blocks + 1, bs, cfg.num_key_value_heads, cfg.head_dim, torch.float32, torch.device("cpu")
    )
    meta = AttentionMetadata(
        slot_mapping=torch.arange(len(ids)),
        num_decode_seqs=0,
        block_tables=torch.arange(blocks, dtype=torch.int32).unsqueeze(0),
        seq_lens=torch.tensor([len(ids)], dtype=torch.int32),
        query_start_loc=torch.tensor([0, len(ids)], dtype=torch.int32),
        block_size=bs,
        zero_slot=blocks * bs,
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), caches, meta)  # (T, C)
    expected = torch.nn.functional.normalize(hidden[-1].float(), dim=-1)  # (C,)
    assert torch.allclose(torch.tensor(out.embedding), expected, atol=1e-5)


@pytest.mark.parametrize("budget", [64, 16])  # 16: the long prompts chunked over several steps
def test_a_prompts_vector_is_the_same_alone_in_a_batch_and_from_the_prefix_cache(budget):
    alone = [embed_alone(tiny_engine(head_dim=32, max_num_batched_tokens=budget), p).embedding for p in PROMPTS]
    engine = tiny_engine(head_dim=32, max_num_batched_tokens=budget)
    for i, p in enumerate(PROMPTS):
        engine.add_request(engine.make_request(f"e{i}", p, SamplingParams(), Task.EMBED))
    for i, p in enumerate(PROMPTS):
        engine.add_request(engine.make_request(f"g{i}", p, GREEDY))
    outputs = run_to_completion(engine)
    check_stream_invariants(outputs, {f"{k}{i}": 1 for k in "eg" for i in range(len(PROMPTS))})
    batched = {o.request_id: o.embedding for o in outputs if o.embedding is not None}
    for i in range(len(PROMPTS)):
        assert batched[f"e{i}"] == alone[i]
    # Again on the warm engine: the prompts' blocks are cached now, all but the last token come from there.
    cached = embed_alone(engine, PROMPTS[2], "again")
    assert cached.num_cached_tokens > 0
    assert cached.embedding == alone[2]


@pytest.mark.parametrize("budget", [64, 16])
def test_generations_beside_embeddings_are_exactly_as_alone(budget):
    """head_dim 32: the C++ kernels, whose prompt rows give the same bits however the budget splits a prompt
    into chunks (the torch references' sums depend on the chunk, as they do beside other generations)."""

    def run(with_embeddings: bool):
        engine = tiny_engine(head_dim=32, max_num_batched_tokens=budget)
        for i, p in enumerate(PROMPTS):
            engine.add_request(engine.make_request(f"g{i}", p, GREEDY if i % 2 else SAMPLED))
            if with_embeddings:
                engine.add_request(engine.make_request(f"e{i}", PROMPTS[-1 - i], SamplingParams(), Task.EMBED))
        outputs = run_to_completion(engine)
        assert engine.block_manager.stats().used == 0
        return outputs

    alone, mixed = run(False), run(True)
    assert generations(mixed) == generations(alone)
    assert sum(o.embedding is not None for o in mixed) == len(PROMPTS)


def test_an_embedding_may_fill_the_context_and_takes_no_sampling():
    engine = tiny_engine(max_model_len=40)
    full = list(range(100, 140))
    assert embed_alone(engine, full).num_prompt_tokens == 40
    with pytest.raises(InvalidRequestError) as e:
        engine.make_request("g", full, SamplingParams(max_tokens=1))
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        engine.make_request("e", full + [1], SamplingParams(), Task.EMBED)
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    for params in (SamplingParams(n=2), SamplingParams(max_tokens=3), SamplingParams(prompt_logprobs=1)):
        with pytest.raises(InvalidRequestError) as e:
            engine.make_request("e", "hi", params, Task.EMBED)
        assert e.value.param == "sampling_params"


def test_an_aborted_embedding_ends_with_abort_and_frees_its_blocks():
    engine = tiny_engine(max_num_batched_tokens=16)
    engine.add_request(engine.make_request("e", PROMPTS[2], SamplingParams(), Task.EMBED))
    engine.step()
    assert engine.block_manager.stats().used > 0
    engine.abort_request("e")
    (out,) = run_to_completion(engine)
    assert out.finish_reason is FinishReason.ABORT and out.embedding is None and out.request_finished
    assert engine.block_manager.stats().used == 0


def test_the_embedding_crosses_the_wire_as_fp32():
    engine = tiny_engine()
    out = embed_alone(engine, "wire")
    arrays = wire.encode_step(out)
    assert arrays[wire.EMBEDDING_OUTPUT].dtype.name == "float32"
    raw = {name: (_datatype(a), a.shape, _raw(a)) for name, a in arrays.items()}
    back = wire.decode_step(raw, out.request_id, True)
    assert back.embedding == tuple(float(x) for x in arrays[wire.EMBEDDING_OUTPUT])
    assert back == out.__class__(**{**{f: getattr(out, f) for f in out.__slots__}, "embedding": back.embedding})
    assert wire.task(None) is Task.GENERATE and wire.task("embed") is Task.EMBED
    with pytest.raises(InvalidRequestError):
        wire.task("classify")


def test_an_embedding_runs_its_prompt_in_chunks_and_never_decodes():
    engine = tiny_engine(max_num_batched_tokens=16)
    engine.add_request(engine.make_request("e", PROMPTS[2], SamplingParams(), Task.EMBED))
    (seq,) = engine.output_processor.requests["e"].sequences
    entries = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        entries.extend(e for e in batch.scheduled if e.seq is seq)
        return batch

    engine.scheduler.schedule = recording
    run_to_completion(engine)
    assert len(entries) > 1 and not any(e.is_decode for e in entries)
    assert [e.samples for e in entries] == [False] * (len(entries) - 1) + [True]
    assert sum(e.num_new_tokens for e in entries) == seq.num_prompt_tokens
    assert seq.status is SequenceStatus.FINISHED and seq.output_token_ids == []


def _datatype(a) -> str:
    return {"int32": "INT32", "float32": "FP32", "float64": "FP64", "object": "BYTES"}[a.dtype.name]


def _raw(a) -> bytes:
    if a.dtype.name != "object":
        return a.astype(a.dtype.newbyteorder("<")).tobytes()
    return b"".join(len(v).to_bytes(4, "little") + v for v in a.reshape(-1))
