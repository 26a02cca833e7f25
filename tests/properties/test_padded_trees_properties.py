"""pack_padded / PaddedTrees: TRL-style padded RL batches as prefix trees, and back.

Reference: each row's rollout (its prompt's real tokens, then its completion's) scored alone by
brute force. The "model" is a bigram table: the hidden state of a token is its one-hot row and
the LM head a fixed (V, V) matrix, so the log-prob of every target names both its token and the
token that predicts it.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from flexpack.trees import pack_padded, rollout_logps

V = 12


@st.composite
def padded_batches(draw):
    B = draw(st.integers(1, 7))
    P = draw(st.integers(1, 6))
    C = draw(st.integers(1, 5))
    pool = [
        draw(st.lists(st.integers(1, V - 1), min_size=1, max_size=P))
        for _ in range(draw(st.integers(1, 3)))
    ]
    prompt_ids = torch.zeros(B, P, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    completion_ids = torch.zeros(B, C, dtype=torch.long)
    completion_mask = torch.zeros(B, C, dtype=torch.long)
    for b in range(B):
        p = pool[draw(st.integers(0, len(pool) - 1))]  # rows share prompts, in any order
        prompt_ids[b, P - len(p) :] = torch.tensor(p)
        prompt_mask[b, P - len(p) :] = 1
        c = draw(st.lists(st.integers(1, V - 1), min_size=0, max_size=C))
        completion_ids[b, : len(c)] = torch.tensor(c, dtype=torch.long)
        completion_mask[b, : len(c)] = 1
    return prompt_ids, prompt_mask, completion_ids, completion_mask


@given(padded_batches(), st.integers(1, 4))
def test_rollouts_score_each_row_alone(batch, chunk):
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch
    t = pack_padded(*batch)
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    hidden = torch.nn.functional.one_hot(t.batch.input_ids, V).double()  # (R, S, V)
    got = t.scatter(rollout_logps(t.batch, hidden, table, chunk_size=chunk).logps)  # (B, C)
    want = torch.zeros(completion_ids.shape, dtype=torch.float64)
    shared = set()
    for b in range(len(prompt_ids)):
        p = prompt_ids[b][prompt_mask[b].bool()]
        c = completion_ids[b][completion_mask[b].bool()]
        seq = torch.cat([p, c])
        lp = (table @ torch.nn.functional.one_hot(seq, V).double().T).T.log_softmax(-1)  # (L, V)
        want[b, : len(c)] = lp[len(p) - 1 : -1].gather(-1, c[:, None])[:, 0]
        if len(c):
            shared.add(tuple(p.tolist()))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    # Each shared prompt once, every completion token once.
    if shared:
        assert t.batch.num_tokens == sum(map(len, shared)) + int(completion_mask.sum())
    assert ((t.row_rollout >= 0) == completion_mask.bool().any(1)).all()


@given(padded_batches(), st.data())
def test_scatter_and_gather_are_inverse(batch, data):
    t = pack_padded(*batch)
    B, C = t.completion_mask.shape
    values = torch.tensor(
        data.draw(st.lists(st.floats(-5, 5), min_size=B * C, max_size=B * C))
    ).reshape(B, C)
    on = t.completion_mask & (t.row_rollout >= 0)[:, None]
    torch.testing.assert_close(t.scatter(t.gather(values)), torch.where(on, values, 0.0))
    per_rollout = t.gather(values)
    valid = t.batch._rollout_valid
    torch.testing.assert_close(
        t.gather(t.scatter(per_rollout)), torch.where(valid, per_rollout, 0.0)
    )
