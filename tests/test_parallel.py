"""flexpack.parallel in one process: shard plans against brute-force counts, every rank's local
attention against flexpack.attention on the full row (float64 forward and gradients), the
(S_l, S) BlockMask against the dense document-causal mask, the balance the issue asks for, and
the errors. The collectives (all-gather / reduce-scatter under gloo) are in
test_parallel_distributed.py."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flexpack
from flexpack.parallel import (
    ContextShard,
    context_parallel_attention,
    shard_block_mask,
    shard_context,
)
from flexpack.parallel.attention import _local_attention
from flexpack.testing import strategies as fst
from flexpack.testing.references import dense_mask

BALANCES = ("work", "head_tail", "contiguous")


def _mask(doc_ids: torch.Tensor, causal: bool = True):
    m = flexpack.masks.document(doc_ids)
    return m & flexpack.masks.causal() if causal else m


def _dense(doc_ids: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """(B, S, S) bool: the document(-causal) mask, brute force."""
    d = doc_ids.long()
    S = d.shape[1]
    ok = (d[:, :, None] == d[:, None, :]) & (d[:, :, None] >= 0)
    if causal:
        ok &= torch.ones(S, S, dtype=torch.bool).tril()
    return ok


@st.composite
def batches(draw, max_world: int = 4, contiguous: bool | None = None):
    world = draw(st.integers(1, max_world))
    per = draw(st.integers(1, 24))
    if contiguous is None:
        contiguous = draw(st.booleans())
    d = draw(
        fst.doc_ids(seq_len=world * per, max_batch_size=2, contiguous=contiguous,
                    allow_empty_rows=True)
    )  # fmt: skip
    return d, world, draw(st.sampled_from(BALANCES)), draw(st.sampled_from([1, 3, 4, 128]))


@given(batches())
def test_every_position_on_exactly_one_rank_and_work_is_the_masks(case) -> None:
    d, world, balance, block_size = case
    B, S = d.shape
    dense = _dense(d)
    shards = [shard_context(d, world, r, balance=balance, block_size=block_size)
              for r in range(world)]  # fmt: skip
    owners = torch.zeros(B, S, dtype=torch.long)
    for s in shards:
        assert s.index.shape == (B, S // world) and s.index.dtype == torch.int64
        assert bool((s.index[:, 1:] > s.index[:, :-1]).all())  # ascending
        owners += s.put(torch.ones_like(s.index), torch.zeros(B, S, dtype=torch.long))
        rows = torch.arange(B)[:, None]
        assert s.work == int(dense[rows, s.index].sum())  # pairs of this rank's queries
        assert torch.equal(s.doc_ids, torch.where(d < 0, -1, d.long())[rows, s.index])
        assert s.rank_work == shards[0].rank_work
        assert torch.equal(s.gathered_index, shards[0].gathered_index)
    assert bool((owners == 1).all())
    assert sum(s.work for s in shards) == int(dense.sum())
    assert [s.work for s in shards] == list(shards[0].rank_work)
    # position_ids: earlier tokens of the same document
    layout_pos = (dense & (d.long()[:, :, None] >= 0)).sum(-1) - 1
    for s in shards:
        want = layout_pos.clamp(min=0)[torch.arange(B)[:, None], s.index]
        assert torch.equal(s.position_ids, want)


@given(batches(), st.integers(0, 3))
def test_take_put_round_trip(case, extra_dims) -> None:
    d, world, balance, block_size = case
    B, S = d.shape
    x = torch.randn(B, S, *([2] * extra_dims))
    rebuilt = torch.zeros_like(x)
    for r in range(world):
        s = shard_context(d, world, r, balance=balance, block_size=block_size)
        local = s.take(x)
        assert local.shape == (B, S // world, *x.shape[2:])
        assert torch.equal(local, x[torch.arange(B)[:, None], s.index])
        rebuilt = s.put(local, rebuilt)
        # another sequence dim: (B, H, S, D) tensors
        y = x.reshape(B, S, -1).transpose(1, 2)
        assert torch.equal(s.take(y, dim=2), s.take(x).reshape(B, S // world, -1).transpose(1, 2))
    assert torch.equal(rebuilt, x)


@given(batches())
def test_torch_style_balancer_indices(case) -> None:
    d, world, balance, block_size = case
    s = shard_context(d, world, 0, balance=balance, block_size=block_size)
    bal = s.load_balancer()
    idx, restore = bal._generate_indices(), bal._generate_indices(restore=True)
    x = torch.randn(d.shape)
    per = d.shape[1] // world
    assert torch.equal(x.gather(1, idx)[:, :per], s.take(x))  # rank 0: the first columns
    assert torch.equal(x.gather(1, idx).gather(1, restore), x)


def _qkv(B, Hq, Hkv, S, D, dtype):
    g = torch.Generator().manual_seed(B * 1000 + S)
    return [
        torch.randn(B, h, S, D, dtype=dtype, generator=g).requires_grad_() for h in (Hq, Hkv, Hkv)
    ]


def _check_all_ranks(d, world, balance, *, causal=True, dtype=torch.float64, atol=1e-9,
                     Hq=2, Hkv=2, softcap=None, block_size=4):  # fmt: skip
    """Every rank's local attention (k, v given whole) against flexpack.attention on the row."""
    B, S = d.shape
    q, k, v = _qkv(B, Hq, Hkv, S, 8, dtype)
    ref = flexpack.attention(q, k, v, _mask(d, causal), enable_gqa=Hq != Hkv, softcap=softcap)
    g = torch.randn_like(ref)
    want = torch.autograd.grad((ref * g).sum(), (q, k, v))
    got = [torch.zeros_like(x) for x in (q, k, v)]
    for r in range(world):
        s = shard_context(d, world, r, balance=balance, block_size=block_size)
        ql = s.take(q.detach(), dim=2).requires_grad_()
        out = _local_attention(
            ql, k, v, s, mask="document_causal" if causal else "document", scale=None,
            enable_gqa=Hq != Hkv, softcap=softcap,
        )  # fmt: skip
        torch.testing.assert_close(out, s.take(ref.detach(), dim=2), atol=atol, rtol=0)
        gq, gk, gv = torch.autograd.grad((out * s.take(g, dim=2)).sum(), (ql, k, v))
        got = [got[0] + s.put(gq, torch.zeros_like(q), dim=2), got[1] + gk, got[2] + gv]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)


@given(batches(max_world=4), st.booleans())
def test_local_attention_is_exact_on_every_rank(case, causal) -> None:
    d, world, balance, block_size = case
    _check_all_ranks(d, world, balance, causal=causal, block_size=block_size)


def test_local_attention_fp32_gqa_softcap() -> None:
    d = torch.tensor([[0] * 21 + [1] * 9 + [2] * 26 + [-1] * 8, [0] * 40 + [1] * 24])
    for world in (2, 4):
        _check_all_ranks(d, world, "work", dtype=torch.float32, atol=1e-5, Hq=4, Hkv=2)
        _check_all_ranks(d, world, "work", softcap=3.0, Hq=4, Hkv=1)


def _ring_all_ranks(d, world, balance, *, causal, dtype, Hq, Hkv, softcap, block_size):
    """Every rank's ring, in one process: each rank merges every rank's K/V block by LSE, and
    each block's dk, dv sum over the ranks' backward steps (what the ring's passes add up)."""
    from flexpack.parallel.ring import _ring_block_backward, _ring_block_forward, _ring_plan
    from flexpack.parallel.sharding import _heads

    B, S = d.shape
    q, k, v = _qkv(B, Hq, Hkv, S, 8, dtype)
    ref = flexpack.attention(q, k, v, _mask(d, causal), enable_gqa=Hq != Hkv, softcap=softcap)
    g = torch.randn_like(ref)
    want = torch.autograd.grad((ref * g).sum(), (q, k, v))
    shards = [shard_context(d, world, r, balance=balance, block_size=block_size)
              for r in range(world)]  # fmt: skip
    kv = [torch.stack([_heads(s.take(k.detach(), dim=2)), _heads(s.take(v.detach(), dim=2))])
          for s in shards]  # fmt: skip
    dkv = [torch.zeros_like(x) for x in kv]
    got_q = torch.zeros_like(q)
    kw = dict(scale=8**-0.5, softcap=softcap)
    for s in shards:
        plan = _ring_plan(s, causal, Hq, q.device)
        qh = _heads(s.take(q.detach(), dim=2)).index_select(1, plan.query_perm)
        acc, lse = torch.zeros_like(qh), torch.full(qh.shape[:2], -math.inf, dtype=dtype)
        for src in range(world):
            _ring_block_forward(qh, kv[src], plan, src, acc, lse, **kw)
        out = torch.zeros(Hq, B * (S // world), 8, dtype=dtype).index_copy(1, plan.query_perm, acc)
        out = out.reshape(Hq, B, S // world, 8).transpose(0, 1)
        torch.testing.assert_close(out, s.take(ref.detach(), dim=2), atol=1e-9, rtol=0)
        doh = _heads(s.take(g, dim=2)).index_select(1, plan.query_perm)
        delta = (doh * acc).sum(-1)
        dq = torch.zeros_like(qh)
        for src in range(world):
            part = _ring_block_backward(qh, doh, acc, lse, delta, kv[src], plan, src, dq, **kw)
            if part is not None:
                dkv[src] += part
        dq_rows = torch.zeros(Hq, B * (S // world), 8, dtype=dtype).index_copy(
            1, plan.query_perm, dq
        )
        got_q = got_q + s.put(dq_rows.reshape(Hq, B, S // world, 8).transpose(0, 1),
                              torch.zeros_like(q), dim=2)  # fmt: skip
    torch.testing.assert_close(got_q, want[0], atol=1e-9, rtol=0)
    for i, full in ((0, want[1]), (1, want[2])):
        got = torch.zeros_like(full)
        for s, x in zip(shards, dkv, strict=True):
            local = x[i].reshape(Hkv, B, S // world, 8).transpose(0, 1)
            got = got + s.put(local, torch.zeros_like(full), dim=2)
        torch.testing.assert_close(got, full, atol=1e-9, rtol=0)


@given(batches(max_world=4), st.booleans(), st.sampled_from([(2, 2, None), (4, 2, None),
                                                            (4, 1, 3.0)]))  # fmt: skip
def test_ring_blocks_merge_to_attention_on_every_rank(case, causal, heads) -> None:
    """The ring's tiles (the CPU flash kernel, and the matmul tiles with softcap) against
    flexpack.attention, forward and gradients in float64, on any layout and split."""
    d, world, balance, block_size = case
    Hq, Hkv, softcap = heads
    _ring_all_ranks(d, world, balance, causal=causal, dtype=torch.float64, Hq=Hq, Hkv=Hkv,
                    softcap=softcap, block_size=block_size)  # fmt: skip


def test_one_rank_needs_no_process_group_and_matches_attention() -> None:
    d = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, -1]])
    s = shard_context(d, 1, 0)
    q, k, v = _qkv(1, 2, 2, 10, 4, torch.float64)
    out = context_parallel_attention(q, k, v, s)
    torch.testing.assert_close(out, flexpack.attention(q, k, v, _mask(d)), atol=1e-12, rtol=0)
    assert torch.equal(s.gather(q.detach(), dim=2), q.detach())


def test_numpy_softcap_from_a_config_is_taken_as_attention_takes_it() -> None:
    d = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, -1]])
    s = shard_context(d, 1, 0)
    q, k, v = _qkv(1, 2, 2, 10, 4, torch.float64)
    out = context_parallel_attention(q, k, v, s, softcap=np.float32(3.0))
    ref = flexpack.attention(q, k, v, _mask(d), softcap=np.float32(3.0))
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    with pytest.raises(TypeError, match="softcap must be a float or None, got True"):
        context_parallel_attention(q, k, v, s, softcap=True)


def test_autocast_bf16_casts_like_attention() -> None:
    d = torch.tensor([[0] * 12 + [1] * 4])
    s = shard_context(d, 1, 0)
    q, k, v = _qkv(1, 2, 2, 16, 8, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = context_parallel_attention(q, k, v, s)
        ref = flexpack.attention(q, k, v, _mask(d))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=0)
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float32


@given(batches(max_world=4), st.booleans())
def test_shard_block_mask_dense_twin_is_the_rows_of_the_mask(case, causal) -> None:
    d, world, balance, block_size = case
    B, S = d.shape
    dense = _dense(d, causal)
    for r in range(world):
        s = shard_context(d, world, r, balance=balance, block_size=block_size)
        bm = shard_block_mask(s, causal=causal, block_size=4)
        assert bm.seq_lengths == (S // world, S)
        got = dense_mask(bm, B, 1, S // world, S)[:, 0]
        assert torch.equal(got, dense[torch.arange(B)[:, None], s.index])


def test_shard_block_mask_is_as_sparse_as_the_full_rows() -> None:
    """With whole blocks on each rank, the local mask's blocks are rows of the full mask's."""
    d = torch.repeat_interleave(torch.arange(6), torch.tensor([300, 700, 129, 1, 900, 18])
                                )[None]  # fmt: skip
    full = flexpack.document_causal_mask(d, block_size=128)
    n_full = int(full.kv_num_blocks.sum() + full.full_kv_num_blocks.sum())
    total = 0
    for r in range(4):
        bm = shard_block_mask(shard_context(d, 4, r), block_size=128)
        total += int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum())
    assert total == n_full


def _lognormal_row(S: int, median: int, rng: np.random.Generator) -> torch.Tensor:
    lengths = [int(S * rng.uniform(0.3, 0.6))]  # one long document
    while sum(lengths) < S:
        lengths.append(max(1, int(rng.lognormal(np.log(median), 1.0))))
    rng.shuffle(lengths)
    ids = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])[:S]
    return torch.from_numpy(ids)[None]


@pytest.mark.parametrize("median", [300, 1000, 3000, 8000])
def test_work_balance_within_3_percent_at_32k(median) -> None:
    rng = np.random.default_rng(median)
    d = _lognormal_row(32768, median, rng)
    for world in (2, 4, 8):
        s = shard_context(d, world, 0)
        contiguous = shard_context(d, world, 0, balance="contiguous")
        assert s.imbalance <= 1.03, (world, s.rank_work)
        assert s.imbalance <= contiguous.imbalance


def _corpus_rows(S: int) -> list[torch.Tensor]:
    """The bundled corpus (UTF-8 bytes as tokens) packed into rows of S, as doc ids."""
    import json
    from pathlib import Path

    path = Path(flexpack.__file__).parent / "assets" / "corpus.jsonl"
    with open(path, encoding="utf-8") as f:
        lengths = np.array([len(json.loads(line)["text"].encode()) for line in f])
    seg = flexpack.pack(lengths, S, overflow="split").segments
    rows = []
    for r in np.unique(seg[:, 0]):
        n = seg[seg[:, 0] == r][:, 3] - seg[seg[:, 0] == r][:, 2]
        ids = np.full(S, -1)
        ids[: n.sum()] = np.repeat(np.arange(n.size), n)
        rows.append(torch.from_numpy(ids)[None])
    return rows


@pytest.mark.parametrize("S", [4096, 8192])
def test_work_balance_within_3_percent_on_short_rows(S) -> None:
    """Every row of the bundled corpus and of lognormal documents, at 2, 4 and 8 ranks: 128
    tokens per block are too few at 4K over 8 ranks (4 per rank), finer blocks are dealt."""
    rng = np.random.default_rng(S)
    rows = _corpus_rows(S)[::3] + [_lognormal_row(S, m, rng) for m in (300, 1000, 3000, 8000)]
    for world in (2, 4, 8):
        worst = max(shard_context(d, world, 0).imbalance for d in rows)
        assert worst <= 1.03, (S, world, worst)


def test_plans_are_cached_per_layout() -> None:
    from flexpack.parallel import planning

    d = _lognormal_row(4096, 300, np.random.default_rng(5))
    a, b = shard_context(d, 4, 0), shard_context(d.clone(), 4, 3)
    key = a.fingerprint
    assert key == b.fingerprint and key in planning._PLANS  # one plan for the layout
    assert torch.equal(a.gathered_index, b.gathered_index)
    e = d.clone()
    e[0, 100:] += 1000  # another layout (a document cut at 100): another plan, not the cached one
    assert shard_context(e, 4, 0).fingerprint != key
    assert shard_context(d, 4, 0, balance="contiguous").fingerprint != key


def test_batch_rows_balance_together() -> None:
    rng = np.random.default_rng(1)
    d = torch.cat([_lognormal_row(4096, 500, rng) for _ in range(3)])
    s = shard_context(d, 4, 2)
    assert s.index.shape == (3, 1024) and s.imbalance <= 1.03
    assert sum(s.rank_work) == int(_dense(d).sum())


def test_shard_tensors_on_the_doc_ids_device() -> None:
    d = torch.tensor([[0, 0, 1, 1]])
    s = shard_context(d, 2, 1)
    assert s.index.device == d.device and isinstance(s, ContextShard)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda d: shard_context(d, 3, 0), ValueError, "multiple of 3"),
        (lambda d: shard_context(d, 2, 2), ValueError, "rank=2"),
        (lambda d: shard_context(d, 2, 0, balance="zigzag"), ValueError, "balance"),
        (lambda d: shard_context(d.float(), 2, 0), TypeError, "integer"),
        (lambda d: shard_context(d, 2.0, 0), TypeError, "world_size"),
        (lambda d: shard_context(d[None], 2, 0), ValueError, "(B, S)"),
    ],
)
def test_bad_shard_input_says_what_and_how(call, error, words) -> None:
    with pytest.raises(error, match=None) as info:
        call(torch.tensor([[0, 0, 0, 1]]))
    assert words in str(info.value)


def test_shard_context_names_ragged_rows():
    from flexpack.parallel import shard_context

    with pytest.raises(ValueError, match=r"rows of lengths \[3, 1\].*Pad the shorter rows"):
        shard_context([[0, 0, 1], [1]], 1, 0)


def test_bad_attention_input_says_what_and_how() -> None:
    d = torch.tensor([[0, 0, 0, 1]])
    one, two = shard_context(d, 1, 0), shard_context(d, 2, 0)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="not initialized"):
        context_parallel_attention(q[:, :, :2], q[:, :, :2], q[:, :, :2], two)
    with pytest.raises(ValueError, match=r"expected \(1, H, 2, D\)"):
        context_parallel_attention(q, q, q, two)
    with pytest.raises(ValueError, match="mask must be one of"):
        context_parallel_attention(q, q, q, one, mask="causal")
    with pytest.raises(TypeError, match="ContextShard"):
        context_parallel_attention(q, q, q, d)
    with pytest.raises(ValueError, match="tokens at dim 1"):
        one.take(torch.zeros(1, 5))


def test_flex_kernel_inputs_give_the_rows_attention() -> None:
    """What the CUDA path hands flex_attention (q in shard order, k and v in row order, the
    (S_l, S) BlockMask of 128-token blocks), run by eager flex_attention on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    lengths = torch.tensor([200, 37, 300, 90, 140, 257])  # 1024 tokens
    d = torch.repeat_interleave(torch.arange(6), lengths)[None].clone()
    d[0, -40:] = -1  # padding at the end
    q, k, v = (x.detach() for x in _qkv(1, 2, 2, 1024, 16, torch.float32))
    ref = flexpack.attention(q, k, v, _mask(d))
    for r in range(2):
        s = shard_context(d, 2, r)
        bm = shard_block_mask(s, block_size=128)
        with torch.no_grad():
            out = flex_attention(s.take(q, dim=2), k, v, block_mask=bm)
        torch.testing.assert_close(out, s.take(ref, dim=2), atol=1e-5, rtol=0)


class _OneRankMesh:
    """What torch's _create_cp_block_mask reads of a DeviceMesh: rank, size, device type."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.device_type = rank, world, "cpu"

    def get_local_rank(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.world


@pytest.mark.compile
def test_torch_flex_cp_block_mask_takes_the_shards_balancer() -> None:
    """torch's flex CP builds each rank's BlockMask through the balancer's indices (it compiles
    create_block_mask): with the shard's, its mask is the document-causal mask of this rank's
    queries against the keys in all-gather order."""
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _create_cp_block_mask,
    )

    d = torch.repeat_interleave(torch.arange(5), torch.tensor([100, 300, 37, 50, 25]))[None]
    mask = _mask(d)
    dense = _dense(d)
    for r in range(2):
        s = shard_context(d, 2, r)
        # a private torch function: torch 2.15 added a BLOCK_SIZE argument before device_mesh
        extra = {}
        if "BLOCK_SIZE" in inspect.signature(_create_cp_block_mask).parameters:
            extra["BLOCK_SIZE"] = (128, 128)
        bm = _create_cp_block_mask(
            mask.mask_mod, 1, 1, 512, 512, device_mesh=_OneRankMesh(r, 2),
            load_balancer=s.load_balancer(), **extra,
        )  # fmt: skip
        got = dense_mask(bm, 1, 1, 256, 512)[:, 0]
        assert torch.equal(got, dense[:, s.index[0]][:, :, s.gathered_index[0]])


def test_auto_schedule_keeps_the_all_gather_where_the_ring_saves_little() -> None:
    from flexpack.parallel.attention import _auto_schedule

    def pick(S, world, heads=8, dim=128, dtype=torch.bfloat16):
        shard = shard_context(torch.zeros(1, S, dtype=torch.long), world, 0)
        k = torch.empty(1, heads, S // world, dim, dtype=dtype, device="meta")
        return _auto_schedule(k, k, shard)

    assert pick(4096, 1) == pick(131072, 2) == "all_gather"  # one rank; two: half at most
    assert pick(2048, 4) == "all_gather"  # 8 MiB of K/V gathered: under the line
    assert pick(16384, 4) == pick(131072, 8) == "ring"  # 64 MiB, 512 MiB per layer
    assert pick(131072, 8, heads=2, dim=16, dtype=torch.float32) == "ring"  # 32 MiB


def test_stats_say_which_schedule_ran() -> None:
    d = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    s = shard_context(d, 1, 0)
    q = torch.randn(1, 2, 8, 4)
    assert s.stats.schedule is None and s.stats.calls == {}
    context_parallel_attention(q, q, q, s)
    context_parallel_attention(q, q, q, s, schedule="ring")
    assert s.stats.schedule == "ring" and s.stats.calls == {"all_gather": 1, "ring": 1}
    assert s.stats.bytes_sent == 0  # one rank: nothing moves
    with pytest.raises(ValueError, match="schedule must be one of"):
        context_parallel_attention(q, q, q, s, schedule="zigzag")


def test_ring_skips_blocks_whose_documents_meet_no_query() -> None:
    """Documents that never cross a rank's share: every other rank's block has no tile."""
    from flexpack.parallel.ring import _ring_plan

    d = torch.repeat_interleave(torch.arange(4), 16)[None]  # 4 documents of 16, 4 ranks of 16
    for r in range(4):
        s = shard_context(d, 4, r, balance="contiguous")
        tiles = _ring_plan(s, True, 2, d.device).tiles
        assert [bool(t) for t in tiles] == [src == r for src in range(4)]
