"""Prefix-tree packing vs one rollout per document: tokens forwarded and forward+backward time.

Workloads (lengths drawn lognormal, sigma 0.5, clipped so that every tree fits a row):

* GRPO: groups of a prompt (median 1,000 tokens) and G = 8 completions (median 300 each);
* DPO: pairs of a prompt (median 1,000) with a chosen and a rejected answer (median 300 each).

The same rollouts are packed two ways, both with flexpack and best-fit decreasing into rows of
``--max-len``: as trees (``flexpack.pack_trees``: the prompt forwarded once, ``TreeBatch.mask()``)
and one rollout per document (``flexpack.pack_sequences`` of prompt + completion: the prompt
forwarded once per completion, the document-causal mask). The reference GPT (tiny config) runs a
forward and a backward of the summed completion log-probs on each; the table reports tokens
forwarded, rows, seconds (best of ``--repeats``, the two layouts interleaved) and the ratios,
beside the theoretical saving ``sum G (P + R) / sum (P + G R)`` of the drawn lengths.

    python bench/trees.py [--groups 8] [--max-len 8192] [--threads 1] [--device cpu] [--dense]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from _machine import describe  # bench/ is on sys.path when run as a script

import flexpack
from flexpack.models import GPT, GPTConfig


def draw_groups(kind: str, n: int, max_len: int, rng: np.random.Generator) -> list:
    """n trees (prompt, [completions]) of random tokens, each at most max_len tokens."""
    G = 8 if kind == "grpo" else 2
    groups = []
    while len(groups) < n:
        P = int(np.clip(rng.lognormal(np.log(1000), 0.5), 16, max_len // 2))
        R = np.clip(rng.lognormal(np.log(300), 0.5, size=G), 1, None).astype(int)
        if P + R.sum() > max_len:  # redraw: a tree must fit in one row
            continue
        prompt = rng.integers(0, 256, P).tolist()
        groups.append((prompt, [rng.integers(0, 256, int(r)).tolist() for r in R]))
    return groups


def tree_step(model: GPT, batch, dense: bool = False) -> None:
    mask = batch.mask().block_mask()  # once per batch, as a trainer builds it
    if dense:  # the same mask as a composition: flexpack.attention's dense-mask SDPA path
        mask = batch.mask() & flexpack.masks.padding(batch.segment_ids)
    logits = model(batch.input_ids, position_ids=batch.position_ids, mask=mask)
    logps, valid = batch.gather_logps(logits)
    (-(logps * valid).sum()).backward()


def document_step(model: GPT, batch, prompt_lens: torch.Tensor) -> None:
    logits = model(batch.input_ids, position_ids=batch.position_ids, doc_ids=batch.doc_ids)
    labels = batch.labels.clone()  # -100 on padding and on each document's first token
    labels[batch.position_ids < prompt_lens] = -100  # score the completion tokens only
    loss = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), reduction="sum"
    )
    loss.backward()


def timed(device: str, fn, *args) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8, help="trees per workload")
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workloads", nargs="+", default=["grpo", "dpo"])
    parser.add_argument(
        "--dense",
        action="store_true",
        help="also time the tree mask through the dense (S, S) mask SDPA path",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads; {describe()}"
    )
    torch.manual_seed(0)
    model = GPT(GPTConfig()).to(args.device)  # tiny reference config: 2 layers, width 64
    print(
        f"{'workload':<9}{'layout':<22}{'rows':>6}{'tokens':>9}{'fwd+bwd s':>11}"
        f"{'theory x':>10}{'tokens x':>10}{'time x':>8}"
    )
    for kind in args.workloads:
        rng = np.random.default_rng(0)
        groups = draw_groups(kind, args.groups, args.max_len, rng)
        theory = sum(len(c) * len(p) + sum(map(len, c)) for p, c in groups) / sum(
            len(p) + sum(map(len, c)) for p, c in groups
        )
        trees = flexpack.pack_trees(groups, args.max_len).to(args.device)
        rollouts = [p + c for p, cs in groups for c in cs]
        docs = flexpack.pack_sequences(rollouts, args.max_len).to(args.device)
        # Prompt length of the document at each token (its completion starts there).
        prompt_of = {tuple(p + c): len(p) for p, cs in groups for c in cs}
        prompt_lens = torch.zeros_like(docs.position_ids)
        for r in range(docs.input_ids.shape[0]):
            ids, d = docs.input_ids[r].tolist(), docs.doc_ids[r].tolist()
            for doc in set(d) - {-1}:
                span = [t for t, x in enumerate(d) if x == doc]
                prompt_lens[r, span] = prompt_of[tuple(ids[span[0] : span[-1] + 1])]
        best = {"tree": float("inf"), "document": float("inf"), "dense": float("inf")}
        for _ in range(args.repeats):  # interleaved, so load changes hit both layouts alike
            best["tree"] = min(best["tree"], timed(args.device, tree_step, model, trees))
            if args.dense:
                secs = timed(args.device, tree_step, model, trees, True)
                best["dense"] = min(best["dense"], secs)
            best["document"] = min(
                best["document"], timed(args.device, document_step, model, docs, prompt_lens)
            )
            model.zero_grad(set_to_none=True)
        n_doc, n_tree = int((docs.doc_ids >= 0).sum()), trees.num_tokens
        rows = (
            ("tree (pack_trees)", trees.input_ids.shape[0], n_tree, best["tree"]),
            ("one per document", docs.input_ids.shape[0], n_doc, best["document"]),
        )
        if args.dense:
            rows += (("tree, dense-mask SDPA", trees.input_ids.shape[0], n_tree, best["dense"]),)
        for name, n_rows, tokens, secs in rows:
            ratios = (
                f"{theory:>10.2f}{n_doc / trees.num_tokens:>10.2f}"
                f"{best['document'] / best['tree']:>8.2f}"
                if name == "tree (pack_trees)"
                else ""
            )
            print(f"{kind:<9}{name:<22}{n_rows:>6}{tokens:>9}{secs:>11.3f}{ratios}")


if __name__ == "__main__":
    main()
