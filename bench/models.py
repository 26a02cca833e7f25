"""flexpack vs each family's own transformers path on the same packed rows (CPU, fwd + bwd).

For every family touched by issue 25's attention variants (plain attention, attention sinks,
MLA, chunked attention, Gemma 3 token types), the tiny model of tests/_zoo.py (hidden 64, one
layer of each kind) runs the same packed rows twice: under ``attn_implementation="flexpack"``
with ``packed_forward_kwargs`` (+ ``token_type_ids`` for Gemma 3), and under the model's own
``sdpa`` (``eager`` where the model has no sdpa) with the rows' ``position_ids``, from which
transformers derives its own packed-sequence mask (what a ``DataCollatorWithFlattening`` user
runs). The ratio is sdpa time / flexpack time (> 1: flexpack faster).

Run: ``PYTHONPATH=$PWD python bench/models.py`` (about 2 minutes on a quiet 2-core machine).
"""

from __future__ import annotations

import os
import pathlib
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

import _zoo

import flexpack
from flexpack.integrations.transformers import packed_forward_kwargs

FAMILIES = {  # family -> model type
    "attention (Qwen3)": "qwen3",
    "sinks + sliding (gpt-oss)": "gpt_oss",
    "MLA (DeepSeek-V3)": "deepseek_v3",
    "chunked (Llama 4)": "llama4_text",
    "token types (Gemma 3 VLM)": "gemma3",
}
ROWS, ROW_LEN, REPEATS = 2, 512, 3


def _time(fn) -> float:
    fn()  # warm-up
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(40, 200, (40,), generator=g).tolist()
    samples = [torch.randint(3, 100, (n,), generator=g) for n in lengths]
    batch = flexpack.pack_sequences(samples, ROW_LEN)
    kwargs = packed_forward_kwargs(batch)
    kwargs = {k: v[:ROWS] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    docs = int((torch.diff(kwargs["doc_ids"], dim=1) != 0).sum()) + ROWS
    print(f"# {ROWS} rows x {ROW_LEN} tokens, about {docs} documents; fwd + bwd, median of "
          f"{REPEATS}; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads; load average {os.getloadavg()}")  # fmt: skip
    print("| family | baseline | baseline (s) | flexpack (s) | baseline / flexpack |")
    print("|---|---|---|---|---|")
    for family, model_type in FAMILIES.items():
        model, reference = _zoo.build(model_type)
        impl = "sdpa" if type(reference)._supports_sdpa else "eager"
        reference.set_attn_implementation(impl)
        extra = {}
        if model_type == "gemma3":
            tt = torch.zeros_like(kwargs["input_ids"])
            tt[:, 5:30] = 1  # an image block in each row's first document
            extra["token_type_ids"] = tt
        own = {"input_ids": kwargs["input_ids"], "position_ids": kwargs["position_ids"],
               "use_cache": False, **extra}  # fmt: skip

        def step(m, kw):
            m.zero_grad(set_to_none=True)
            m(**kw).logits.float().square().mean().backward()

        t_ref = _time(lambda m=reference, kw=own: step(m, kw))
        t_fp = _time(lambda m=model, kw={**kwargs, **extra}: step(m, kw))
        print(f"| {family} | {impl} | {t_ref:.3f} | {t_fp:.3f} | {t_ref / t_fp:.2f}x |")
    print(f"# load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
