"""Lightning attention (MiniMax): a decayed linear-attention state that restarts per document.

``MiniMaxLightningAttention`` computes its block recurrence in torch (no kernel mapping), over
the whole row. flexpack runs the module once per group of right-padded documents, so every
document starts from a zero ``K^T V`` state. The kind is recognised by its decay buffers
(``slope_rate`` and a ``decay_factors`` method), not by its class name.
"""

from __future__ import annotations

import torch

from flexpack.mixers._room import Room


def _lightning(module: torch.nn.Module) -> bool:
    return "slope_rate" in module._buffers and callable(getattr(module, "decay_factors", None))


LIGHTNING = Room(
    "lightning_attention",
    matches=_lightning,
    recognised_by="its decay buffers (`slope_rate`, `decay_factors`)",
    how="the K^T V state restarts per document: documents run apart (torch; no kernel mapping)",
)

ROOMS = (LIGHTNING,)
