"""Gated delta rule (Qwen3.5, Qwen3-Next, OLMo hybrid: GatedDeltaNet) and Kimi delta attention
(Kimi Linear, Bailing hybrid: KDA): per-document recurrent state and causal conv.

Without fla, transformers runs ``torch_chunk_gated_delta_rule`` / ``chunk_kimi_delta_attention``
and ``causal_conv1d_fn`` over the whole row: state and conv window cross documents. flexpack runs
the module once per group of right-padded documents (:mod:`flexpack.mixers._plan`), so each
starts from a zero state. With fla and causal-conv1d installed (on CUDA), the rows are flattened
to one and the boundaries go to the kernels' varlen arguments: GatedDeltaNet forwards
``cu_seq_lens_q`` to the rule's ``cu_seqlens``, KDA forwards its keywords as they are
(``cu_seqlens``), and both forward ``seq_idx`` to ``causal_conv1d_fn``.
"""

from __future__ import annotations

from flexpack.mixers._room import Room

GATED_DELTA_RULE = Room(
    "gated_delta_rule",
    functions=frozenset({"torch_chunk_gated_delta_rule", "chunk_gated_delta_rule"}),
    varlen={"cu_seq_lens_q": "cu_seqlens", "seq_idx": "seq_idx"},
    how="state and conv restart per document: documents run apart (torch); fla's cu_seqlens "
    "and causal-conv1d's seq_idx (kernels)",
)

KDA = Room(
    "kda",
    functions=frozenset({"chunk_kimi_delta_attention", "chunk_kda"}),
    varlen={"cu_seqlens": "cu_seqlens", "seq_idx": "seq_idx"},
    how="state and conv restart per document: documents run apart (torch); fla's cu_seqlens "
    "and causal-conv1d's seq_idx (kernels)",
    # the torch KDA's work grows with the padded tokens more than with its calls: 0.735 s vs
    # 0.982 s a step at 2.0 (bench/mixers.py's Kimi Linear, docs/benchmarks.md)
    pad_factor=1.25,
)

ROOMS = (GATED_DELTA_RULE, KDA)
