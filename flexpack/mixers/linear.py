"""Lightning attention (MiniMax): a decayed linear-attention state that restarts per document.

``MiniMaxLightningAttention`` computes its block recurrence in torch (no kernel mapping), over
the whole row: o_t = sum over s <= t of exp(-slope (t - s)) (q_t . k_s) v_s per head. flexpack
runs it once over the whole packed rows (:func:`lightning_one_pass`): that recurrence is Mamba2's
SSD scan with a time step of 1, A = -slope, B = k, C = q and x = v, so the SSD scan's
segment-aware form (:func:`flexpack.mixers.ssm._ssd_scan`) keeps the documents apart and its tree
form forks the state on prefix trees; a class whose structure or behaviour differs runs once per
group of right-padded documents, so every document starts from a zero ``K^T V`` state. The kind
is recognised by its decay buffers (``slope_rate`` and a ``decay_factors`` method), not by its
class name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flexpack.mixers import _one_pass
from flexpack.mixers._plan import DocumentPlan
from flexpack.mixers._room import Room
from flexpack.mixers._tree import TreePlan


def _lightning(module: torch.nn.Module) -> bool:
    return "slope_rate" in module._buffers and callable(getattr(module, "decay_factors", None))


_PARTS = ("qkv_proj", "out_proj", "output_gate", "norm")


def _fits(module: torch.nn.Module, x: Tensor) -> bool:
    """MiniMax's structure: a fused ``qkv_proj`` through ``act_fn``, per-head ``slope_rate``
    decays, blocks of ``block_size``, a ``norm``, a sigmoid ``output_gate`` and ``out_proj``."""
    if not _lightning(module) or not all(
        isinstance(getattr(module, n, None), torch.nn.Module) for n in _PARTS
    ):
        return False
    sizes = [getattr(module, n, None) for n in ("num_attention_heads", "head_dim", "block_size")]
    if not all(isinstance(v, int) and v > 0 for v in sizes):
        return False
    heads, dim, _ = sizes
    qkv = module.qkv_proj
    return (
        isinstance(qkv, torch.nn.Linear)
        and qkv.in_features == x.shape[-1]
        and qkv.out_features == 3 * heads * dim
        and module.slope_rate.numel() == heads
        and callable(getattr(module, "act_fn", None))
    )


def lightning_one_pass(module: torch.nn.Module, x: Tensor, plan: DocumentPlan | TreePlan) -> Tensor:
    """A lightning attention's forward over packed rows, documents kept apart, in one pass.

    As MiniMax's ``MiniMaxLightningAttention.forward`` without a cache (transformers 5.17 to
    5.25): ``act_fn(qkv_proj(x))`` -> q, k, v per head -> the decayed linear attention, each
    document from a zero state (the SSD scan, blocks of ``block_size``, in float32, float64
    kept) -> ``norm`` -> ``sigmoid(output_gate(x))`` gate -> ``out_proj``; padding gives zeros.

    Args:
        module: a lightning attention (:func:`_fits` accepts its structure).
        x: (B, S, H) hidden states of packed rows.
        plan: the rows' documents (or trees).

    Returns:
        (B, S, H), in the dtype ``module``'s own forward returns.
    """
    from flexpack.mixers.ssm import _ssd_scan, _tree_ssd_scan

    B, S, _ = x.shape
    heads, dim = module.num_attention_heads, module.head_dim
    qkv = module.act_fn(module.qkv_proj(x)).reshape(B, S, heads, 3 * dim)
    q, k, v = torch.split(qkv, dim, dim=3)
    work = torch.promote_types(q.dtype, torch.float32)
    A = -module.slope_rate.reshape(heads).to(work)
    dt = torch.ones(B, S, heads, dtype=work, device=x.device)
    block = module.block_size

    def scan(v: Tensor, dt: Tensor, k: Tensor, q: Tensor, segment: Tensor) -> Tensor:
        return _ssd_scan(v, dt, A, k, q, segment, block)

    scan.tree = lambda v, dt, k, q, tree: _tree_ssd_scan(v, dt, A, k, q, tree, block)
    y = plan.scan(scan, v.to(work), dt, k.to(work), q.to(work))
    y = module.norm(y.to(q.dtype).reshape(B, S, heads * dim))
    out = module.out_proj(F.sigmoid(module.output_gate(x)) * y)
    return out * plan.real[..., None].to(out.dtype)


LIGHTNING = Room(
    "lightning_attention",
    matches=_lightning,
    recognised_by="its decay buffers (`slope_rate`, `decay_factors`)",
    how="the K^T V state restarts per document: one pass over the rows (torch, MiniMax's "
    "structure), else documents run apart (no kernel mapping)",
    one_pass=_one_pass.hook(lightning_one_pass, _fits, outputs=2),
)

ROOMS = (LIGHTNING,)
