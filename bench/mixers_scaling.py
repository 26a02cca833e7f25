"""One-pass token mixers against document length: is each kind linear in tokens? (CPU)

For each kind of recurrent / conv mixer (one small model of a family that has it, the families
of ``bench/mixers.py``), its mixer layer alone, a training step (forward + backward of a
weighted sum) on the same tokens at every document length L:

- ``own``: the module's own forward on rows of one document each (``R / L`` rows of ``L``
  tokens): what each document costs alone, batched;
- ``one pass, 1/row``: flexpack's one pass (the room's hook, self-checked against the module)
  on the same rows;
- ``one pass, packed``: flexpack's one pass on one row of ``R`` tokens holding the same
  ``R / L`` documents (packed).

The tokens are the same in every column and at every L, so a kind linear in tokens shows flat
times down each column, and packing costs nothing where ``packed / own`` stays near 1 (above
1: the packed row costs more than its documents alone). RWKV's and Mamba's (Jamba, Zamba)
own forwards step token by token in Python on CPU: theirs runs at L = 128 only.

Run: ``PYTHONPATH=$PWD python bench/mixers_scaling.py`` (R = 8192, L = 128 to 8192; tens of
minutes on a quiet 2-core CPU), ``--quick`` (R = 2048, L = 128, 512, 2048; a few minutes),
``--only KDA`` keeps the kinds whose name has the word. Prints one markdown table per kind and
the load average before and after (timings on a loaded machine are noise: compare ratios
taken in the same run).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _machine import describe
from mixers import FAMILIES, _model, _timed

from flexpack.mixers._plan import DocumentPlan

SKIP = ("cca_projection",)  # ZAYA's CCA has no one pass (per-group calls only)
# own forward token by token in Python (minutes a step at 2K tokens): own at L = 128 only
SLOW_OWN = ("RWKV", "mamba (")


def _mixer(model):
    """(module, room) of the model's first mixer that a room's one pass takes."""
    from flexpack import mixers

    rooms = [r for r in mixers.ROOMS if r.one_pass is not None and hasattr(r.one_pass, "fn")]
    for module in model.modules():
        for room in rooms:
            hidden = getattr(model.config, "hidden_size", None) or model.config.embedding_dim
            x = torch.randn(1, 80, hidden)
            plan = DocumentPlan.from_doc_ids(torch.zeros(1, 80, dtype=torch.long))
            try:
                out = room.one_pass(module, module.forward, x, plan, {})
            except Exception:  # a module the room does not take
                out = None
            if out is not None:
                return module, room
    return None, None


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _kind(kind: str, total: int, lengths: list[int], repeats: int) -> None:
    model = _model(kind, "sdpa")
    module, room = _mixer(model)
    if module is None:
        print(f"\n{kind}: no one pass takes its mixer here (skipped)")
        return
    hidden = getattr(model.config, "hidden_size", None) or model.config.embedding_dim
    print(f"\n{kind}: {type(module).__name__} (room {room.name}), {total} tokens per step")
    print()
    print("| L | own (ms) | one pass, 1/row (ms) | one pass, packed (ms) | 1/row / own "
          "| packed / own |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)

    def one(rows, plan):
        return room.one_pass.fn(module, rows, plan)

    for L in lengths:
        n = total // L
        x = torch.randn(n, L, hidden, generator=g)
        w = torch.randn(n, L, hidden, generator=g)
        alone = DocumentPlan.from_doc_ids(torch.zeros(n, L, dtype=torch.long))
        packed_ids = torch.arange(n).repeat_interleave(L)[None]
        packed = DocumentPlan.from_doc_ids(packed_ids)

        def step(call, rows, weights):
            def run():
                leaf = rows.detach().requires_grad_(True)
                module.zero_grad(set_to_none=True)
                (_first(call(leaf)) * weights).sum().backward()

            return run

        own_s = None
        if not any(s in kind for s in SLOW_OWN) or L <= 128:
            try:
                own_s = _timed(step(module.forward, x, w), repeats)
            except TypeError:  # an own forward that needs the model's other inputs (MiniMax)
                own_s = None
        row_s = _timed(step(functools.partial(one, plan=alone), x, w), repeats)
        flat = (1, n * L, hidden)
        packed_s = _timed(
            step(functools.partial(one, plan=packed), x.reshape(flat), w.reshape(flat)), repeats
        )
        own_cell = f"{own_s * 1e3:.1f}" if own_s else "-"
        ratios = f"{row_s / own_s:.2f}x | {packed_s / own_s:.2f}x" if own_s else "- | -"
        print(f"| {L} | {own_cell} | {row_s * 1e3:.1f} | {packed_s * 1e3:.1f} | {ratios} |",
              flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="R = 2048, L = 128, 512, 2048")
    parser.add_argument("--only", default="", help="keep the kinds whose name has this word")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per cell")
    args = parser.parse_args(argv)
    if args.quick:
        total, lengths, repeats = 2048, [128, 512, 2048], args.repeats or 2
    else:
        total, lengths, repeats = 8192, [128, 256, 512, 1024, 2048, 4096, 8192], args.repeats or 3
    print(f"{describe()}; torch {torch.__version__}; {torch.get_num_threads()} threads; "
          f"forward + backward of one mixer layer, median of {repeats}")  # fmt: skip
    for kind in FAMILIES:
        if args.only not in kind or any(s in kind for s in SKIP):
            continue
        _kind(kind, total, lengths, repeats)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
