"""``python -m flexpack.integrations.litgpt finetune``: ``litgpt finetune_full`` on packed rows.

The command line apart from the library: argument parsing (options named as LitGPT's), the
Fabric training loop with :func:`lr_schedule` (warmup + cosine), validation and a checkpoint
that ``litgpt`` loads. Imports the library (``forward``, ``data``); litgpt and lightning are
imported inside :func:`finetune`, so ``--help`` and the usage errors run without them.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flexpack.integrations.litgpt.data import PackedDataModule
from flexpack.integrations.litgpt.forward import PackedGPT, PackedGPTLoss, _import_litgpt


def lr_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup then cosine decay to 0 at ``max_steps``, as ``litgpt finetune_full``.

    LitGPT's warmup starts at a learning rate of 0 (its first step does nothing); here step t of
    the warmup uses ``(t + 1) / warmup_steps`` of the rate. ``warmup_steps=0`` starts the cosine
    at once.

    Example:
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        >>> sched = lr_schedule(opt, warmup_steps=2, max_steps=6)
        >>> rates = []
        >>> for _ in range(6):
        ...     rates.append(round(sched.get_last_lr()[0], 3))
        ...     opt.step(); sched.step()
        >>> rates
        [0.5, 1.0, 1.0, 0.854, 0.5, 0.146]
    """
    warmup_steps, max_steps = int(warmup_steps), int(max_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(max_steps - warmup_steps, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup_steps, span) / span))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class _UserError(Exception):
    """A problem with the command's input: printed as ``error: ...``, exit status 2."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, got {value}; leave --max-len out for the model's "
            "block_size"
        )
    return value


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flexpack.integrations.litgpt finetune",
        description=(
            "Full fine-tuning of a LitGPT checkpoint on packed rows (flexpack): the loop of "
            "`litgpt finetune_full`, with samples packed into rows of --max-len tokens, a "
            "document-causal mask and the packed token-mean loss. Saves OUT_DIR/final, a "
            "LitGPT checkpoint directory."
        ),
    )
    p.add_argument("checkpoint_dir", type=Path, help="LitGPT checkpoint directory to fine-tune")
    p.add_argument(
        "--out_dir",
        "--out",
        dest="out_dir",
        type=Path,
        default=Path("out/finetune/packed"),
        help="where logs and checkpoints go",
    )
    p.add_argument(
        "--max-len",
        "--max_len",
        dest="max_len",
        type=_positive_int,
        default=None,
        help="tokens per packed row (default: the model's block_size); above block_size is "
        "fine: samples are truncated to block_size and attend only within themselves",
    )
    p.add_argument(
        "--precision",
        default=None,
        help='"32-true", "bf16-true", "bf16-mixed", ... (default: LitGPT\'s choice)',
    )
    p.add_argument("--devices", type=int, default=1, help="data-parallel processes (DDP)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument(
        "--data",
        default="Alpaca",
        help="a litgpt.data class: Alpaca, JSON, Dolly, LIMA, ... (default Alpaca)",
    )
    p.add_argument("--data.json_path", dest="json_path", type=Path, default=None)
    p.add_argument("--data.val_split_fraction", dest="val_split_fraction", type=float, default=None)
    p.add_argument("--data.mask_prompt", dest="mask_prompt", type=_bool, default=None)
    p.add_argument("--data.prompt_style", dest="prompt_style", default=None)
    p.add_argument(
        "--data.strategy",
        dest="strategy",
        default="bfd",
        help="packing strategy of flexpack.pack (bfd, ffd, greedy)",
    )
    p.add_argument(
        "--train.micro_batch_size",
        dest="micro_batch_size",
        type=int,
        default=1,
        help="packed rows per iteration and process",
    )
    p.add_argument(
        "--train.global_batch_size",
        dest="global_batch_size",
        type=int,
        default=None,
        help="rows per optimizer step over all processes (default: no accumulation)",
    )
    p.add_argument("--train.epochs", dest="epochs", type=int, default=1)
    p.add_argument("--train.max_steps", dest="max_steps", type=int, default=None)
    p.add_argument("--train.lr_warmup_steps", dest="lr_warmup_steps", type=int, default=100)
    p.add_argument("--train.log_interval", dest="log_interval", type=int, default=1)
    p.add_argument("--train.save_interval", dest="save_interval", type=int, default=None)
    p.add_argument("--train.max_norm", dest="max_norm", type=float, default=None)
    p.add_argument(
        "--train.loss",
        dest="loss",
        choices=("token", "document"),
        default="token",
        help="packed_cross_entropy reduction (token: mean over all supervised tokens)",
    )
    p.add_argument(
        "--train.chunked_loss",
        dest="chunked_loss",
        type=_bool,
        default=True,
        help="compute the loss from the hidden states chunk by chunk (never the whole logits); "
        "false: the logits, then packed_cross_entropy",
    )
    p.add_argument("--optimizer.lr", dest="lr", type=float, default=2e-5)
    p.add_argument("--optimizer.weight_decay", dest="weight_decay", type=float, default=0.02)
    p.add_argument("--eval.final_validation", dest="final_validation", type=_bool, default=True)
    p.add_argument("--progress", type=_bool, default=True, help="show a progress bar")
    return p


def _make_data(args: argparse.Namespace) -> Any:
    import litgpt.data

    cls = getattr(litgpt.data, args.data, None)
    if not isinstance(cls, type):
        names = sorted(n for n in dir(litgpt.data) if n[:1].isupper() and n != "DataModule")
        raise ValueError(f"--data {args.data!r} is not a litgpt.data class; choose one of {names}")
    kwargs = {}
    for name in ("json_path", "val_split_fraction", "mask_prompt", "prompt_style"):
        value = getattr(args, name)
        if value is not None:
            kwargs[name] = value
    return cls(**kwargs)


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit status 2, no traceback) for what can be checked before any work."""
    if args.data == "JSON" and args.json_path is None:
        parser.error("--data JSON needs --data.json_path PATH (a .json/.jsonl file or a folder)")
    if args.json_path is not None and not Path(args.json_path).exists():
        parser.error(
            f"--data.json_path {args.json_path}: no such file or folder; pass a .json/.jsonl "
            "file of {instruction, input, output} records, or a folder with train.json and "
            "val.json"
        )


def _prepare(data: Any, args: argparse.Namespace) -> None:
    """``data.prepare_data()``; a failed download (offline, no ``requests``) says what to do."""
    try:
        data.prepare_data()
    except (OSError, ImportError) as e:
        inner = getattr(data, "data", data)
        url = getattr(inner, "file_url", None)
        folder = getattr(inner, "download_dir", None)
        where = f" from {url}" if url else ""
        to = f" into {folder}" if folder is not None else ""
        raise _UserError(
            f"--data {args.data} downloads its data on first use{where}{to}, and that failed "
            f"({type(e).__name__}: {e}). Offline, download the file elsewhere and copy it there, "
            "or train on a local file: --data JSON --data.json_path FILE.json"
        ) from e


def _validate(
    fabric: Any, packed: nn.Module, loader: Any, reduction: str, chunked: bool = False
) -> float:
    from flexpack.loss import packed_cross_entropy

    packed.eval()
    total, count = torch.zeros((), device=fabric.device), torch.zeros((), device=fabric.device)
    with torch.no_grad():
        for batch in loader:
            ids, docs, pos = batch["input_ids"], batch["doc_ids"], batch["position_ids"]
            if chunked:  # a PackedGPTLoss
                loss = packed(ids, docs, pos, batch["labels"])
            else:
                loss = packed_cross_entropy(
                    packed(ids, docs, pos), batch["labels"], docs, reduction=reduction
                )
            total += loss.float()
            count += 1
    packed.train()
    total = fabric.all_reduce(total, reduce_op="sum")
    count = fabric.all_reduce(count, reduce_op="sum")
    return float(total / count.clamp(min=1))


def _save(fabric: Any, model: nn.Module, directory: Path, checkpoint_dir: Path, data: Any, args):
    """A LitGPT checkpoint directory: lit_model.pth ({"model": state dict}, as finetune_full
    writes it), the config and tokenizer files, the prompt style and the hyperparameters."""
    import yaml
    from litgpt.prompts import save_prompt_style
    from litgpt.utils import copy_config_files

    directory.mkdir(parents=True, exist_ok=True)
    fabric.save(directory / "lit_model.pth", {"model": model})
    if fabric.global_rank == 0:
        copy_config_files(checkpoint_dir, directory)
        if data.prompt_style is not None:
            save_prompt_style(data.prompt_style, directory)
        hparams = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        (directory / "hyperparameters.yaml").write_text(yaml.safe_dump(hparams, sort_keys=True))


def _sum_over_ranks(fabric: Any, *counts: int) -> list[int]:
    """The ``counts`` summed over the data-parallel ranks (one all_reduce; a no-op on one)."""
    if fabric.world_size == 1:
        return list(counts)
    t = torch.tensor(counts, dtype=torch.int64, device=fabric.device)
    return [int(x) for x in fabric.all_reduce(t, reduce_op="sum").tolist()]


def finetune(args: argparse.Namespace) -> dict[str, Any]:
    """Run the fine-tuning that :func:`main` parsed; returns the final metrics."""
    _import_litgpt()
    import lightning as L
    from lightning.fabric.loggers import CSVLogger
    from litgpt import GPT, Config, Tokenizer
    from litgpt.utils import check_valid_checkpoint_dir, get_default_supported_precision
    from litgpt.utils import load_checkpoint as lit_load_checkpoint

    from flexpack.loss import packed_cross_entropy

    checkpoint_dir = Path(args.checkpoint_dir)
    check_valid_checkpoint_dir(checkpoint_dir)
    config = Config.from_file(checkpoint_dir / "model_config.yaml")
    max_len = args.max_len or config.block_size
    precision = args.precision or get_default_supported_precision(training=True)
    out_dir = Path(args.out_dir)
    logger = CSVLogger(root_dir=out_dir, name="logs", flush_logs_every_n_steps=1)
    fabric = L.Fabric(
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        precision=precision,
        loggers=logger,
    )
    fabric.launch()
    fabric.seed_everything(args.seed)

    tokenizer = Tokenizer(checkpoint_dir)
    data = PackedDataModule(_make_data(args), max_len, strategy=args.strategy, seed=args.seed)
    # No document may outrun the model's context: truncate samples as LitGPT would.
    data.connect(
        tokenizer, batch_size=args.micro_batch_size, max_seq_length=min(max_len, config.block_size)
    )
    with fabric.rank_zero_first():
        _prepare(data, args)
    data.setup()
    stats = data.train_plan.stats
    fabric.print(
        f"Packed {stats.samples:,} training samples into {stats.rows:,} rows of {max_len} "
        f"tokens ({stats.efficiency:.1%} tokens, lower bound {stats.lower_bound_rows:,} rows)"
    )
    if max_len > config.block_size:
        fabric.print(
            f"Rows of {max_len} tokens exceed the model's block_size ({config.block_size}): "
            f"fine, each sample is truncated to {config.block_size} tokens and attends only "
            "within itself with positions from 0, so the model never sees a longer context; "
            "a row only holds more samples."
        )

    with fabric.init_module(empty_init=fabric.world_size > 1):
        model = GPT(config)
    model.max_seq_length = min(max_len, config.block_size)
    lit_load_checkpoint(fabric, model, checkpoint_dir / "lit_model.pth")
    wrapper = PackedGPTLoss(model, reduction=args.loss) if args.chunked_loss else PackedGPT(model)
    packed = fabric.setup(wrapper)
    optimizer = torch.optim.AdamW(packed.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    optimizer = fabric.setup_optimizers(optimizer)

    rows_per_step = args.global_batch_size or args.micro_batch_size * fabric.world_size
    accum = rows_per_step // (args.micro_batch_size * fabric.world_size)
    if accum < 1 or rows_per_step % (args.micro_batch_size * fabric.world_size):
        raise ValueError(
            f"--train.global_batch_size={rows_per_step} must be a multiple of "
            f"--train.micro_batch_size x devices = {args.micro_batch_size * fabric.world_size}"
        )
    iters_per_epoch = len(data.train_dataloader())
    max_steps = args.epochs * (iters_per_epoch // accum)
    if args.max_steps is not None:
        max_steps = min(max_steps, args.max_steps)
    scheduler = lr_schedule(optimizer, args.lr_warmup_steps, max_steps)

    bar = None
    if args.progress and fabric.is_global_zero:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_steps, desc="finetune (packed)", unit="step", file=sys.stderr)
    step = iteration = 0
    tokens_seen = mine = 0  # real tokens: of all ranks (at each log), of this rank
    metrics: dict[str, Any] = {}
    start = time.perf_counter()
    epoch = 0
    while step < max_steps and epoch < args.epochs:
        data.set_epoch(epoch)
        loader = fabric.setup_dataloaders(data.train_dataloader(), use_distributed_sampler=False)
        for batch in loader:
            if step >= max_steps:
                break
            iteration += 1
            t0 = time.perf_counter()
            accumulating = iteration % accum != 0
            with fabric.no_backward_sync(packed, enabled=accumulating):
                ids, docs, pos = batch["input_ids"], batch["doc_ids"], batch["position_ids"]
                if args.chunked_loss:  # PackedGPTLoss: the loss without the (B, S, V) logits
                    loss = packed(ids, docs, pos, batch["labels"])
                else:
                    loss = packed_cross_entropy(
                        packed(ids, docs, pos), batch["labels"], docs, reduction=args.loss
                    )
                fabric.backward(loss / accum)
            if not accumulating:
                if args.max_norm is not None:
                    fabric.clip_gradients(packed, optimizer, max_norm=args.max_norm)
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                step += 1
            real = int((batch["doc_ids"] >= 0).sum())  # this rank's
            mine += real
            dt = time.perf_counter() - t0
            if iteration % args.log_interval == 0:
                # Ranks hold different rows: sum their counts (every rank logs at this iteration).
                real, tokens_seen = _sum_over_ranks(fabric, real, mine)
                metrics = {
                    "loss": loss.item(),
                    "iter": iteration,
                    "step": step,
                    "epoch": epoch,
                    "iter_time": dt,
                    "tokens": tokens_seen,
                    "tokens_per_sec": real / dt,
                    "learning_rate": scheduler.get_last_lr()[0],
                }
                fabric.log_dict(metrics, step=iteration)
                if bar is not None:
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{real / dt:,.0f}")
            if bar is not None and not accumulating:
                bar.update(1)
            if args.save_interval and not accumulating and step % args.save_interval == 0:
                _save(fabric, model, out_dir / f"step-{step:06d}", checkpoint_dir, data, args)
        epoch += 1
    if bar is not None:
        bar.close()
    _, tokens_seen = _sum_over_ranks(fabric, 0, mine)
    elapsed = time.perf_counter() - start
    fabric.print(
        f"Trained {step} steps on {tokens_seen:,} real tokens in {elapsed:.1f} s "
        f"({tokens_seen / max(elapsed, 1e-9):,.0f} tokens/s)"
    )
    if args.final_validation and len(data.val_dataloader()):
        val_loader = fabric.setup_dataloaders(data.val_dataloader(), use_distributed_sampler=False)
        val_loss = _validate(fabric, packed, val_loader, args.loss, args.chunked_loss)
        metrics = {**metrics, "val_loss": val_loss}
        fabric.log_dict({"val_loss": val_loss}, step=iteration)
        fabric.print(
            f"Final evaluation | val loss: {val_loss:.3f} | val ppl: {math.exp(val_loss):.3f}"
        )
    final = out_dir / "final"
    _save(fabric, model, final, checkpoint_dir, data, args)
    fabric.print(f"Saved the fine-tuned checkpoint to {str(final)!r}")
    for lg in fabric.loggers:
        lg.finalize("success")
    return metrics


def main(argv: list[str] | None = None) -> int:
    """``python -m flexpack.integrations.litgpt finetune CHECKPOINT_DIR ...``; returns 0, or 2.

    2 is a user error (a failed data download), printed as ``error: ...`` without a traceback.

    ``argv`` are the arguments after the command (a leading ``"finetune"`` or
    ``"litgpt-finetune"`` is accepted, so ``flexpack litgpt-finetune`` can forward its argv); see
    ``--help`` for the options, named as in ``litgpt finetune_full`` (``--data JSON
    --data.json_path ...``, ``--train.micro_batch_size``, ``--optimizer.lr``, ...), plus
    ``--max-len``, the tokens per packed row. ``--train.micro_batch_size`` counts packed rows.

    Example (needs litgpt; a 20-step run is tested in tests/test_integrations_litgpt.py)::

            main(["finetune", "checkpoints/tiny", "--data", "JSON",
                  "--data.json_path", "data.json", "--max-len", "512", "--out", "out/tiny"])
            # -> 0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("finetune", "litgpt-finetune"):
        argv = argv[1:]
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    try:
        finetune(args)
    except _UserError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0
