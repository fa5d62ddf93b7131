"""The engine: one `step()` = schedule -> run the model -> process outputs.

One thread owns an engine (the engine thread of backend/engine_loop.py, a benchmark, a test): it builds
it and calls add_request, abort_request, has_work, step, stats and, at the end, close. `make_request`
alone is safe from any thread (backend/input_processor.py): Triton's execute thread calls it while the
engine steps. Requests
enter with `add_request` and leave through the StepOutputs that `step` returns.
"""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import torch

from backend import huge_pages
from backend.admission import AdmissionGroups
from backend.beam_search import BeamSearch
from backend.block_manager import BlockManager
from backend.checkpoint import Checkpoint, load_checkpoint
from backend.config import EngineConfig, RuntimeInfo
from backend.grammar_compiler import GrammarBudget, StructuredOutputCompiler
from backend.input_processor import InputProcessor
from backend.model_runner import ModelRunner, kv_block_bytes
from backend.models import build_model
from backend.output_processor import OutputProcessor
from backend.scheduler import Scheduler, SchedulerConfig
from backend.sequence import Sequence, SequenceStatus
from backend.speculation import NgramSpeculator, SpeculationConfig
from backend.structured_output import GrammarState
from kernels import cpu_kernels
from protocol import (
    AdmissionGroup,
    EngineOutput,
    EngineOverloaded,
    GenerateRequest,
    InvalidRequestError,
    RequestFailure,
    SamplingParams,
    Task,
)
from protocol.errors import TOO_MANY_SEQUENCES

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.05  # how long an otherwise idle step waits for a grammar to finish compiling


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for metrics; counters are cumulative since start."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    aborted_requests: int
    rejected_requests: int  # refused because the queue was full
    spec_draft_tokens: int = 0  # drafted tokens verified (speculative decoding)
    spec_accepted_tokens: int = 0  # of them, accepted


class LLMEngine:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        device = torch.device(config.device)
        if device.type == "cpu":
            cpu_kernels.load()  # before the model packs its weights for them
        dtype = getattr(torch, config.torch_dtype_name)
        checkpoint = checkpoint or load_checkpoint(config.model, dtype=torch.float32)
        self.tokenizer = checkpoint.tokenizer
        model_cfg = checkpoint.config
        model = build_model(model_cfg)
        model.load_weights(checkpoint.state_dict)
        model.to(device=device, dtype=dtype).eval()
        if huge_pages.suits(device, config.compile):  # after .to(), which repacks the panels
            huge_pages.place_panels(model)

        block_bytes = kv_block_bytes(
            model_cfg.num_hidden_layers, config.block_size, model_cfg.num_key_value_heads, model_cfg.head_dim, dtype
        )
        num_blocks = config.num_kv_blocks or max(2, int(config.kv_cache_gib * 2**30) // block_bytes)
        # A sequence alone must fit in the pool, or it would preempt itself forever.
        max_model_len = min(
            config.max_model_len or model_cfg.max_position_embeddings,
            model_cfg.max_position_embeddings,
            num_blocks * config.block_size,
        )
        self.runtime = RuntimeInfo(
            num_kv_blocks=num_blocks,
            max_model_len=max_model_len,
            vocab_size=model_cfg.vocab_size,
            eos_token_ids=tuple(self.tokenizer.eos_token_ids),
            block_size=config.block_size,
        )
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_model_len,
                block_size=config.block_size,
            ),
            self.block_manager,
        )
        self.runner = ModelRunner(
            model,
            num_blocks,
            config.block_size,
            self.runtime.eos_token_ids,
            device,
            dtype,
            compile_decode=config.compile,
        )
        self.output_processor = OutputProcessor(self.tokenizer, max_model_len)
        self.speculator = None
        if config.speculative == "ngram":
            spec = SpeculationConfig(
                config.num_speculative_tokens, config.ngram_min, config.ngram_max, config.speculative_row_cost
            )
            self.speculator = NgramSpeculator(spec, max_model_len)
        self._draft_tokens = 0
        self._accepted_tokens = 0
        self.structured_outputs = StructuredOutputCompiler(
            self.tokenizer, model_cfg.vocab_size, self.runtime.eos_token_ids, GrammarBudget.from_config(config)
        )
        self.input_processor = InputProcessor(
            self.tokenizer, self.runtime, config.max_num_seqs, self.structured_outputs
        )
        self._beam_searches: dict[str, BeamSearch] = {}  # beam-search requests: their beams and finished ones
        # Constrained requests whose grammar is still compiling: kept out of the scheduler until it is ready.
        self._compiling: dict[str, tuple[GenerateRequest, Future]] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._pending: list[EngineOutput] = []  # abort messages waiting for the next step() to return them
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._aborted = 0
        self._rejected = 0
        self._admission_groups = AdmissionGroups()
        logger.info("engine ready: %d KV blocks of %d tokens, context %d", num_blocks, config.block_size, max_model_len)

    # -- requests -------------------------------------------------------------------------------

    def make_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, task: Task = Task.GENERATE
    ) -> GenerateRequest:
        """Tokenizes and validates (backend/input_processor.py); raises InvalidRequestError for anything
        the engine cannot run. Safe from any thread."""
        return self.input_processor.make_request(request_id, prompt, params, task)

    def add_request(self, request: GenerateRequest, admission_group: AdmissionGroup | None = None) -> None:
        """Queues the request; a constrained one joins the scheduler once its grammar is compiled.
        Raises EngineOverloaded when the waiting sequences would pass `max_waiting_seqs`; the first
        request of an `admission_group` (the same client request) is judged for the whole group, which
        its other requests then join or are refused with (backend/admission.py)."""
        if self._is_running(request.request_id) or request.request_id in self._compiling:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running", "request_id")
        if not self._admission_groups.joins_admitted(admission_group):
            refusal = self._admission_groups.refusal(admission_group) or self._queue_refusal(request, admission_group)
            if refusal is not None:
                self._rejected += isinstance(refusal, EngineOverloaded)
                self._admission_groups.refused(admission_group, refusal)
                raise refusal
        self._admission_groups.admitted(admission_group)
        spec = request.params.structured_outputs
        if spec is None:
            self._schedule_request(request, None)
        else:
            self._compiling[request.request_id] = (request, self.structured_outputs.compiled(spec))

    def _queue_refusal(self, request: GenerateRequest, group: AdmissionGroup | None) -> InvalidRequestError | None:
        """Why the queue bound refuses the request with all of its group's sequences, or None."""
        bound = self.config.max_waiting_seqs
        if bound is None:
            return None
        prompts = 1 if group is None else max(group.size, 1)
        needed = prompts * request.params.n
        if needed > bound + self.config.max_num_seqs:  # never fits, not even on an idle server
            return InvalidRequestError(
                f"the request needs {needed} sequences ({prompts} prompts x n={request.params.n}); this server "
                f"runs {self.config.max_num_seqs} and queues at most {bound}: send it in smaller parts",
                "prompt" if prompts > 1 else "n",
                TOO_MANY_SEQUENCES,
            )
        waiting = self._num_waiting_seqs()
        if waiting + needed > bound + self.scheduler.num_free_seats:  # the free seats take theirs at the next step
            return EngineOverloaded(
                f"the server is overloaded: {waiting} sequences are waiting (at most {bound}); retry later",
                code="overloaded",
            )
        return None

    def _schedule_request(self, request: GenerateRequest, compiled_grammar) -> None:
        arrival = next(self._arrivals)
        seqs = [
            Sequence(
                seq_id=next(self._seq_ids),
                request_id=request.request_id,
                seq_index=i,
                prompt_token_ids=request.prompt_token_ids,
                params=request.params,
                arrival=arrival,
                bad_words_token_ids=request.bad_words_token_ids,
                embeds=request.task is Task.EMBED,
            )
            for i in range(request.params.n)
        ]
        if compiled_grammar is not None:
            for seq in seqs:  # n > 1: each sibling walks the grammar on its own
                seq.grammar = GrammarState(compiled_grammar)
        if request.params.use_beam_search:
            self._beam_searches[request.request_id] = BeamSearch(
                request.request_id,
                seqs,
                self.tokenizer,
                frozenset(self.runtime.eos_token_ids),
                self.runtime.max_model_len,
            )
        else:
            self.output_processor.add_request(request.request_id, seqs)
        self.scheduler.add_request(seqs)
        self._prompt_tokens += len(request.prompt_token_ids)

    def abort_request(self, request_id: str) -> None:
        """Frees the request's KV blocks now; its last messages come with the next step()."""
        if request_id in self._compiling:  # admitted unconstrained only to be ended at once, like any other
            request, _ = self._compiling.pop(request_id)
            self._schedule_request(request, None)
        if not self._is_running(request_id):
            return
        seqs = self.scheduler.abort_request(request_id)
        self._aborted += 1
        if (search := self._beam_searches.pop(request_id, None)) is not None:
            self._pending.extend(search.abort_messages())
        else:
            self._pending.extend(self.output_processor.abort_sequences(seqs))

    def _is_running(self, request_id: str) -> bool:
        return request_id in self.output_processor.requests or request_id in self._beam_searches

    def has_work(self) -> bool:
        return bool(self._pending) or bool(self._compiling) or self.scheduler.has_unfinished()

    # -- the loop -------------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        self._admit_compiled()
        batch = self.scheduler.schedule()
        try:
            result = self.runner.execute(batch)
        except Exception as exc:  # noqa: BLE001 - one bad batch must not take the engine down
            return self._pending_outputs() + self._fail_batch(batch, exc)
        beam_messages = self._advance_beams(result) if self._beam_searches else []
        self.scheduler.update_from_output([(seq, tuple(t.token_id for t in toks)) for seq, toks in result.sampled])
        messages, finished = self.output_processor.process(result)
        for seq in finished:
            self.scheduler.finish(seq)
        messages += beam_messages
        self._generation_tokens += sum(len(m.token_ids) for m in messages)
        if self.speculator is not None:
            self._speculate(batch, result)
        return self._pending_outputs() + messages

    def _advance_beams(self, result) -> list[EngineOutput]:
        """Takes the beam-search sequences' rows out of the step's result and advances their searches
        (backend/beam_search.py): beams move between sequences, spare ones finish, and a search that
        ended returns its request's messages. A search one of whose beams missed the step (preempted)
        waits for it: the beams that sampled compute their last token again next step."""
        rows: dict[str, dict] = {}
        plain = []
        for seq, toks in result.sampled:
            if seq.request_id in self._beam_searches:
                rows.setdefault(seq.request_id, {})[seq] = toks[-1]
            else:
                plain.append((seq, toks))
        result.sampled = plain
        messages: list[EngineOutput] = []
        for request_id, sampled in rows.items():
            search = self._beam_searches[request_id]
            step = search.advance(sampled)
            if step is None:
                for seq in sampled:
                    seq.num_computed_tokens -= 1
                continue
            for choice in step.choices:
                if choice.moves:
                    self.scheduler.fork_beam(choice.seq, choice.parent)
            self.scheduler.update_from_output([(c.seq, (c.token.token_id,)) for c in step.choices])
            for seq in step.dropped:
                self.scheduler.finish(seq)
            if step.outputs:
                del self._beam_searches[request_id]
                messages.extend(step.outputs)
        return messages

    def _speculate(self, batch, result) -> None:
        """Judges this step's drafts and proposes the next step's, for the sequences that decode on."""
        speculator = self.speculator
        drafted = {e.seq.seq_id: len(e.draft_token_ids) for e in batch.scheduled if e.draft_token_ids}
        num_decoding = self.scheduler.num_running
        for seq, toks in result.sampled:
            num_drafted = drafted.get(seq.seq_id, 0)
            if num_drafted:
                self._draft_tokens += num_drafted
                self._accepted_tokens += len(toks) - 1
                speculator.judge(seq, num_drafted, len(toks) - 1)
            if seq.status is SequenceStatus.RUNNING:
                seq.draft_token_ids = speculator.propose(seq, num_decoding)

    def _admit_compiled(self) -> None:
        """Schedules the constrained requests whose grammar is ready and ends those whose grammar was
        refused (past the compiler's time or memory budget: backend/grammar_compiler.py); with nothing
        else to run, waits a moment for one (compiling runs on its own threads, so no step waits)."""
        if not self._compiling:
            return
        if not self.scheduler.has_unfinished() and not self._pending:
            wait_futures([f for _, f in self._compiling.values()], timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)
        for request_id, (request, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            error = future.exception()
            if isinstance(error, InvalidRequestError):
                self._pending.append(RequestFailure.refused(request_id, error))
            elif error is not None:
                self._pending.append(RequestFailure(request_id, f"grammar compilation failed: {error}"))
            else:
                self._schedule_request(request, future.result())

    def _pending_outputs(self) -> list[EngineOutput]:
        pending, self._pending = self._pending, []
        return pending

    def _fail_batch(self, batch, exc: Exception) -> list[EngineOutput]:
        """Every request the failed batch touched ends with an error; the others go on."""
        logger.exception("engine step failed")
        request_ids = dict.fromkeys(entry.seq.request_id for entry in batch.scheduled)
        failures: list[EngineOutput] = []
        for request_id in request_ids:
            self.scheduler.abort_request(request_id, cache=False)
            self.output_processor.drop_request(request_id)
            self._beam_searches.pop(request_id, None)
            failures.append(RequestFailure(request_id, f"engine error: {type(exc).__name__}: {exc}"))
        return failures

    def _num_waiting_seqs(self) -> int:
        return self.scheduler.num_waiting_seqs + sum(r.params.n for r, _ in self._compiling.values())

    def close(self) -> None:
        """Ends what the engine started beside its thread (the grammar compiler's worker processes)."""
        self.structured_outputs.close()

    def stats(self) -> EngineStats:
        kv = self.block_manager.stats()
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self._num_waiting_seqs(),
            kv_blocks_total=kv.total,
            kv_blocks_used=kv.used,
            kv_blocks_free=kv.free,
            kv_blocks_cached=kv.cached,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            aborted_requests=self._aborted,
            rejected_requests=self._rejected,
            spec_draft_tokens=self._draft_tokens,
            spec_accepted_tokens=self._accepted_tokens,
        )
