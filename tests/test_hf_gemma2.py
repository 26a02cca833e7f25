"""transformers Gemma 2 (alternating sliding windows, attention-logit soft-capping) on packed rows.

Reference: transformers' own ``eager`` attention (the one that applies soft-capping), each
document run alone with the same weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _rows import documents

import flexpack

transformers = pytest.importorskip("transformers")

from flexpack.integrations.transformers import packed_forward_kwargs, register  # noqa: E402


def test_packed_gemma2_equals_each_document_alone():
    config = transformers.Gemma2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,  # one sliding, one full layer
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        attn_logit_softcapping=2.0,  # small: capping changes the scores a lot
        final_logit_softcapping=5.0,
        initializer_range=0.2,
        attn_implementation=register(),
    )
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).eval()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 128, (n,), generator=g) for n in (20, 5, 31, 12)]
    batch = flexpack.pack_sequences(samples, max_len=40)
    # With grad (as in training) the CPU paths are SDPA ones: no flex compile in this test.
    logits = model(**packed_forward_kwargs(batch)).logits.detach()
    uncapped = copy.deepcopy(reference)
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    with torch.no_grad():
        worst = capped_vs_not = 0.0
        for row, start, stop in documents(batch.doc_ids):
            ids = batch.input_ids[row, start:stop][None].long()
            want = reference(input_ids=ids, use_cache=False).logits[0]
            worst = max(worst, (logits[row, start:stop] - want).abs().max().item())
            other = uncapped(input_ids=ids, use_cache=False).logits[0]
            capped_vs_not = max(capped_vs_not, (other - want).abs().max().item())
    assert worst < 1e-5
    assert capped_vs_not > 1e-2  # the cap is on, and matters
