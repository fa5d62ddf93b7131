"""Runs one scheduled batch through the model and samples the next tokens.

Owns the paged KV cache tensors. The batch is flattened: the T tokens of all scheduled sequences
in one row, generated tokens (decode rows, drafted tokens among them) first, then prompt chunks
(`StepLayout`), described to the model by an explicit AttentionMetadata (no globals).

An embedding sequence's last prompt row is pooled instead of sampled: its final-norm hidden state,
L2-normalised (vLLM's default pooling for decoder models: the last token).

Speculative decoding (backend/speculation.py): each row of a drafted entry is sampled as plain decoding
would sample it there, with the drafted tokens before it as its history, and a drafted token is kept
only when it is the token sampled in its place, so the kept tokens are plain decoding's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from backend import huge_pages
from backend.attention import AttentionMetadata, allocate_kv_caches
from backend.logits_processors import FixedInputs
from backend.models import CausalLM
from backend.sampler import (
    GREEDY_EPS,
    SampledToken,
    Sampler,
    SamplingRow,
    TokenScore,
    make_generator,
    score_tokens,
)
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


@dataclass(frozen=True, slots=True)
class Draw:
    """One sampled row of a sequence: its logits row, and the drafted tokens it comes after (its history
    for the logits processors, its grammar state, its place in the random stream)."""

    seq: Sequence
    row: int  # row of the step's sampled logits
    ahead: tuple[int, ...]  # drafted tokens before this row's position (empty: the sequence's next token)


@dataclass(slots=True)
class StepLayout:
    """How a step's tokens are laid out in the flattened batch, and what each row attends to.

    A row attends as a decode exactly when its token is a generated one (a sequence's next token, its
    drafted tokens, or generated tokens computed again after a preemption), and as a prefill row when it
    is a prompt token, however the step came about: the decode and prefill kernels sum in different
    orders, so this is what gives a token's K/V and logits the same bits whether its prompt was chunked,
    cached or recomputed, and whether its tokens were drafted. Decode rows come first, one attention
    sequence each (at its own position); then each entry's prompt rows, one attention sequence per entry.
    """

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]  # per attention sequence
    tables: list[tuple[int, ...]]  # per attention sequence
    query_start_loc: list[int]
    num_decode_rows: int
    entry_rows: list[list[int]]  # per entry: the flattened row of each of its tokens, in order

    @classmethod
    def of(cls, entries: tuple[ScheduledSequence, ...], block_size: int) -> StepLayout:
        splits = [min(max(e.seq.num_prompt_tokens - e.start_position, 0), e.num_new_tokens) for e in entries]
        num_decode_rows = sum(e.num_new_tokens - k for e, k in zip(entries, splits))
        layout = cls([0] * (num_decode_rows + sum(splits)), [], [], [], [], [0], num_decode_rows, [])
        layout.positions = [0] * len(layout.input_ids)
        layout.slots = [0] * len(layout.input_ids)
        next_decode, next_prefill = 0, num_decode_rows
        prefill_seqs: list[tuple[int, tuple[int, ...]]] = []
        for entry, split in zip(entries, splits):
            start, table = entry.start_position, entry.block_table
            rows = list(range(next_prefill, next_prefill + split))
            rows += range(next_decode, next_decode + entry.num_new_tokens - split)
            next_prefill += split
            next_decode += entry.num_new_tokens - split
            for offset, row in enumerate(rows):
                p = start + offset
                layout.input_ids[row] = entry.token_ids[offset]
                layout.positions[row] = p
                layout.slots[row] = table[p // block_size] * block_size + p % block_size
                if offset >= split:
                    layout.seq_lens.append(p + 1)
                    layout.tables.append(table)
            if split:
                prefill_seqs.append((start + split, table))
            layout.entry_rows.append(rows)
        layout.query_start_loc = list(range(num_decode_rows + 1))
        for (length, table), split in zip(prefill_seqs, [k for k in splits if k]):
            layout.seq_lens.append(length)
            layout.tables.append(table)
            layout.query_start_loc.append(layout.query_start_loc[-1] + split)
        return layout


@dataclass(slots=True)
class RunnerOutput:
    # One per sequence that samples: its new tokens (accepted drafts, then the token sampled after them)
    sampled: list[tuple[Sequence, tuple[SampledToken, ...]]] = field(default_factory=list)
    prompt_scores: list[PromptScores] = field(default_factory=list)  # for sequences that asked for prompt logprobs
    # One per embedding sequence whose last prompt token ran this step: its pooled vector, (hidden,)
    embeddings: list[tuple[Sequence, tuple[float, ...]]] = field(default_factory=list)


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
        """Computes the scheduled tokens; returns the new tokens of each sequence that samples (one, or its
        accepted drafts and one more), and the scores of the prompt tokens this step covered for
        sequences that asked for prompt logprobs."""
        with self._grad_mode():
            return self._execute(batch)

    def _execute(self, batch: SchedulerOutput) -> RunnerOutput:
        self._copy_blocks(batch.blocks_to_copy)
        if not batch.scheduled:
            return RunnerOutput()
        layout = StepLayout.of(batch.scheduled, self.block_size)
        sample_rows: list[int] = []  # hidden rows whose logits are sampled
        draws: list[Draw] = []  # what each sampled sequence row reads, in sampling order
        pooled: list[tuple[Sequence, int]] = []  # embedding sequences and the hidden row of their last token
        for entry, rows in zip(batch.scheduled, layout.entry_rows):
            if entry.samples and entry.seq.embeds:
                pooled.append((entry.seq, rows[-1]))
            elif entry.samples:
                drafts = entry.draft_token_ids
                for j in range(len(drafts) + 1):
                    sample_rows.append(rows[len(rows) - 1 - len(drafts) + j])
                    draws.append(Draw(entry.seq, len(sample_rows) - 1, drafts[:j]))
                draws.extend(Draw(child, len(sample_rows) - 1, ()) for child in entry.forked)

        dev = self.device
        max_blocks = max(len(t) for t in layout.tables)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(layout.slots, dtype=torch.int64, device=dev),
            num_decode_seqs=layout.num_decode_rows,
            block_tables=torch.tensor(
                [list(t) + [0] * (max_blocks - len(t)) for t in layout.tables], dtype=torch.int32, device=dev
            ),
            seq_lens=torch.tensor(layout.seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(layout.query_start_loc, dtype=torch.int32, device=dev),
            block_size=self.block_size,
            zero_slot=self.zero_slot,
        )
        decode_only = layout.num_decode_rows == len(layout.input_ids)
        forward = self.decode_forward if decode_only and self.decode_forward is not None else self.model
        hidden = forward(  # (T, hidden)
            torch.tensor(layout.input_ids, dtype=torch.int64, device=dev),
            torch.tensor(layout.positions, dtype=torch.int64, device=dev),
            self.kv_caches,
            meta,
        )
        output = RunnerOutput(prompt_scores=self._score_prompts(batch.scheduled, hidden, layout.entry_rows))
        if pooled:
            output.embeddings = self._pool(pooled, hidden)
        if not draws:
            return output
        logits = self.model.compute_logits(hidden[sample_rows])  # (sampled rows, vocab) fp32
        if len(draws) != len(sample_rows):
            logits = logits[
                torch.tensor([d.row for d in draws], device=dev)
            ]  # (draws, vocab): siblings read the leader's row
        rows = [self._sampling_row(d) for d in draws]
        generator_states = self._generator_states(draws)
        allowed = TokenBitmask.for_rows([(d.seq.grammar, d.ahead) for d in draws], logits.shape[1])
        tokens = self.sampler.sample(logits.float().cpu(), rows, allowed)
        output.sampled = self._accepted(draws, tokens, generator_states)
        return output

    @staticmethod
    def _pool(pooled: list[tuple[Sequence, int]], hidden: torch.Tensor) -> list[tuple[Sequence, tuple[float, ...]]]:
        """Each embedding sequence's vector: the final-norm hidden state of its last prompt token, L2-normalised."""
        rows = torch.tensor([row for _, row in pooled], device=hidden.device)
        vectors = F.normalize(hidden[rows].float(), dim=-1).cpu()  # (E, hidden) fp32, unit length
        return [(seq, tuple(vector.tolist())) for (seq, _), vector in zip(pooled, vectors)]

    @staticmethod
    def _accepted(
        draws: list[Draw], tokens: list[SampledToken], generator_states: dict[int, torch.Tensor]
    ) -> list[tuple[Sequence, tuple[SampledToken, ...]]]:
        """Each sequence's tokens: its drafted tokens up to the first that differs from the token sampled
        in its place, and that sampled token. A sequence with a generator is left where plain decoding
        leaves it: as many draws as tokens kept."""
        out: list[tuple[Sequence, tuple[SampledToken, ...]]] = []
        i = 0
        while i < len(draws):
            seq = draws[i].seq
            kept = [tokens[i]]
            rejected = False
            while i + 1 < len(draws) and draws[i + 1].seq is seq:  # its draft rows, in order
                i += 1
                # After a rejected draft, the rows were computed for tokens that are not there.
                rejected = rejected or kept[-1].token_id != draws[i].ahead[-1]
                if not rejected:
                    kept.append(tokens[i])
            state = generator_states.get(seq.seq_id)
            if state is not None and len(kept) < len(draws[i].ahead) + 1:
                seq.generator.set_state(state)
                for _ in kept:
                    torch.rand((), dtype=torch.float64, generator=seq.generator)
            out.append((seq, tuple(kept)))
            i += 1
        return out

    @staticmethod
    def _generator_states(draws: list[Draw]) -> dict[int, torch.Tensor]:
        """The generator state, before this step's draws, of each drafting sequence that draws at random."""
        return {
            d.seq.seq_id: d.seq.generator.get_state()
            for d in draws
            if len(d.ahead) == 1 and d.seq.generator is not None and d.seq.params.temperature >= GREEDY_EPS
        }

    def _score_prompts(
        self, entries: tuple[ScheduledSequence, ...], hidden: torch.Tensor, entry_rows: list[list[int]]
    ) -> list[PromptScores]:
        """For each entry that asked for prompt logprobs: the row of position p scores prompt token p + 1."""
        out = []
        for entry, rows in zip(entries, entry_rows):
            seq = entry.seq
            if seq.params.prompt_logprobs is None or seq.num_output_tokens:
                continue
            start = entry.start_position
            end = min(
                start + entry.num_new_tokens, seq.num_prompt_tokens - 1
            )  # positions whose next token is in the prompt
            if end <= start:
                continue
            row0 = rows[0]  # prompt rows are consecutive (StepLayout)
            targets = torch.tensor(seq.prompt_token_ids[start + 1 : end + 1], device=self.device)
            scores: list[TokenScore] = []
            for i in range(0, end - start, SCORE_ROWS):
                chunk = hidden[row0 + i : row0 + min(i + SCORE_ROWS, end - start)]  # (R, hidden)
                logits = self.model.compute_logits(chunk).float().cpu()  # (R, vocab)
                scores += score_tokens(logits, targets[i : i + chunk.shape[0]].cpu(), seq.params.prompt_logprobs)
            out.append(PromptScores(seq, start + 1, scores))
        return out

    def _sampling_row(self, draw: Draw) -> SamplingRow:
        seq = draw.seq
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
            output_token_ids=tuple(seq.output_token_ids) + draw.ahead,
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
