"""Short causal convolutions (LFM2, LFM2.5, LFM2-MoE: ShortConv; ZAYA's q/k projection): a window
that restarts per document.

transformers' ``causal_conv1d_fn`` pads the row on the left only, so a document's first tokens
see the previous document's last ``kernel - 1``. flexpack runs the module once per group of
right-padded documents (torch); with causal-conv1d installed (on CUDA) the rows are flattened
and ``seq_idx`` reaches the kernel (the mixer forwards its keywords to ``causal_conv1d_fn``).
Mixers whose class also runs a scan or a delta rule belong to those rooms.

ZAYA's attention projects q and k through two causal convolutions it pads itself (``F.pad``,
then ``Conv1d`` with ``padding=0``) and gives each value head half of the previous token's
projection (CCA, Compressed Convolutional Attention): no kernel mapping, so the projection is
recognised by its parts and run once per group of right-padded documents; its q, k and v all
come back merged.
"""

from __future__ import annotations

import torch

from flexpack.mixers import delta, ssm
from flexpack.mixers._room import Room


def _cca(module: torch.nn.Module) -> bool:
    conv = getattr(module, "conv_qk_depthwise", None)
    return isinstance(conv, torch.nn.Conv1d) and isinstance(
        getattr(module, "v_proj_delayed", None), torch.nn.Linear
    )


SHORT_CONV = Room(
    "short_conv",
    functions=frozenset({"causal_conv1d_fn"}),
    varlen={"seq_idx": "seq_idx"},
    excludes=frozenset().union(*(r.functions for r in (*delta.ROOMS, *ssm.ROOMS))),
    how="the window restarts per document: documents run apart (torch); causal-conv1d's "
    "seq_idx (kernel)",
)

CCA_PROJECTION = Room(
    "cca_projection",
    matches=_cca,
    recognised_by="a `conv_qk_depthwise` Conv1d beside a `v_proj_delayed` Linear (ZAYA)",
    all_outputs=True,
    how="q/k's convolution window and v's one-token delay restart per document: documents run "
    "apart (torch; no kernel mapping)",
)

ROOMS = (SHORT_CONV, CCA_PROJECTION)
