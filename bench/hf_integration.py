"""transformers on packed rows: flexpack's attention function against transformers' own paths.

A randomly initialised 2-layer Llama (no download), CPU, no grad, one row of S tokens holding 16
equal documents. For each attn_implementation it reports

* the largest |logit difference| of the last document against that document run alone, with
  ``use_cache=False`` and with ``use_cache`` left at the config default (True), and
* the seconds of the first forward (compiles, builds masks) and the best of 3 after it,

all in one run, so that ratios are comparable even on a loaded machine.

    python bench/hf_integration.py [--seqlens 1024 4096] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    import flexpack
    from flexpack.integrations.transformers import packed_forward_kwargs, register

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(args.seqlens),
        initializer_range=0.2,
        attn_implementation="sdpa",
    )
    base = transformers.LlamaForCausalLM(config).eval()
    models = {}
    for impl in ("sdpa", "flex_attention", register()):
        models[impl] = copy.deepcopy(base)
        models[impl].set_attn_implementation(impl)

    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, CPU, no grad, B=1, {args.docs} documents per row"
    )
    print(
        f"{'S':>6} {'attn_implementation':<20}{'diff use_cache=False':>22}"
        f"{'diff use_cache default':>24}{'first s':>10}{'then s':>10}"
    )
    with torch.no_grad():
        for S in args.seqlens:
            n = S // args.docs
            samples = [torch.randint(0, 256, (n,)) for _ in range(args.docs)]
            batch = flexpack.pack_sequences(samples, S)
            last = batch.doc_ids[0] == batch.doc_ids[0].max()
            want = base(input_ids=batch.input_ids[:, last], use_cache=False).logits[0]
            for impl, model in models.items():
                kwargs = packed_forward_kwargs(batch)
                if impl != "flexpack":
                    del kwargs["doc_ids"]  # transformers' paths read position_ids only
                start = time.perf_counter()
                logits = model(**kwargs).logits
                first = time.perf_counter() - start
                diff = (logits[0, last] - want).abs().max().item()
                del kwargs["use_cache"]
                diff_default = (model(**kwargs).logits[0, last] - want).abs().max().item()
                kwargs["use_cache"] = False
                best = float("inf")
                for _ in range(3):
                    start = time.perf_counter()
                    model(**kwargs)
                    best = min(best, time.perf_counter() - start)
                print(
                    f"{S:>6} {impl:<20}{diff:>22.1e}{diff_default:>24.1e}"
                    f"{first:>10.3f}{best:>10.3f}"
                )


if __name__ == "__main__":
    main()
