"""backend/huge_pages.py: the weight panels and the KV cache in huge-page buffers give the same bits."""

import gc

import pytest
import torch

from backend.huge_pages import HUGE_PAGE_BYTES, huge_page_buffer, kv_caches, panel_slots, place_panels
from backend.models import build_model
from benchmarks.model_step import decode_batch
from kernels import cpu_kernels
from tests.engine_helpers import tiny_checkpoint

needs_kernels = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels are not built here")


def _model():
    ck = tiny_checkpoint()
    model = build_model(ck.config)
    model.load_weights(ck.state_dict)
    return model.eval()


def _decode_logits(model, rows: int) -> torch.Tensor:
    kv, positions, meta = decode_batch(model.config, rows, ctx=20)
    for k, v in kv:  # a context to attend to
        k.copy_(torch.randn(k.shape, generator=torch.Generator().manual_seed(1)))
        v.copy_(torch.randn(v.shape, generator=torch.Generator().manual_seed(2)))
    ids = torch.arange(rows) * 7 + 3
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, kv, meta))


def _panels(model) -> list[torch.Tensor]:
    return [getattr(linear, name) for linear, name in panel_slots(model)]


@needs_kernels
def test_the_panels_move_into_one_buffer_and_the_logits_keep_their_bits(monkeypatch):
    monkeypatch.delenv("LLM_HUGE_PAGES", raising=False)
    model = _model()
    before = {rows: _decode_logits(model, rows) for rows in (1, 3)}
    old = _panels(model)
    moved = place_panels(model)
    new = _panels(model)
    assert moved >= sum(t.nbytes for t in old) and len(new) == len(old)
    storages = {t.untyped_storage().data_ptr() for t in new}
    assert len(storages) == 1  # one buffer
    assert min(t.data_ptr() for t in new) % HUGE_PAGE_BYTES == 0
    assert all(t.data_ptr() % 64 == 0 for t in new)
    assert all(torch.equal(a, b) for a, b in zip(old, new, strict=True))
    del old
    gc.collect()  # the buffer lives as long as the panels that view it
    for rows, logits in before.items():
        assert torch.equal(_decode_logits(model, rows), logits)


def test_off_by_environment(monkeypatch):
    monkeypatch.setenv("LLM_HUGE_PAGES", "0")
    model = _model()
    old = _panels(model)
    assert place_panels(model) == 0
    assert all(a is b for a, b in zip(old, _panels(model), strict=True))


def test_the_buffer_is_advised_huge_pages():
    buffer = huge_page_buffer(3 * HUGE_PAGE_BYTES)
    start = buffer.data_ptr()
    assert start % HUGE_PAGE_BYTES == 0
    buffer.fill_(1)
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp = f.read()
    if "[never]" in thp:
        pytest.skip("transparent huge pages are off on this machine")
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            if lo <= start < hi:
                fields = dict(x.split(":", 1) for x in lines[i + 1 : i + 30] if ":" in x and not x[0].isdigit())
                assert fields["THPeligible"].strip() == "1"
                return
    pytest.fail("the buffer's mapping is not in /proc/self/smaps")


def test_kv_caches_are_zeroed_views_of_one_buffer(monkeypatch):
    monkeypatch.delenv("LLM_HUGE_PAGES", raising=False)
    shape = (5, 4, 2, 8)  # (blocks, block_size, kv_heads, head_dim)
    caches = kv_caches(3, shape, torch.float32)
    assert len(caches) == 3
    tensors = [t for pair in caches for t in pair]
    assert all(t.shape == shape and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
    assert all(torch.count_nonzero(t) == 0 for t in tensors)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert tensors[0].data_ptr() % HUGE_PAGE_BYTES == 0
    ends = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(ends, ends[1:]))  # no two overlap
    tensors[1].fill_(1.0)  # writing one layer's V leaves every other cache zero
    assert all(torch.count_nonzero(t) == 0 for t in tensors if t is not tensors[1])


def test_kv_caches_off_by_environment(monkeypatch):
    monkeypatch.setenv("LLM_HUGE_PAGES", "0")
    assert kv_caches(2, (3, 4, 1, 8), torch.float32) is None


@needs_kernels
def test_an_engine_on_huge_pages_generates_what_it_generates_without(monkeypatch):
    from protocol import SamplingParams, StepOutput
    from tests.engine_helpers import run_to_completion, tiny_engine

    def run(flag: str) -> tuple[dict[str, list[int]], bool]:
        monkeypatch.setenv("LLM_HUGE_PAGES", flag)
        engine = tiny_engine()
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(([1, 2, 3, 4, 5], [9, 8, 7], list(range(20, 45)))):
            engine.add_request(engine.make_request(f"r{i}", prompt, params))
        tokens: dict[str, list[int]] = {}
        for out in run_to_completion(engine):
            assert isinstance(out, StepOutput)
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        caches = [t for pair in engine.runner.kv_caches for t in pair]
        return tokens, len({t.untyped_storage().data_ptr() for t in caches}) == 1

    on, on_one_buffer = run("1")
    off, off_one_buffer = run("0")
    assert on == off and all(len(t) == 12 for t in on.values())
    assert on_one_buffer and not off_one_buffer
