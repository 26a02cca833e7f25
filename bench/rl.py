"""TRL's GRPO and DPO log-prob forwards: flexpack's tree trainers vs TRL's own, side by side.

Both sides are real TRL trainers on the same tiny random Llama (saved to a temporary directory,
``attn_implementation="sdpa"`` as a TRL user loads it): ``trl.GRPOTrainer`` / ``trl.DPOTrainer``
and ``flexpack.integrations.trl.GRPOTrainer`` / ``DPOTrainer`` (one changed import). Generation
and rewards are not timed (they do not change); the batch is what TRL builds after generation:

* GRPO: ``--prompts`` prompts of 256-1024 tokens (uniform), G = 8 completions of 64-256 each,
  left-padded prompts and right-padded completions, as ``_generate_and_score_completions`` pads.
* DPO: ``--pairs`` pairs of a prompt of 256-1024 tokens and two answers of 32-256, right-padded
  ``[prompt + chosen; prompt + rejected]`` rows with a completion mask, as TRL's collator pads.

Columns: tokens the forward runs (``B * S`` padded rows for TRL, ``R * S`` packed rows for
flexpack); "logp fwd+bwd": the policy's per-token log-probs and a backward of their sum (GRPO:
``_get_per_token_logps_and_entropies`` with entropies; DPO: the fused-head forward of
``_compute_loss``); "step": what a training step runs besides generation (GRPO: reference and
old-policy log-probs without grad, then the policy's with backward, and the optimizer step; DPO:
``compute_loss`` with its reference forward, backward, optimizer step); peak memory: the most
bytes of tensors live at once during one step (torch's CPU profiler memory events; weights and
optimizer state allocated before the step do not count). Times are medians of ``--repeats``
interleaved runs.

``--world 2`` runs the same on two CPU processes (gloo), each with its own batch (other
prompts, same sizes), both sides' policies in ``DistributedDataParallel`` as HF Trainer wraps
them (TRL's seams called with the DDP model, flexpack's through DDP's forward); times are the
slowest rank's, peaks the largest rank's, tokens rank 0's. On 2 cores, world 2 runs 1 thread per
rank against world 1's 2 threads.

``--model gpt_oss`` runs a tiny gpt-oss instead (4 experts, top 2, attention sinks, a sliding
layer; ``eager`` attention, its own default), with TRL's router load-balancing loss on: both
sides compute it (flexpack over the trees, each token weighed by the rows sharing it).
``--model qwen3_5`` / ``lfm2`` / ``bamba`` run a tiny hybrid (a gated delta rule, a short conv
or a Mamba2 layer, then an attention layer; ``sdpa``): TRL runs the mixers' torch paths over its
padded rows, flexpack the trees (each completion's state from the end of its prompt's).

    python bench/rl.py [--prompts 2] [--pairs 4] [--repeats 3] [--threads 2] [--world 1]
                       [--model llama|gpt_oss|qwen3_5|lfm2|bamba]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from _machine import describe, tensor_peak  # bench/ is on sys.path when run as a script

V = 4096


def tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(V - 3)} | {"<pad>": V - 3, "</s>": V - 2, "<unk>": V - 1}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def save_model(path: Path, model: str = "llama") -> None:
    import transformers

    common = dict(
        vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        pad_token_id=V - 3, eos_token_id=V - 2,
    )  # fmt: skip
    torch.manual_seed(0)
    if model == "gpt_oss":  # experts (TRL turns the router's loss on), sinks, a sliding layer
        config = transformers.GptOssConfig(
            **common, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=128, layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
        transformers.GptOssForCausalLM(config).save_pretrained(path)
        return
    if model in ("qwen3_5", "lfm2", "bamba"):  # a hybrid: a recurrent / conv layer, attention
        if model == "bamba":  # Mamba2 (Nemotron-H, Falcon-H1 and Granite 4 share the mixer)
            config = transformers.BambaConfig(
                **common, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=32,
                mamba_d_state=64, mamba_chunk_size=64, mamba_expand=2,
            )  # fmt: skip
        elif model == "qwen3_5":
            config = transformers.Qwen3_5TextConfig(
                **common, head_dim=32, layer_types=["linear_attention", "full_attention"],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                linear_value_head_dim=32,
            )  # fmt: skip
        else:
            config = transformers.Lfm2Config(**common, layer_types=["conv", "full_attention"])
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
        return
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).save_pretrained(path)


def grpo_batch(prompts: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    P = [int(torch.randint(256, 1025, (1,), generator=g)) for _ in range(prompts)]
    C = [[int(torch.randint(64, 257, (1,), generator=g)) for _ in range(8)] for _ in P]
    Pm, Cm = max(P), max(max(c) for c in C)
    B = 8 * prompts
    ids = torch.full((B, Pm + Cm), V - 3)
    mask = torch.zeros(B, Pm + Cm, dtype=torch.long)
    for i, p in enumerate(P):
        prompt = torch.randint(0, V - 3, (p,), generator=g)
        for j, c in enumerate(C[i]):
            b = 8 * i + j
            ids[b, Pm - p : Pm] = prompt
            ids[b, Pm : Pm + c] = torch.randint(0, V - 3, (c,), generator=g)
            mask[b, Pm - p : Pm + c] = 1
    return ids, mask, Cm


def dpo_batch(pairs: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(pairs):
        prompt = torch.randint(
            0, V - 3, (int(torch.randint(256, 1025, (1,), generator=g)),), generator=g
        )
        answers = [
            torch.randint(0, V - 3, (int(torch.randint(32, 257, (1,), generator=g)),), generator=g)
            for _ in range(2)
        ]
        rows.append((prompt, answers))
    seqs = [(p, a[0]) for p, a in rows] + [(p, a[1]) for p, a in rows]  # chosen rows, then rejected
    S = max(len(p) + len(a) for p, a in seqs)
    ids = torch.full((len(seqs), S), V - 3)
    attention = torch.zeros(len(seqs), S, dtype=torch.long)
    completion = torch.zeros(len(seqs), S, dtype=torch.long)
    for b, (p, a) in enumerate(seqs):
        ids[b, : len(p) + len(a)] = torch.cat([p, a])
        attention[b, : len(p) + len(a)] = 1
        completion[b, len(p) : len(p) + len(a)] = 1
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def trainers(kind: str, side: str, workdir: Path):
    import datasets
    import trl

    from flexpack.integrations import trl as ftrl

    lib = trl if side == "trl" else ftrl
    model = str(workdir / "model")
    if kind == "grpo":
        args = trl.GRPOConfig(
            output_dir=str(workdir / side), per_device_train_batch_size=16, num_generations=8,
            use_cpu=True, bf16=False, report_to=[], beta=0.04, gradient_checkpointing=False,
            model_init_kwargs={"dtype": torch.float32},
        )  # fmt: skip
        data = datasets.Dataset.from_dict({"prompt": ["t1 t2"] * 16})
        return lib.GRPOTrainer(
            model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=args, train_dataset=data, processing_class=tokenizer(),
        )  # fmt: skip
    import transformers

    args = trl.DPOConfig(
        output_dir=str(workdir / side), use_cpu=True, bf16=False, report_to=[],
        gradient_checkpointing=False,
    )  # fmt: skip
    data = datasets.Dataset.from_dict({"prompt": ["t1"], "chosen": ["t2"], "rejected": ["t3"]})
    load = transformers.AutoModelForCausalLM.from_pretrained
    return lib.DPOTrainer(
        model=load(model, dtype=torch.float32), ref_model=load(model, dtype=torch.float32),
        args=args, train_dataset=data, processing_class=tokenizer(),
    )  # fmt: skip


def logp_fwd_bwd(trainer, kind, batch, model) -> None:
    if kind == "grpo":
        ids, mask, C = batch
        aux_on = trainer.aux_loss_enabled  # an MoE model: the router's loss joins the policy's
        lp, ent, aux = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, C, compute_entropy=True, compute_aux_loss=aux_on
        )
        (lp.sum() + 0.0 * ent.sum() + (aux if aux_on else 0.0)).backward()
        return
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    kw = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    caller = model
    if hasattr(trainer, "flexpack_stats"):
        from flexpack.integrations.trl.dpo import _TreeCaller

        caller = _TreeCaller(trainer, model, extras=True)
    caller(**kw, labels=labels, fused_lm_head=True, use_cache=False).log_probs.sum().backward()


def step(trainer, kind, batch, optimizer, model) -> None:
    if kind == "grpo":
        ids, mask, C = batch
        with torch.no_grad():
            trainer._get_per_token_logps_and_entropies(model, ids, mask, C)  # old policy
            trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, C)
        logp_fwd_bwd(trainer, kind, batch, model)
    else:
        trainer.compute_loss(model, dict(batch)).backward()
    optimizer.step()
    optimizer.zero_grad()


def tokens(trainer, kind, batch) -> int:
    """Tokens one policy forward runs on this batch."""
    if not hasattr(trainer, "flexpack_stats"):
        ids = batch[0] if kind == "grpo" else batch["input_ids"]
        return ids.numel()
    before = trainer.flexpack_stats.tree_tokens
    with torch.no_grad():
        if kind == "grpo":
            ids, mask, C = batch
            trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
        else:
            from flexpack.integrations.trl.dpo import _TreeCaller

            labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
            _TreeCaller(trainer, trainer.model, extras=False)(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                labels=labels, fused_lm_head=True,
            )  # fmt: skip
    return trainer.flexpack_stats.tree_tokens - before


def batch_for(kind, args, seed: int = 0):
    return grpo_batch(args.prompts, seed) if kind == "grpo" else dpo_batch(args.pairs, seed)


def measure(args, workdir: Path, rank: int = 0, world: int = 1) -> list:
    """Both sides on both settings in this process (one rank of ``world``)."""
    rows = []
    for kind in ("grpo", "dpo"):
        batch = batch_for(kind, args, seed=rank)
        sides = {side: trainers(kind, side, workdir) for side in ("trl", "flexpack")}
        models = {s: t.model for s, t in sides.items()}
        if world > 1:  # as HF Trainer wraps the policy
            models = {s: torch.nn.parallel.DistributedDataParallel(m) for s, m in models.items()}
        opts = {s: torch.optim.AdamW(t.model.parameters(), lr=1e-6) for s, t in sides.items()}
        times = {(s, w): [] for s in sides for w in ("logp", "step")}
        for s, t in sides.items():  # warm-up
            logp_fwd_bwd(t, kind, batch, models[s])
            t.model.zero_grad()
        for _ in range(args.repeats):
            for s, t in sides.items():
                t0 = time.perf_counter()
                logp_fwd_bwd(t, kind, batch, models[s])
                times[(s, "logp")].append(time.perf_counter() - t0)
                t.model.zero_grad()
                t0 = time.perf_counter()
                step(t, kind, batch, opts[s], models[s])
                times[(s, "step")].append(time.perf_counter() - t0)
        result = {}
        for s, t in sides.items():
            run = functools.partial(step, t, kind, batch, opts[s], models[s])
            result[s] = {
                "tokens": tokens(t, kind, batch),
                "logp": statistics.median(times[(s, "logp")]),
                "step": statistics.median(times[(s, "step")]),
                "peak": tensor_peak(run) / 2**20,
                "fallbacks": getattr(t, "flexpack_stats", None) and t.flexpack_stats.fallbacks,
            }
        rows.append((kind, result))
    return rows


def rank_main(args) -> None:
    """One rank under torchrun: measure, write this rank's rows to ``--workdir``."""
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    workdir = Path(args.workdir)
    rows = measure(args, workdir, rank, world)
    (workdir / f"rank{rank}.json").write_text(json.dumps(rows))
    dist.barrier()  # no rank tears gloo down while another is in a collective
    dist.destroy_process_group()


def launch_ranks(args, workdir: Path) -> list:
    """``--world`` processes with torchrun (as users launch them); their rows, by rank."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.world), __file__, *sys.argv[1:], "--workdir", str(workdir)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(args.world)]


def across_ranks(every: list) -> list:
    """Slowest rank's times, largest rank's peak, rank 0's tokens."""
    rows = []
    for i, (kind, first) in enumerate(every[0]):
        merged = {}
        for side in first:
            per = [ranks[i][1][side] for ranks in every]
            merged[side] = {
                "tokens": per[0]["tokens"],
                "logp": max(r["logp"] for r in per),
                "step": max(r["step"] for r in per),
                "peak": max(r["peak"] for r in per),
                "fallbacks": per[0]["fallbacks"],
            }
        rows.append((kind, merged))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=2, help="GRPO prompts (x 8 completions)")
    parser.add_argument("--pairs", type=int, default=4, help="DPO pairs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    parser.add_argument("--world", type=int, default=1, help="processes (gloo, DDP)")
    parser.add_argument("--model", choices=("llama", "gpt_oss", "qwen3_5", "lfm2", "bamba"),
                        default="llama", help="gpt_oss: experts with TRL's router loss on, "
                        "sinks; qwen3_5, lfm2, bamba: hybrids (gated delta rule, short "
                        "conv, Mamba2)")  # fmt: skip
    parser.add_argument("--workdir", help=argparse.SUPPRESS)  # set for the ranks it launches
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    if args.workdir is not None:
        return rank_main(args)
    machine = describe()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        save_model(workdir / "model", args.model)
        if args.world == 1:
            rows = measure(args, workdir)
        else:
            rows = across_ranks(launch_ranks(args, workdir))
    end = os.getloadavg()[0]
    print(f"machine: {machine}, load average {end:.1f} at end; torch {torch.__version__}, "
          f"{args.threads} threads per process, world {args.world}")  # fmt: skip
    print(f"model: tiny {args.model}; GRPO: {args.prompts} prompts x G=8; DPO: {args.pairs} "
          f"pairs (per rank); median of {args.repeats}")  # fmt: skip
    print("| setting | world | path | tokens forwarded (per rank) | logp fwd+bwd (s) | step (s) "
          "| step peak (MiB) |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|")
    for kind, result in rows:
        a, b = result["trl"], result["flexpack"]
        assert not b["fallbacks"], "flexpack fell back to TRL's path"
        name = "GRPO" if kind == "grpo" else "DPO"
        wrapped = " (DDP)" if args.world > 1 else ""
        for side, r in ((f"TRL's own{wrapped}", a), (f"flexpack trees{wrapped}", b)):
            print(
                f"| {name} | {args.world} | {side} | {r['tokens']:,} | {r['logp']:.3f} | "
                f"{r['step']:.3f} | {r['peak']:.0f} |"
            )
        print(
            f"| {name} | {args.world} | **ratio TRL / flexpack** | "
            f"**{a['tokens'] / b['tokens']:.2f}x** | **{a['logp'] / b['logp']:.2f}x** | "
            f"**{a['step'] / b['step']:.2f}x** | {a['peak'] / max(b['peak'], 1):.2f}x |"
        )


if __name__ == "__main__":
    main()
