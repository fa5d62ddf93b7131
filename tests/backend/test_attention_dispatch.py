"""backend.attention: CPU tensors go to the torch references (decode: to the C++ kernel where it is
built), CUDA tensors to the Triton wrappers, and a mixed batch is split between the decode and
prefill kernels the way docs/interfaces.md says.

No GPU needed: the Triton modules are replaced by fakes in sys.modules, and the references are
wrapped to record their calls.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from backend import attention
from backend.attention import (
    AttentionMetadata,
    allocate_kv_caches,
    apply_rope,
    kernels_for,
    paged_attention,
    rotate_and_store,
)
from kernels import cpu_kernels, reference

H, KVH, D, BS = 4, 2, 8, 4


def _batch(q_lens: list[int], ctx_lens: list[int], num_decode: int, num_blocks: int = 16):
    """Random q/k/v for sequences with q_lens new tokens ending at ctx_lens; sequence b's cache
    blocks are b, b + B, b + 2B, ... (interleaved); the cached prefix holds random K/V."""
    g = torch.Generator().manual_seed(0)
    B, T = len(q_lens), sum(q_lens)
    ((k_cache, v_cache),) = allocate_kv_caches(1, num_blocks, BS, KVH, D, torch.float32)
    k_cache.normal_(generator=g)
    v_cache.normal_(generator=g)
    max_blocks = max(math.ceil(n / BS) for n in ctx_lens)
    tables = torch.zeros(B, max_blocks, dtype=torch.int32)
    slots = []
    for b, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens)):
        nb = math.ceil(ctx / BS)
        tables[b, :nb] = torch.arange(nb, dtype=torch.int32) * B + b
        slots += [int(tables[b, p // BS]) * BS + p % BS for p in range(ctx - q_len, ctx)]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decode_seqs=num_decode,
        block_tables=tables,
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        query_start_loc=qsl,
    )
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(T, KVH, D, generator=g)
    v = torch.randn(T, KVH, D, generator=g)
    return q, k, v, k_cache, v_cache, meta


def _dense_attention(q, k_cache, v_cache, meta) -> torch.Tensor:
    """Naive per-token attention over the paged cache (after the store), for the expected output."""
    out = torch.empty_like(q)
    qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for b, ctx in enumerate(lens):
        slots = [int(meta.block_tables[b, p // BS]) * BS + p % BS for p in range(ctx)]
        keys = k_cache.flatten(0, 1)[slots]  # (ctx, KVH, D)
        vals = v_cache.flatten(0, 1)[slots]
        q_len = qsl[b + 1] - qsl[b]
        for i in range(q_len):
            t, pos = qsl[b] + i, ctx - q_len + i
            for h in range(H):
                kh = h // (H // KVH)
                p = torch.softmax(keys[: pos + 1, kh] @ q[t, h] / math.sqrt(D), dim=0)  # (pos+1,)
                out[t, h] = p @ vals[: pos + 1, kh]
    return out


# CPU decode enters through cpu_kernels.paged_attention_decode_cpu, which runs the C++ kernel where it
# is built and the reference otherwise.
CPU_DECODE = ["paged_attention_decode_cpu"] + ([] if cpu_kernels.paged_decode() else ["paged_attention_decode_ref"])
# CPU prefill likewise through cpu_kernels.paged_prefill_cpu (this test's head_dim is a multiple of 32 if
# the kernel is to run).
CPU_PREFILL = ["paged_prefill_cpu"] + ([] if cpu_kernels.paged_prefill() and D % 32 == 0 else ["paged_prefill_ref"])


@pytest.fixture
def recorded(monkeypatch):
    """Wrap the three references and the CPU decode entry so each call is recorded (name, args) and still computed."""
    calls: list[tuple[str, tuple]] = []
    for module, name in (
        (reference, "store_kv_ref"),
        (reference, "paged_attention_decode_ref"),
        (reference, "paged_prefill_ref"),
        (cpu_kernels, "paged_attention_decode_cpu"),
        (cpu_kernels, "paged_prefill_cpu"),
    ):
        real = getattr(module, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, args))
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)
    return calls


def test_cpu_mixed_batch_goes_to_the_cpu_kernels_split_at_num_decode(recorded):
    # 2 decodes (contexts 5 and 9) then 2 prefill chunks (3 new of 7, 6 new of 6).
    q, k, v, kc, vc, meta = _batch([1, 1, 3, 6], [5, 9, 7, 6], num_decode=2)
    out = paged_attention(q, k, v, kc, vc, meta, 1 / math.sqrt(D))

    assert [name for name, _ in recorded] == ["store_kv_ref", *CPU_DECODE, *CPU_PREFILL]
    _, (sk, sv, skc, svc, slots) = recorded[0]
    assert sk is k and sv is v and skc is kc and svc is vc and slots is meta.slot_mapping
    _, (dq, _, _, dtables, dlens, dscale) = recorded[1]
    assert dq.shape == (2, H, D) and torch.equal(dq, q[:2])
    assert torch.equal(dtables, meta.block_tables[:2]) and dlens.tolist() == [5, 9]
    assert dscale == pytest.approx(1 / math.sqrt(D))
    _, (pq, _, _, ptables, pqsl, plens, _) = recorded[-len(CPU_PREFILL)]
    assert torch.equal(pq, q[2:]) and torch.equal(ptables, meta.block_tables[2:])
    assert pqsl.tolist() == [0, 3, 9] and plens.tolist() == [7, 6]  # rebased to the prefill rows

    assert torch.allclose(out, _dense_attention(q, kc, vc, meta), atol=1e-5)


def test_cpu_decode_only_and_prefill_only_use_one_kernel(recorded):
    q, k, v, kc, vc, meta = _batch([1, 1, 1], [3, 17, 8], num_decode=3)
    out = paged_attention(q, k, v, kc, vc, meta, 1 / math.sqrt(D))
    assert [name for name, _ in recorded] == ["store_kv_ref", *CPU_DECODE]
    assert torch.allclose(out, _dense_attention(q, kc, vc, meta), atol=1e-5)

    recorded.clear()
    q, k, v, kc, vc, meta = _batch([4, 9], [4, 12], num_decode=0)
    out = paged_attention(q, k, v, kc, vc, meta, 1 / math.sqrt(D))
    assert [name for name, _ in recorded] == ["store_kv_ref", *CPU_PREFILL]
    assert recorded[1][1][4] is meta.query_start_loc
    assert torch.allclose(out, _dense_attention(q, kc, vc, meta), atol=1e-5)


@pytest.fixture
def fake_triton(monkeypatch):
    """Fake kernels.store_kv / paged_attention / paged_prefill modules that record and delegate."""
    calls: list[str] = []

    def fake(module: str, attr: str, ref):
        def fn(*args):
            calls.append(attr)
            return ref(*args)

        monkeypatch.setitem(__import__("sys").modules, f"kernels.{module}", types.SimpleNamespace(**{attr: fn}))
        return fn

    fns = (
        fake("store_kv", "store_kv", reference.store_kv_ref),
        fake("paged_attention", "paged_attention_decode", reference.paged_attention_decode_ref),
        fake("paged_prefill", "paged_prefill", reference.paged_prefill_ref),
    )
    return fns, calls


def test_cuda_device_selects_the_triton_wrappers(fake_triton):
    fns, _ = fake_triton
    assert kernels_for(torch.device("cuda", 0)) == fns
    assert kernels_for(torch.device("cpu")) == (
        reference.store_kv_ref,
        cpu_kernels.paged_attention_decode_cpu,
        cpu_kernels.paged_prefill_cpu,
    )


def test_paged_attention_runs_the_triton_set_when_on_cuda(fake_triton, monkeypatch):
    _, calls = fake_triton
    real_kernels_for = attention.kernels_for
    seen_devices = []

    def as_if_cuda(device):
        seen_devices.append(device)
        return real_kernels_for(torch.device("cuda"))

    monkeypatch.setattr(attention, "kernels_for", as_if_cuda)
    q, k, v, kc, vc, meta = _batch([1, 5], [6, 5], num_decode=1)
    out = paged_attention(q, k, v, kc, vc, meta, 1 / math.sqrt(D))
    assert seen_devices and set(seen_devices) == {q.device}  # looked up for q's device, by store and by attend
    assert calls == ["store_kv", "paged_attention_decode", "paged_prefill"]  # the fakes delegate to the references
    assert torch.allclose(out, _dense_attention(q, kc, vc, meta), atol=1e-5)


def test_metadata_checks_dtypes_and_is_frozen():
    _, _, _, _, _, meta = _batch([1, 2], [3, 2], num_decode=1)
    with pytest.raises(AssertionError, match="int32"):
        AttentionMetadata(meta.slot_mapping, 1, meta.block_tables.long(), meta.seq_lens, meta.query_start_loc)
    with pytest.raises(AssertionError, match="int64"):
        AttentionMetadata(meta.slot_mapping.int(), 1, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    with pytest.raises(AssertionError, match="num_decode_seqs"):
        AttentionMetadata(meta.slot_mapping, 3, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    with pytest.raises(AttributeError):
        meta.num_decode_seqs = 0  # type: ignore[misc]
    assert meta.prefill_query_start_loc.tolist() == [0, 2]


@pytest.mark.parametrize("fused", [True, False])
def test_rotate_and_store_on_cpu_runs_the_fused_op_where_built_and_torch_otherwise(fused, recorded, monkeypatch):
    ops = cpu_kernels.layer_ops()
    if fused and ops is None:
        pytest.skip("the llm_cpu kernels could not be built here")
    calls = []
    if fused:
        recording = types.SimpleNamespace(
            rope_store_kv=lambda *a: calls.append("rope_store_kv") or ops.rope_store_kv(*a)
        )
        monkeypatch.setattr(cpu_kernels, "layer_ops_for", lambda *tensors: recording)
    else:
        monkeypatch.setattr(cpu_kernels, "layer_ops_for", lambda *tensors: None)
    q, k, v, kc, vc, meta = _batch([1, 3], [4, 3], num_decode=1)
    T = q.shape[0]
    qkv = torch.cat([q, k, v], dim=1).reshape(T, (H + 2 * KVH) * D)
    g = torch.Generator().manual_seed(1)
    cos, sin = torch.randn(T, 1, D, generator=g), torch.randn(T, 1, D, generator=g)
    got = rotate_and_store(qkv, cos, sin, kc, vc, meta, H, KVH)
    assert calls == (["rope_store_kv"] if fused else [])
    assert [name for name, _ in recorded] == ([] if fused else ["store_kv_ref"])
    torch.testing.assert_close(got, apply_rope(q, cos, sin))
    slots = meta.slot_mapping
    torch.testing.assert_close(kc.flatten(0, 1)[slots], apply_rope(k, cos, sin))
    torch.testing.assert_close(vc.flatten(0, 1)[slots], v)
