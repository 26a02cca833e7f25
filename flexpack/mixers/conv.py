"""Short causal convolutions (LFM2, LFM2.5, LFM2-MoE: ShortConv): a window that restarts per
document.

transformers' ``causal_conv1d_fn`` pads the row on the left only, so a document's first tokens
see the previous document's last ``kernel - 1``. flexpack runs the module once per group of
right-padded documents (torch); with causal-conv1d installed (on CUDA) the rows are flattened
and ``seq_idx`` reaches the kernel (the mixer forwards its keywords to ``causal_conv1d_fn``).
Mixers whose class also runs a scan or a delta rule belong to those rooms.
"""

from __future__ import annotations

from flexpack.mixers import delta, ssm
from flexpack.mixers._room import Room

SHORT_CONV = Room(
    "short_conv",
    functions=frozenset({"causal_conv1d_fn"}),
    varlen={"seq_idx": "seq_idx"},
    excludes=frozenset().union(*(r.functions for r in (*delta.ROOMS, *ssm.ROOMS))),
    how="the window restarts per document: documents run apart (torch); causal-conv1d's "
    "seq_idx (kernel)",
)

ROOMS = (SHORT_CONV,)
