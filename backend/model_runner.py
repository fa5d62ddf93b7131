"""Runs one scheduled batch through the model and samples the next tokens.

Owns the paged KV cache tensors. The batch is flattened: the T tokens of all scheduled sequences
in one row, decode sequences (one token each) first, then prefill chunks, described to the model by
an explicit AttentionMetadata (no globals).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend import huge_pages
from backend.attention import AttentionMetadata, allocate_kv_caches
from backend.logits_processors import FixedInputs
from backend.models import CausalLM
from backend.sampler import SampledToken, Sampler, SamplingRow, TokenScore, make_generator, score_tokens
from backend.scheduler import ScheduledSequence, SchedulerOutput
from backend.sequence import Sequence
from backend.structured_output import TokenBitmask

SCORE_ROWS = 64  # prompt positions scored per logits matrix: bounds the (rows, vocab) memory of a long prompt


@dataclass(slots=True)
class PromptScores:
    """Scores of some prompt tokens of one sequence, computed in one step (one prefill chunk)."""

    seq: Sequence
    first_position: int  # prompt position of scores[0]'s token (>= 1)
    scores: list[TokenScore]


@dataclass(slots=True)
class RunnerOutput:
    sampled: list[tuple[Sequence, SampledToken]] = field(default_factory=list)  # one per sequence that samples
    prompt_scores: list[PromptScores] = field(default_factory=list)  # for sequences that asked for prompt logprobs


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        dtype: torch.dtype,
        compile_decode: bool = False,
    ) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()
        # (layers) x [(num_blocks + 1, block_size, kv_heads, head_dim) K, same V]. The extra last
        # block is the null block: the block manager never hands it out, so it stays zero and
        # padded context positions can read it instead of being masked.
        kv_shape = (num_blocks + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
        kv_caches = None
        if huge_pages.suits(device, compile_decode):
            kv_caches = huge_pages.kv_caches(cfg.num_hidden_layers, kv_shape, dtype)
        self.kv_caches = kv_caches or allocate_kv_caches(cfg.num_hidden_layers, *kv_shape, dtype, device)
        self.zero_slot = num_blocks * block_size
        self.decode_forward = None  # compiled_decode.DecodeForward when compile_decode
        # inference_mode is the cheaper mode in eager; the compiled graph needs no_grad (see compiled_decode).
        self._grad_mode = torch.no_grad if compile_decode else torch.inference_mode
        if compile_decode:
            # Imported here: it imports torch._dynamo, which imports triton, which must not happen
            # before a test process sets TRITON_INTERPRET (tests/kernels/test_triton_kernels.py).
            from backend import compiled_decode

            self.decode_forward = compiled_decode.compile_decode_forward(model)
            compiled_decode.warm_up(self.decode_forward, self.kv_caches, block_size, self.zero_slot)

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        """Computes the scheduled tokens; returns one sampled token per sequence that samples, and the
        scores of the prompt tokens this step covered for sequences that asked for prompt logprobs."""
        with self._grad_mode():
            return self._execute(batch)

    def _execute(self, batch: SchedulerOutput) -> RunnerOutput:
        self._copy_blocks(batch.blocks_to_copy)
        if not batch.scheduled:
            return RunnerOutput()
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        sample_rows: list[int] = []  # row of the last token of each sampling entry
        sampling_seqs: list[Sequence] = []
        row_of_seq: list[int] = []  # logits row each sampling sequence reads (siblings share the leader's)
        bs = self.block_size
        for entry in batch.scheduled:
            start, n = entry.start_position, entry.num_new_tokens
            input_ids.extend(entry.token_ids)
            positions.extend(range(start, start + n))
            table = entry.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            seq_lens.append(start + n)
            query_start_loc.append(query_start_loc[-1] + n)
            if entry.samples:
                sample_rows.append(query_start_loc[-1] - 1)
                for seq in (entry.seq, *entry.forked):
                    sampling_seqs.append(seq)
                    row_of_seq.append(len(sample_rows) - 1)

        max_blocks = max(len(e.block_table) for e in batch.scheduled)
        tables = [list(e.block_table) + [0] * (max_blocks - len(e.block_table)) for e in batch.scheduled]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_seqs=batch.num_decode_seqs,
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            block_size=bs,
            zero_slot=self.zero_slot,
        )
        decode_only = batch.num_decode_seqs == len(batch.scheduled)
        forward = self.decode_forward if decode_only and self.decode_forward is not None else self.model
        hidden = forward(  # (T, hidden)
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            self.kv_caches,
            meta,
        )
        output = RunnerOutput(prompt_scores=self._score_prompts(batch.scheduled, hidden, query_start_loc))
        if not sampling_seqs:
            return output
        logits = self.model.compute_logits(hidden[sample_rows])  # (entries, vocab) fp32
        if len(row_of_seq) != len(sample_rows):
            logits = logits[torch.tensor(row_of_seq, device=dev)]  # (sequences, vocab): siblings read the leader's row
        rows = [self._sampling_row(seq) for seq in sampling_seqs]
        allowed = TokenBitmask.for_rows([seq.grammar for seq in sampling_seqs], logits.shape[1])
        output.sampled = list(zip(sampling_seqs, self.sampler.sample(logits.float().cpu(), rows, allowed)))
        return output

    def _score_prompts(
        self, entries: tuple[ScheduledSequence, ...], hidden: torch.Tensor, query_start_loc: list[int]
    ) -> list[PromptScores]:
        """For each entry that asked for prompt logprobs: the row of position p scores prompt token p + 1."""
        out = []
        for entry, row0 in zip(entries, query_start_loc):
            seq = entry.seq
            if seq.params.prompt_logprobs is None or seq.num_output_tokens:
                continue
            start = entry.start_position
            end = min(
                start + entry.num_new_tokens, seq.num_prompt_tokens - 1
            )  # positions whose next token is in the prompt
            if end <= start:
                continue
            targets = torch.tensor(seq.prompt_token_ids[start + 1 : end + 1], device=self.device)
            scores: list[TokenScore] = []
            for i in range(0, end - start, SCORE_ROWS):
                rows = hidden[row0 + i : row0 + min(i + SCORE_ROWS, end - start)]  # (R, hidden)
                logits = self.model.compute_logits(rows).float().cpu()  # (R, vocab)
                scores += score_tokens(logits, targets[i : i + rows.shape[0]].cpu(), seq.params.prompt_logprobs)
            out.append(PromptScores(seq, start + 1, scores))
        return out

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        if seq.generator is None:
            # Created once per sequence and kept across preemption, so a resumed sequence
            # continues the same random stream and yields the same tokens.
            seq.generator = make_generator(seq.params.seed, seq.seq_index)
        if seq.logits_inputs is None:
            seq.logits_inputs = FixedInputs(seq.params, self.eos_token_ids)
        return SamplingRow(
            params=seq.params,
            generator=seq.generator,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=tuple(seq.output_token_ids),
            eos_token_ids=self.eos_token_ids,
            bad_words_token_ids=seq.bad_words_token_ids,
            fixed=seq.logits_inputs,
        )

    def _copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]
