"""Mamba and Mamba2 scans (Nemotron-H, Bamba, Falcon-H1, Zamba2, Granite 4 hybrids, Mamba2;
Jamba, Zamba, Falcon-Mamba, Mamba): per-document state and causal conv.

Without mamba_ssm, transformers' torch scans (``mamba2_chunk_scan``'s segment sums,
``mamba_selective_scan``) and ``causal_conv1d_fn`` run over the whole row. flexpack runs the
module once per group of right-padded documents, so each starts from a zero state. With
mamba_ssm and causal-conv1d (on CUDA), Mamba2 mixers forward ``seq_idx`` to
``mamba_split_conv1d_scan_combined`` / ``mamba_chunk_scan_combined`` and ``causal_conv1d_fn``:
the rows are flattened and handed the segment index. Mamba (1) scans have no varlen argument in
mamba_ssm: their documents always run apart.
"""

from __future__ import annotations

from flexpack.mixers._room import Room

MAMBA2 = Room(
    "mamba2",
    functions=frozenset({"mamba2_chunk_scan", "mamba_chunk_scan_combined"}),
    varlen={"seq_idx": "seq_idx"},
    how="scan and conv restart per document: documents run apart (torch); mamba_ssm's and "
    "causal-conv1d's seq_idx (kernels)",
)

MAMBA = Room(
    "mamba",
    functions=frozenset({"mamba_selective_scan", "selective_scan_fn", "mamba_inner_fn"}),
    excludes=frozenset(MAMBA2.functions),
    how="scan and conv restart per document: documents run apart (torch and kernels)",
)

ROOMS = (MAMBA2, MAMBA)
