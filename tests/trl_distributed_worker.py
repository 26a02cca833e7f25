"""One rank of tests/test_trl_distributed.py: TRL's trainer and flexpack's, trained in turn on the
same data in this process group, as a user launches them (torchrun / accelerate launch).

    torchrun --nproc_per_node 2 tests/trl_distributed_worker.py OUT MODEL_DIR SCENARIO [OPTION ...]

SCENARIO (comma-separated): ``grpo`` / ``dpo`` (HF Trainer's DDP, what accelerate builds on
several CPU processes), ``fsdp2`` (the trainers' log-prob seams on a model sharded by hand with
``fully_shard``: tied and untied heads, a separately sharded ``lm_head``). OPTION
``find_unused`` sets ``ddp_find_unused_parameters=True``. Each rank writes
``OUT/SCENARIO-rank{R}.json``: per-step losses of both trainers, the largest weight difference,
a checksum of the weights (equal on every rank once DDP has reduced the gradients), flexpack's
stats.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import datasets
import torch
import torch.distributed as dist
import transformers
import trl
from tokenizers import Tokenizer, models, pre_tokenizers

from flexpack.integrations import trl as ftrl

V = 64
PAD, EOS = V, V + 1


def tokenizer():
    vocab = {f"t{i}": i for i in range(V)} | {"<pad>": PAD, "</s>": EOS, "<unk>": V + 2}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def tiny(seed: int = 0, tie: bool = False):
    config = transformers.LlamaConfig(
        vocab_size=V + 3, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD, eos_token_id=EOS,
        initializer_range=0.2, tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).float()


def words(g, n):
    return " ".join(f"t{i}" for i in torch.randint(0, V, (n,), generator=g).tolist())


def reward(completions, **_):
    return [float(len(c) % 5) for c in completions]


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def grpo(cls, out: Path, model_dir: Path, find_unused: bool):
    g = torch.Generator().manual_seed(0)
    data = datasets.Dataset.from_dict({"prompt": [words(g, n) for n in (5, 9, 3, 7)]})
    args = trl.GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, use_cpu=True, bf16=False, report_to=[], beta=0.1,
        num_iterations=2, gradient_accumulation_steps=2, max_steps=2, seed=0, logging_steps=1,
        save_strategy="no", learning_rate=1e-2, model_init_kwargs={"dtype": torch.float32},
        ddp_find_unused_parameters=find_unused, disable_tqdm=True,
    )  # fmt: skip
    return cls(
        model=str(model_dir), reward_funcs=reward, train_dataset=data, args=args,
        processing_class=tokenizer(),
    )  # fmt: skip


def dpo(cls, out: Path, find_unused: bool):
    g = torch.Generator().manual_seed(0)
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(8):
        rows["prompt"].append(words(g, 3 + 2 * i))
        rows["chosen"].append(" " + words(g, 1 + i % 4))
        rows["rejected"].append(" " + words(g, 2 + (i * 3) % 5))
    args = trl.DPOConfig(
        output_dir=str(out), per_device_train_batch_size=2, max_steps=2,
        gradient_accumulation_steps=2, use_cpu=True, bf16=False, report_to=[], seed=0,
        logging_steps=1, save_strategy="no", learning_rate=1e-2, beta=0.1,
        ddp_find_unused_parameters=find_unused, disable_tqdm=True,
    )  # fmt: skip
    return cls(
        model=tiny(), ref_model=tiny(), args=args, train_dataset=datasets.Dataset.from_dict(rows),
        processing_class=tokenizer(),
    )  # fmt: skip


def train_both(make) -> dict:
    runs = {}
    for name, lib in (("trl", trl), ("flexpack", ftrl)):
        trainer = make(lib, name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        runs[name] = (losses(trainer), weights(trainer.model), trainer)
    (want, want_w, theirs), (got, got_w, ours) = runs["trl"], runs["flexpack"]
    stats = ours.flexpack_stats
    return {
        "wrapper": type(ours.model_wrapped).__name__,
        "trl_wrapper": type(theirs.model_wrapped).__name__,
        "losses": got,
        "trl_losses": want,
        "max_weight_diff": max((got_w[k] - want_w[k]).abs().max().item() for k in want_w),
        "checksum": [float(v.double().sum()) for v in got_w.values()],
        "moved": max((want_w[k] - weights(tiny())[k]).abs().max().item() for k in want_w),
        "calls": stats.calls,
        "fallbacks": stats.fallbacks,
        "tree_tokens": stats.tree_tokens,
        "padded_tokens": stats.padded_tokens,
        "attn": ours.model.config._attn_implementation,
        "find_unused": ours.model_wrapped.find_unused_parameters,
        "checkpointing": bool(ours.args.gradient_checkpointing),
    }


def rl_batch(seed: int):
    """(B, P + C) left-padded prompts and right-padded completions, two groups per rank."""
    g = torch.Generator().manual_seed(seed)
    B, P, C = 6, 6, 5
    ids = torch.randint(0, V, (B, P + C), generator=g)
    mask = torch.ones(B, P + C, dtype=torch.long)
    ids[[0, 2, 5], :P] = ids[0, :P]
    ids[[1, 3, 4], :P] = ids[1, :P]
    mask[[1, 3, 4], :2] = 0
    for b, n in enumerate([5, 2, 4, 1, 5, 3]):
        mask[b, P + n :] = 0
    ids[mask == 0] = PAD
    return ids, mask, C


def fsdp2(out: Path) -> dict:
    """The GRPO seam and DPO's fused-head forward on fully_shard'ed models: flexpack's values and
    (sharded) gradients against TRL's on the same sharded model, and two optimizer steps."""
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    result = {}
    for layout in ("untied", "tied", "lm_head_sharded"):
        model = tiny(tie=layout == "tied")
        trl.trainer.utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        for layer in model.model.layers:
            fully_shard(layer)
        if layout == "lm_head_sharded":
            fully_shard(model.lm_head)
        fully_shard(model)
        args = trl.GRPOConfig(
            output_dir=str(out / layout), use_cpu=True, bf16=False, report_to=[],
            per_device_train_batch_size=4, num_generations=4, beta=0.0,
        )  # fmt: skip
        data = datasets.Dataset.from_dict({"prompt": ["t1 t2"] * 4})
        trainer = ftrl.GRPOTrainer(
            model=model, reward_funcs=reward, train_dataset=data, args=args,
            processing_class=tokenizer(),
        )  # fmt: skip
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        ids, mask, C = rl_batch(seed=rank)  # other data on each rank
        w = torch.randn(ids.shape[0], C, generator=torch.Generator().manual_seed(7 + rank))
        theirs = trl.GRPOTrainer._get_per_token_logps_and_entropies.__get__(trainer)
        start = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        diffs, grad_diffs, steps = [], [], {}
        for name, fn in (("trl", theirs), ("flexpack", trainer._get_per_token_logps_and_entropies)):
            model.load_state_dict(
                {k: torch.distributed.tensor.distribute_tensor(v, s.device_mesh, s.placements)
                 for (k, v), s in zip(start.items(), model.state_dict().values(), strict=True)}
            )  # fmt: skip
            for _ in range(2):
                lp, ent, _ = fn(model, ids, mask, C, compute_entropy=True)
                ((lp * w).sum() + 0.1 * ent.sum()).backward()
                steps.setdefault(name, []).append(
                    (lp.detach(), [p.grad.full_tensor().clone() for p in model.parameters()])
                )
                opt.step()
                opt.zero_grad()
        for (a, ga), (b, gb) in zip(steps["flexpack"], steps["trl"], strict=True):
            diffs.append((a - b).abs().max().item())
            grad_diffs.append(max((x - y).abs().max().item() for x, y in zip(ga, gb, strict=True)))
        result[layout] = {
            "logp_diff": diffs,
            "grad_diff": grad_diffs,
            "grad_norm": max(g.abs().max().item() for g in steps["trl"][0][1]),
            "calls": trainer.flexpack_stats.calls,
            "fallbacks": trainer.flexpack_stats.fallbacks,
        }
    result["fsdp1"] = fsdp1(out)
    return result


def fsdp1(out: Path) -> dict:
    """The GRPO seam on an FSDP1 (FullyShardedDataParallel) model: one forward and backward."""
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    rank = dist.get_rank()
    model = tiny()
    trl.trainer.utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    args = trl.GRPOConfig(
        output_dir=str(out / "fsdp1"), use_cpu=True, bf16=False, report_to=[],
        per_device_train_batch_size=4, num_generations=4, beta=0.0,
    )  # fmt: skip
    trainer = ftrl.GRPOTrainer(
        model=model, reward_funcs=reward, args=args, processing_class=tokenizer(),
        train_dataset=datasets.Dataset.from_dict({"prompt": ["t1 t2"] * 4}),
    )  # fmt: skip
    layer = type(model.model.layers[0])
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer})
    wrapped = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"),
                   use_orig_params=True)  # fmt: skip
    ids, mask, C = rl_batch(seed=rank)
    theirs = trl.GRPOTrainer._get_per_token_logps_and_entropies.__get__(trainer)
    runs = []
    for fn in (theirs, trainer._get_per_token_logps_and_entropies):
        wrapped.zero_grad()
        lp, ent, _ = fn(wrapped, ids, mask, C, compute_entropy=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
        with FSDP.summon_full_params(wrapped, with_grads=True):
            runs.append((lp.detach(), [p.grad.clone() for p in wrapped.parameters()]))
    (want, want_g), (got, got_g) = runs
    return {
        "logp_diff": [(got - want).abs().max().item()],
        "grad_diff": [max((a - b).abs().max().item() for a, b in zip(got_g, want_g, strict=True))],
        "grad_norm": max(g.abs().max().item() for g in want_g),
        "calls": trainer.flexpack_stats.calls,
        "fallbacks": trainer.flexpack_stats.fallbacks,
    }


def main() -> None:
    out, model_dir, scenarios, *options = sys.argv[1:]
    out, model_dir = Path(out), Path(model_dir)
    find_unused = "find_unused" in options
    torch.set_num_threads(1)
    for scenario in scenarios.split(","):
        if scenario == "grpo":
            result = train_both(
                lambda lib, name: grpo(lib.GRPOTrainer, out / name, model_dir, find_unused)
            )
        elif scenario == "dpo":
            result = train_both(lambda lib, name: dpo(lib.DPOTrainer, out / name, find_unused))
        elif scenario == "fsdp2":
            dist.init_process_group("gloo")
            result = fsdp2(out)
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
        result["world"] = dist.get_world_size()
        (out / f"{scenario}-rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears gloo down while the other is in a collective


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
