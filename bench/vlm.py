"""VLM fine-tuning: packed rows (pack_multimodal + flexpack attention) vs TRL's padded batches.

The same samples (random words and random RGB images), the same small random Qwen2-VL, one
training step (forward + backward) per batch:

- TRL: ``DataCollatorForVisionLanguageModeling(processor)`` at its defaults, what SFTTrainer uses
  for VLM data, over batches of 8 in a seeded random order (SFTTrainer's default
  ``per_device_train_batch_size=8``): the processor turns each batch's texts and images into
  right-padded (8, longest) tensors; the model runs under ``attn_implementation="sdpa"``.
- flexpack: the processor once per sample, ``pack_multimodal(samples, max_len, model=model)``,
  ``collate_multimodal`` on one row per step; the model under ``register()``.

Two mixes: image-heavy (every sample an image of 16-144 tokens and a short text) and text-heavy
(one sample in five with an image, texts of 20-300 words). Reported: padding (share of the
batch's token slots that are padding), real tokens per second of training steps, and the data
time (TRL: its collator per batch; flexpack: the processor per sample plus the packing), all
measured in one run, repeats interleaved, medians. The processor is transformers'
``Qwen2VLProcessor`` with a word-level tokenizer (no download) and without the video processor
(it needs torchvision).

    python bench/vlm.py [--family qwen2_vl|gemma3] [--samples 96] [--repeats 3] [--threads 1]
                        [--max-len 1024]

``--family gemma3``: a tiny Gemma 3 (sliding and full text layers; image tokens attend each
other both ways, transformers' token-type rule that flexpack composes with the documents) with
``Gemma3Processor`` (word-level tokenizer, PIL image processor at 32 x 32 px, 16 tokens an image).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import numpy as np
import torch


def word_tokenizer(transformers, special: dict[str, str]):
    """A word-level tokenizer of t0..t249, <pad> (250), <unk> (251) and ``special`` (name ->
    token, ids from 252 in order), no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(250)} | {"<pad>": 250, "<unk>": 251}
    vocab |= {s: 252 + i for i, s in enumerate(special.values())}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=words,
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens=special,
    )


def processor(transformers, family: str = "qwen2_vl"):
    if family == "gemma3":
        return gemma3_processor(transformers)

    tokenizer = word_tokenizer(transformers, {
        "vision_start_token": "<|vision_start|>", "image_token": "<|image_pad|>",
        "vision_end_token": "<|vision_end|>", "video_token": "<|video_pad|>",
    })  # fmt: skip
    images = transformers.Qwen2VLImageProcessor(
        patch_size=2, merge_size=2, temporal_patch_size=1, min_pixels=16, max_pixels=64 * 64
    )

    class ImageOnlyProcessor(transformers.Qwen2VLProcessor):
        """Qwen2VLProcessor without its video processor (which needs torchvision)."""

        def check_argument_for_proper_class(self, name, arg):
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

    return ImageOnlyProcessor(image_processor=images, tokenizer=tokenizer, video_processor=None)


def gemma3_processor(transformers):
    """Gemma3Processor with a word-level tokenizer and the PIL image processor at 32 x 32 px
    (16 image tokens per image, as the tiny model's mm_tokens_per_image)."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = word_tokenizer(transformers, {
        "boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
        "eoi_token": "<end_of_image>",
    })  # fmt: skip
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    return transformers.Gemma3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_length=16
    )


def model(transformers, attn: str, hidden: int, family: str = "qwen2_vl"):
    if family == "gemma3":  # sliding + full text layers; images attend each other both ways
        config = transformers.Gemma3Config(
            text_config=dict(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=32, pad_token_id=250, sliding_window=64,
                             layer_types=["sliding_attention", "full_attention"]),
            vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, image_size=32, patch_size=4),
            mm_tokens_per_image=16, image_token_index=253, boi_token_index=252,
            eoi_token_index=254, attn_implementation=attn,
        )  # fmt: skip
        torch.manual_seed(0)
        return transformers.Gemma3ForConditionalGeneration(config).train()
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         pad_token_id=250, rope_parameters={"rope_type": "default",
                                                            "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=hidden, num_heads=4, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=1, mlp_ratio=2),
        image_token_id=253, video_token_id=255, vision_start_token_id=252,
        vision_end_token_id=254, attn_implementation=attn,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2VLForConditionalGeneration(config).train()


def examples(mix: str, n: int, seed: int, family: str = "qwen2_vl") -> list[dict]:
    """TRL's "text" + "images" examples: an image is 16-144 tokens (32..96 px sides) for
    Qwen2-VL, 16 for the tiny Gemma 3 (its processor resizes every image to 32 x 32)."""
    from PIL import Image

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        image = mix == "image-heavy" or rng.random() < 0.2
        n_words = rng.randint(5, 40) if mix == "image-heavy" else rng.randint(20, 300)
        text = " ".join(f"t{rng.randrange(250)}" for _ in range(n_words))
        ex = {"text": text, "images": []}
        if image:
            h, w = rng.choice([16, 24, 32, 48]), rng.choice([16, 24, 32, 48])
            pixels = np.random.default_rng(rng.randrange(2**31)).integers(0, 255, (h, w, 3))
            ex["images"] = [Image.fromarray(pixels.astype(np.uint8))]
            marker = "<start_of_image> " if family == "gemma3" else (
                "<|vision_start|> <|image_pad|> <|vision_end|> "
            )  # fmt: skip
            ex["text"] = marker + text
        out.append(ex)
    return out


def step(m, batch) -> None:
    m(**batch).loss.backward()
    m.zero_grad(set_to_none=True)


def run_trl(m, collator, exs, order, batch_size) -> dict:
    data = steps = 0.0
    real = slots = 0
    for i in range(0, len(order), batch_size):
        t0 = time.perf_counter()
        batch = collator([dict(exs[j]) for j in order[i : i + batch_size]])
        t1 = time.perf_counter()
        step(m, batch)
        steps += time.perf_counter() - t1
        data += t1 - t0
        real += int(batch["attention_mask"].sum())
        slots += batch["attention_mask"].numel()
    return {"data": data, "steps": steps, "real": real, "slots": slots}


def run_flexpack(m, proc, exs, max_len) -> dict:
    from flexpack.integrations.transformers import collate_multimodal, pack_multimodal

    t0 = time.perf_counter()
    samples = []
    for ex in exs:
        out = proc(text=[ex["text"]], images=ex["images"] or None, return_tensors="pt")
        out.pop("attention_mask")
        samples.append(dict(out))
    rows = pack_multimodal(samples, max_len, model=m)
    batches = [collate_multimodal([r]) for r in rows]
    data = time.perf_counter() - t0
    steps = 0.0
    for batch in batches:
        t1 = time.perf_counter()
        step(m, batch)
        steps += time.perf_counter() - t1
    real = int(sum((b["doc_ids"] >= 0).sum() for b in batches))
    return {"data": data, "steps": steps, "real": real, "slots": len(rows) * max_len}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--family", choices=("qwen2_vl", "gemma3"), default="qwen2_vl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import transformers
    from _machine import describe  # bench/ is on sys.path when run as a script
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from flexpack.integrations.transformers import register

    print(f"# bench/vlm.py --family {args.family} on {describe()}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {args.threads} thread(s)\n")  # fmt: skip
    transformers.logging.set_verbosity_error()
    proc = processor(transformers, args.family)
    collator = DataCollatorForVisionLanguageModeling(proc)
    peer = model(transformers, "sdpa", args.hidden, args.family)
    ours = model(transformers, register(), args.hidden, args.family)
    print("| mix | samples | real tokens | TRL padding | flexpack padding | TRL tokens/s | "
          "flexpack tokens/s | speed-up | TRL data s | flexpack data s | load |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mix in ("image-heavy", "text-heavy"):
        exs = examples(mix, args.samples, seed=0, family=args.family)
        order = list(range(len(exs)))
        random.Random(0).shuffle(order)
        trl_runs, ours_runs = [], []
        for _ in range(args.repeats):  # interleaved
            trl_runs.append(run_trl(peer, collator, exs, order, args.batch_size))
            ours_runs.append(run_flexpack(ours, proc, exs, args.max_len))
        t, f = trl_runs[0], ours_runs[0]
        assert t["real"] == f["real"], (t["real"], f["real"])  # the same tokens both ways
        t_steps = statistics.median(r["steps"] for r in trl_runs)
        f_steps = statistics.median(r["steps"] for r in ours_runs)
        t_data = statistics.median(r["data"] for r in trl_runs)
        f_data = statistics.median(r["data"] for r in ours_runs)
        load = os.getloadavg()[0]
        print(f"| {mix} | {len(exs)} | {t['real']:,} | {1 - t['real'] / t['slots']:.1%} | "
              f"{1 - f['real'] / f['slots']:.1%} | {t['real'] / t_steps:,.0f} | "
              f"{f['real'] / f_steps:,.0f} | {t_steps / f_steps:.2f}x | {t_data:.2f} | "
              f"{f_data:.2f} | {load:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
