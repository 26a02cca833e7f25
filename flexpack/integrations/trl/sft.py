"""SFT: TRL's ``SFTTrainer`` on rows packed over the whole dataset by one best-fit-decreasing plan
(:func:`flexpack.integrations.datasets.pack_dataset`), or packed on the fly from a stream,
trained on flexpack attention with TRL's own chunked loss and counted in :class:`PackStats`.
The class subclasses trl's, so it is made on first access (``__getattr__``); its docstring says
how it reads TRL's options.

Shape legend: R packed rows of S = ``max_length`` tokens; row r holds T_r real tokens in k_r
documents.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexpack.integrations.trl._common import (
    PUBLIC_MODULE,
    _attn_implementation,
    _check_switchable,
    _import_trl,
    _inner,
)

__all__ = ["PackStats", "SFTTrainer"]  # noqa: F822 (SFTTrainer: made on first access)


@dataclass
class PackStats:
    """What :class:`SFTTrainer`'s training steps forwarded, summed over steps (and ranks).

    Attributes:
        steps: micro-batches forwarded (``compute_loss`` calls in training).
        rows: packed rows forwarded, R per micro-batch.
        documents: samples in those rows (a sample split by ``packing_strategy="bfd_split"``
            counts once per piece).
        tokens: their real tokens.
        row_tokens: the slots of the rows, ``R * max_length`` per micro-batch.
        padded_tokens: what the same samples take unpacked, each its own row padded to the
            longest of its micro-batch (TRL's ``packing=False`` collator).
        truncated: tokens of a streaming train set that no row holds (``IterableDataset``,
            ``packing_strategy="bfd"``): cut by truncation to ``max_length`` (as TRL's
            ``truncation_mode`` cuts), or of a sample left with no supervised token (TRL drops
            those). The rows' ``tokens`` plus ``truncated`` are the stream's tokens.

    ``padding_removed`` is ``padded_tokens - row_tokens`` when that is positive, else 0: the
    slots TRL's default padded batches would have forwarded beyond flexpack's rows. It cannot
    go negative: where flexpack's rows took as many slots or more (a last, half-empty row of
    long samples), it is 0 and ``fill`` says how full the rows were.
    """

    steps: int = 0
    rows: int = 0
    documents: int = 0
    tokens: int = 0
    row_tokens: int = 0
    padded_tokens: int = 0
    truncated: int = 0

    @property
    def fill(self) -> float:
        """Real tokens per row slot, in [0, 1]."""
        return self.tokens / max(self.row_tokens, 1)

    @property
    def padding_removed(self) -> int:
        """Slots the unpacked micro-batches would have forwarded beyond these rows; >= 0."""
        return max(self.padded_tokens - self.row_tokens, 0)


@dataclass(frozen=True)
class _PackedCollator:
    """Rows of the packed dataset (``input_ids`` (T_r,), ``labels`` (T_r,), ``seq_lengths``
    (k_r,), TRL's name; flexpack's ``seqlens`` is read too) -> the model call's keywords, each
    (R, max_len): ``input_ids``, ``labels`` (-100 on padding and on each document's first
    token), ``position_ids`` (restarting per document), ``doc_ids`` (-1 on padding). A row
    without either (an unpacked eval set, a dataset passed with ``skip_prepare_dataset``) is
    one document."""

    max_len: int
    pad_id: int
    padding_mask: bool = False  # also an attention_mask (1 = real token): see SFTTrainer

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        from flexpack.data import collate
        from flexpack.integrations.transformers import packed_forward_kwargs

        rows = [
            {
                "input_ids": r["input_ids"],
                **({"labels": r["labels"]} if "labels" in r else {}),
                "seqlens": _row_seqlens(r),
            }
            for r in rows
        ]
        batch = collate(rows, max_len=self.max_len, pad_id=self.pad_id)
        kwargs = packed_forward_kwargs(batch, labels=True)
        del kwargs["use_cache"]  # TRL's compute_loss sets it
        if self.padding_mask:
            kwargs["attention_mask"] = (batch.doc_ids >= 0).long()
        return kwargs


def _row_seqlens(row: dict[str, Any]) -> Any:
    """A packed row's document lengths: TRL's ``seq_lengths``, flexpack's ``seqlens``, or the
    whole row as one document."""
    for key in ("seq_lengths", "seqlens"):
        if key in row:
            return row[key]
    return [len(row["input_ids"])]


def _document_weights(labels: Tensor, doc_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Per-document loss weights for the shifted targets of packed rows, without a host sync.

    labels, doc_ids: (R, S), HF-style unshifted labels (-100 = not supervised). Returns the
    (R, S - 1) weight of each target ``labels[:, 1:]`` (1 / the supervised targets of its
    document, 0 where not supervised) and the number of documents with a supervised target.
    A document is a (row, id) pair; ids are below S.
    """
    supervised = labels[:, 1:] != -100
    doc = doc_ids[:, 1:].long().clamp(min=0)
    counts = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    counts.scatter_add_(1, doc, supervised.float())  # (R, S): supervised targets per id
    weight = torch.where(supervised, 1.0 / counts.gather(1, doc).clamp(min=1), 0.0)
    return weight, (counts > 0).sum()


class _DocumentWeighted:
    """The model as TRL's ``compute_loss`` calls it, with the fused head's per-token log-probs
    weighted per document: TRL's ``sum(-log_probs) / num_items_in_batch`` with the number of
    documents as ``num_items_in_batch`` is then the mean over documents of each one's mean."""

    def __init__(self, model: Any, weight: Tensor) -> None:
        self.model, self.weight = model, weight

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.model(*args, **kwargs)
        if kwargs.get("fused_lm_head"):
            out.log_probs = out.log_probs * self.weight.to(out.log_probs)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class _Truncated:
    """The samples of TRL's prepared stream as TRL's unpacked path cuts them: to ``max_len``
    tokens by ``mode`` (``"keep_start"`` / ``"keep_end"``; None: uncut), samples left without a
    supervised token dropped. Re-iterable; reads the whole stream in every DataLoader worker.

    ``lost`` counts the tokens no row will hold, of the samples this reader owns (stream index
    ``i % n == g``, ``owner = (g, n)``): every reader reads every sample, so each loss is
    counted by exactly one reader."""

    def __init__(self, samples: Any, max_len: int, mode: str | None) -> None:
        self.samples, self.max_len, self.mode = samples, max_len, mode
        self.owner, self.lost = (0, 1), 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from flexpack.data.streaming import _whole_stream

        g, n, m = *self.owner, self.max_len
        for i, sample in enumerate(_whole_stream(self.samples)):
            ids = list(sample["input_ids"])
            labels = list(sample["labels"]) if sample.get("labels") is not None else ids
            lost = 0
            if self.mode is not None:
                if len(ids) > m:
                    cut = slice(None, m) if self.mode == "keep_start" else slice(-m, None)
                    lost, ids, labels = len(ids) - m, ids[cut], labels[cut]
                if all(label == -100 for label in labels):  # TRL drops it: no loss
                    lost, ids = lost + len(ids), []
            if lost and i % n == g:
                self.lost += lost
            if ids:
                yield {"input_ids": ids, "labels": labels}


class _StreamedRows(torch.utils.data.IterableDataset):
    """TRL's prepared stream (a ``datasets.IterableDataset`` of ``input_ids`` and ``labels``)
    packed on the fly by :class:`flexpack.data.PackedIterableDataset` into rows as TRL's packed
    datasets hold them: dicts of ``input_ids`` (T_r,) and ``labels`` (T_r,) lists, the row's
    ``seq_lengths`` (k_r,), and ``truncated``, the tokens lost (see :class:`_Truncated`) that
    this row reports (counted once over rows, workers and ranks; the last row of each reader
    carries what is left).

    Memory: at most ``buffer_size`` samples wait, plus one row. Ranks: this object deals the rows
    itself (``sync_ranks=True``: every rank the same number of rows, every sample once; a short
    rank's last row is empty), so its DataLoader must not be sharded again (see
    ``SFTTrainer._flexpack_stream_loader``)."""

    def __init__(
        self, samples: Any, max_len: int, *, strategy: str, overflow: str, truncation_mode: str,
        buffer_size: int, pad_id: int, rank: int, world_size: int,
    ) -> None:  # fmt: skip
        from flexpack.data import PackedIterableDataset

        self.samples = samples
        self.truncated = _Truncated(
            samples, max_len, truncation_mode if overflow == "truncate" else None
        )
        self.rank, self.world_size = rank, world_size
        self.packer = PackedIterableDataset(
            self.truncated, max_len, buffer_size=buffer_size, strategy=strategy,
            overflow="error" if overflow == "truncate" else overflow, labels_column="labels",
            pad_id=pad_id, rank=rank, world_size=world_size, sync_ranks=world_size > 1,
        )  # fmt: skip

    def set_epoch(self, epoch: int) -> None:  # Trainer calls it: a shuffled stream reshuffles
        if hasattr(self.samples, "set_epoch"):
            self.samples.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        self.truncated.owner = (self.rank * workers + worker, self.world_size * workers)
        self.truncated.lost = reported = 0
        held = None
        for row in self.packer:  # one row late: the last one reports what is left
            if held is not None:
                yield _stream_row(held, self.truncated.lost - reported)
                reported = self.truncated.lost
            held = row
        if held is not None:
            yield _stream_row(held, self.truncated.lost - reported)


def _stream_row(row: Any, truncated: int) -> dict[str, Any]:
    """A one-row ``PackedBatch`` as a row of TRL's packed datasets (plus ``truncated``)."""
    doc_ids = row.doc_ids[0]
    real = doc_ids >= 0
    seq_lengths = torch.bincount(doc_ids[real].long()).tolist() if bool(real.any()) else []
    return {
        "input_ids": row.input_ids[0][real].tolist(),
        "labels": row.labels[0][real].tolist(),
        "seq_lengths": seq_lengths,
        "truncated": truncated,
    }


class _StreamCollator:
    """The trainer's collator over streamed rows; their ``truncated`` counts travel beside the
    batch as ``flexpack_truncated`` (read off by ``compute_loss``)."""

    def __init__(self, collator: Any) -> None:
        self.collator = collator

    def __call__(self, rows: list[dict[str, Any]]) -> Any:
        truncated = sum(r.get("truncated", 0) for r in rows)
        batch = self.collator([{k: v for k, v in r.items() if k != "truncated"} for r in rows])
        if isinstance(batch, dict):
            batch["flexpack_truncated"] = torch.tensor(truncated)
        return batch


# TRL's packing_strategy -> flexpack's (strategy, overflow) of pack_dataset
_SFT_STRATEGIES = {
    "bfd": ("bfd", "truncate"),
    "bfd_split": ("bfd", "split"),
    "wrapped": ("wrap", "error"),  # samples cut at row ends; each piece its own document
}


def _peft_configs(model: Any, peft_config: Any) -> list[Any]:
    """The PEFT configs a trainer would train: TRL's ``peft_config`` argument and those of a
    model that already carries adapters (PEFT's ``peft_config`` dict, ``active_peft_config``)."""
    found = [] if peft_config is None else [peft_config]
    if isinstance(model, str):
        return found
    held = getattr(model, "peft_config", None)
    if isinstance(held, dict):
        found.extend(held.values())
    elif held is not None:
        found.append(held)
    try:
        active = getattr(model, "active_peft_config", None)
    except Exception:  # PEFT raises when no adapter is active
        active = None
    if active is not None:
        found.append(active)
    return found


def _refuse_prompt_learning(model: Any, peft_config: Any) -> None:
    """Refuse, at construction, PEFT methods that add virtual tokens to the model's input."""
    for config in _peft_configs(model, peft_config):
        if not getattr(config, "is_prompt_learning", False):
            continue
        method = getattr(getattr(config, "peft_type", None), "value", None) or type(config).__name__
        raise ValueError(
            f"flexpack's SFTTrainer does not train PEFT prompt-learning methods; got {method} "
            f"({type(config).__name__}, {getattr(config, 'num_virtual_tokens', '?')} virtual "
            "tokens). PEFT adds its virtual tokens once per row, not per sample: prefix tuning "
            "gives its key/values to the first sample of a packed row only (the others train "
            "without them, silently), and prompt tuning / P-tuning prepend embeddings that the "
            "rows' doc_ids do not cover. Use trl.SFTTrainer for prompt-learning methods, or a "
            "weight adapter (LoRA, DoRA, IA3, ...) with flexpack's."
        )


@functools.cache
def _sft_class() -> type:
    trl = _import_trl()
    base = trl.SFTTrainer
    signature = inspect.signature(base.__init__)

    class SFTTrainer(base):
        """TRL's ``SFTTrainer`` on rows packed by flexpack over the whole dataset.

        Same constructor and ``SFTConfig`` as ``trl.SFTTrainer``; one import changes. TRL
        tokenizes the dataset and builds its labels as it does without packing (the prompt
        masked when the data is prompt-completion: ``completion_only_loss``, TRL's default;
        ``assistant_only_loss``; truncation to ``max_length``), then ``flexpack.integrations.
        datasets.pack_dataset`` packs all of it with one best-fit-decreasing plan into rows of
        ``args.max_length`` (``packing`` is implied; ``packing_strategy="bfd_split"`` splits
        over-long samples instead of truncating them). The packed rows carry TRL's
        ``seq_lengths`` column: row i of ``trainer.train_dataset`` holds several samples, not
        sample i. Each micro-batch is
        ``per_device_train_batch_size`` rows of (R, max_length), with ``doc_ids`` and
        ``position_ids`` that restart per sample. The model runs on flexpack attention (switched
        on this instance for ``train`` / ``evaluate``, restored after) and its recurrent / conv
        mixers are adapted, so no sample sees another; the loss is TRL's own (its fused LM head:
        per-token log-probs from the hidden states in chunks, never the (R, S, V) logits; the
        first token of every sample has label -100, so no prediction crosses a boundary).

        TRL's options, as flexpack reads them:

        - ``completion_only_loss``, ``assistant_only_loss``, ``dataset_text_field``,
          ``formatting_func``, ``truncation_mode``: TRL's own preparation builds the samples and
          their labels, so each packed sample is the one TRL's unpacked trainer trains on.
        - ``packing_strategy``: ``"bfd"`` (truncate over-long samples), ``"bfd_split"`` (split
          them) or ``"wrapped"`` (concatenate in order, cut every ``max_length`` tokens: rows
          full but the last; each piece is its own document, where TRL's wrapped rows let the
          samples of a row attend to each other).
        - ``eval_packing=False``: each eval sample in its own row (truncated to ``max_length``),
          as TRL evaluates it; otherwise the eval set is packed as the train set.
        - ``packing`` and ``padding_free``: flexpack's rows are packed and carry no attention
          across samples either way, so both only change what TRL checks at construction
          (``padding_free=True`` with ``packing=False`` and a ``max_length`` is TRL's error).
        - PEFT weight adapters (LoRA, DoRA, IA3, ...) train as in TRL; prompt-learning methods
          (prefix tuning, prompt tuning, P-tuning: virtual tokens once per row) are refused at
          construction. Datasets with images are refused at construction too.

        Streaming (a ``datasets.IterableDataset`` as train or eval set, ``max_steps`` set as TRL
        asks): TRL prepares the stream lazily as above, and :class:`flexpack.data.
        PackedIterableDataset` packs it on the fly (best fit inside a buffer of ``buffer_size``
        samples, a keyword of flexpack's, default 1024; ``"bfd_split"`` / ``"wrapped"`` as
        above). With ``"bfd"`` a sample over ``max_length`` is cut as TRL's
        ``truncation_mode`` cuts it, and one left without a supervised token is dropped, as TRL
        drops it; their lost tokens are counted (``flexpack/truncated``,
        ``PackStats.truncated``). Every rank reads the whole stream and takes its own rows, the
        same number on every rank (a short rank's last row is empty), every sample once; the
        DataLoader is not sharded again by accelerate (whose split repeats rows from the first
        batch to fill the last).

        ``reduction`` (keyword, flexpack's): ``"token"`` (TRL's: the mean over every supervised
        token of the step) or ``"document"`` (the mean over the step's samples of each sample's
        mean token loss, so a long answer weighs as much as a short one; across gradient
        accumulation and ranks, as ``num_items_in_batch`` counts tokens for TRL).

        An MoE model's router load-balancing loss (on when TRL turns it on) is taken over the
        rows' real tokens (the rows carry an ``attention_mask`` marking padding), as TRL's
        unpacked trainer takes it over the same samples' tokens.

        ``trainer.flexpack_stats`` (:class:`PackStats`) counts what training forwarded, and the
        logs carry ``flexpack/rows``, ``flexpack/fill``, ``flexpack/tokens`` and
        ``flexpack/padding_removed`` (>= 0, see :class:`PackStats`) and, for a streaming set,
        ``flexpack/truncated`` beside TRL's metrics (per
        micro-batch, averaged over the logging interval as TRL averages its own).
        """

        def __init__(
            self, *args: Any, reduction: str = "token", buffer_size: int = 1024, **kwargs: Any
        ) -> None:
            if reduction not in ("token", "document"):
                raise ValueError(
                    f"flexpack's SFTTrainer takes reduction='token' (TRL's mean over supervised "
                    f"tokens) or 'document' (the mean of each sample's mean), got {reduction!r}."
                )
            bound = signature.bind(self, *args, **kwargs).arguments
            _refuse_prompt_learning(bound.get("model"), bound.get("peft_config"))
            self.flexpack_stats = PackStats()
            self.flexpack_reduction = reduction
            if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
                raise ValueError(
                    f"flexpack's SFTTrainer takes buffer_size, the samples of a streaming dataset "
                    f"held for best fit, as an int >= 1 (1024 or more keeps rows full); got "
                    f"{buffer_size!r}."
                )
            self.flexpack_buffer_size = buffer_size
            self._flexpack_prepared_train = False  # TRL prepares the train set first
            base.__init__(self, *args, **kwargs)
            _refuse_prompt_learning(self.model, None)
            if reduction == "document" and (
                self.compute_loss_func is not None or self.label_smoother is not None
            ):
                raise ValueError(
                    "flexpack's SFTTrainer(reduction='document') weighs TRL's own token loss; "
                    "it cannot with a compute_loss_func or label_smoothing_factor > 0. Drop "
                    "those, or use reduction='token'."
                )
            from flexpack.integrations.transformers import _prepare

            if self._is_vision_dataset:
                raise ValueError(
                    "flexpack's SFTTrainer packs text datasets; this one has images. Use "
                    "trl.SFTTrainer, or flexpack.integrations.transformers.pack_multimodal."
                )
            _check_switchable(self.model, "the model")
            _prepare(self.model)  # adapt recurrent / conv mixers, refuse what cannot be exact
            trl_collator = trl.trainer.sft_trainer.DataCollatorForLanguageModeling
            if isinstance(self.data_collator, trl_collator):  # TRL's own: replaced by flexpack's
                self.data_collator = _PackedCollator(
                    max_len=self._flexpack_max_len(self.args),
                    pad_id=self._tokenizer.pad_token_id,
                    padding_mask=self.aux_loss_enabled,  # the router's loss leaves padding out
                )

        @staticmethod
        def _flexpack_max_len(args: Any) -> int:
            if args.max_length is None:
                raise ValueError(
                    "flexpack's SFTTrainer packs rows of args.max_length tokens; got "
                    "max_length=None. Set SFTConfig(max_length=...) (TRL's default is 1024)."
                )
            return int(args.max_length)

        def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, name):
            from flexpack.integrations.datasets import pack_dataset

            max_len = self._flexpack_max_len(args)
            if isinstance(dataset, _StreamedRows) or {"seq_lengths", "seqlens"} & set(
                _datasets_columns(dataset)
            ):
                # Packed already: TRL's evaluate prepares a dataset it is handed, and Trainer's
                # evaluate of a dict calls evaluate again on each prepared one. Packing rows
                # again would make each row one sample, its documents attending to each other.
                return dataset
            is_train = not self._flexpack_prepared_train  # TRL's __init__ prepares it first
            self._flexpack_prepared_train = True
            if not is_train and args.eval_packing is False:
                # TRL's unpacked preparation (truncated to max_length): each sample its own row
                dataset = base._prepare_dataset(
                    self, dataset, processing_class, args, False, formatting_func, name
                )
                keep = [c for c in ("input_ids", "labels") if c in _datasets_columns(dataset)]
                return dataset.select_columns(keep) if keep else dataset
            strategy = args.packing_strategy
            if strategy not in _SFT_STRATEGIES:
                raise ValueError(
                    f"flexpack's SFTTrainer packs with packing_strategy 'bfd', 'bfd_split' or "
                    f"'wrapped' (TRL's), got {strategy!r}."
                )
            strategy, overflow = _SFT_STRATEGIES[strategy]
            streaming = isinstance(dataset, _datasets().IterableDataset)
            if overflow != "truncate" or streaming:
                # TRL's unpacked path truncates to max_length: not here. A stream is cut while
                # it is packed, where the tokens cut off are counted (_StreamedRows).
                args = copy.copy(args)
                args.max_length = None
            # TRL's own preparation as for unpadded training: tokenize, labels, truncation.
            dataset = base._prepare_dataset(
                self, dataset, processing_class, args, False, formatting_func, name
            )
            if streaming:
                # Every rank reads the whole stream; the rows are dealt to the ranks here (and
                # only here: _flexpack_stream_loader keeps accelerate from sharding them again).
                return _StreamedRows(
                    dataset, max_len, strategy=strategy, overflow=overflow,
                    truncation_mode=args.truncation_mode, buffer_size=self.flexpack_buffer_size,
                    pad_id=self._tokenizer.pad_token_id or 0,
                    rank=args.process_index, world_size=args.world_size,
                )  # fmt: skip
            if not isinstance(dataset, _datasets().Dataset):
                raise TypeError(
                    f"flexpack's SFTTrainer packs a datasets.Dataset or datasets.IterableDataset; "
                    f"the {name} dataset is a {type(dataset).__name__}."
                )
            packed = pack_dataset(
                dataset, max_len, labels_column="labels", strategy=strategy, overflow=overflow,
                seed=args.seed, num_proc=args.dataset_num_proc,
            )  # fmt: skip
            return packed.rename_column("seqlens", "seq_lengths")  # TRL's name for the column

        def _set_signature_columns_if_needed(self) -> None:
            base._set_signature_columns_if_needed(self)
            if "seqlens" not in self._signature_columns:  # the packed rows' document lengths
                self._signature_columns = [*self._signature_columns, "seqlens"]

        def get_train_dataloader(self) -> Any:
            if isinstance(self.train_dataset, _StreamedRows):
                return self._flexpack_stream_loader(self.train_dataset, self._train_batch_size)
            return base.get_train_dataloader(self)

        def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
            dataset = eval_dataset
            if isinstance(dataset, str):
                dataset = self.eval_dataset[dataset]
            elif dataset is None:
                dataset = self.eval_dataset
            if isinstance(dataset, _StreamedRows):
                return self._flexpack_stream_loader(dataset, self.args.eval_batch_size)
            return base.get_eval_dataloader(self, eval_dataset)

        def _flexpack_stream_loader(self, rows: _StreamedRows, batch_size: int) -> Any:
            """A DataLoader over streamed rows, prepared by accelerate as for one process.

            accelerate shards an IterableDataset across processes itself (IterableDatasetShard,
            which completes the last batch with rows from the first: samples twice); the rows
            are already this rank's (``_StreamedRows`` deals them), so it must not: the loader
            gets accelerate's device placement and end-of-data signal, not its split."""
            from accelerate.data_loader import prepare_data_loader

            args, acc = self.args, self.accelerator
            extra = {}
            if args.dataloader_num_workers > 0:
                extra["persistent_workers"] = args.dataloader_persistent_workers
                if args.dataloader_prefetch_factor is not None:
                    extra["prefetch_factor"] = args.dataloader_prefetch_factor
            loader = torch.utils.data.DataLoader(
                rows, batch_size=batch_size, collate_fn=_StreamCollator(self.data_collator),
                num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
                **extra,
            )  # fmt: skip
            return prepare_data_loader(
                loader, acc.device, num_processes=1, process_index=0,
                put_on_device=acc.device_placement, rng_types=None, dispatch_batches=False,
                non_blocking=acc.non_blocking, use_stateful_dataloader=acc.use_stateful_dataloader,
            )  # fmt: skip

        def train(self, *args: Any, **kwargs: Any) -> Any:
            """TRL's ``train`` with the model on flexpack attention, restored when it returns
            (gradient checkpointing recomputes layers with the implementation current then)."""
            from flexpack.integrations.transformers import register

            with _attn_implementation(_inner(self.model), register()):
                return base.train(self, *args, **kwargs)

        def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
            """TRL's ``evaluate`` on packed rows, with the model on flexpack attention."""
            from flexpack.integrations.transformers import register

            with _attn_implementation(_inner(self.model), register()):
                return base.evaluate(self, *args, **kwargs)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            """TRL's ``compute_loss`` (its fused LM head over the packed rows), plus flexpack's
            counts; TRL's ``num_tokens`` counts the rows' real tokens, not their padding."""
            mode = "train" if self.model.training else "eval"
            truncated = inputs.pop("flexpack_truncated", None)  # a streamed set's lost tokens
            counted = self._flexpack_count(inputs, mode, truncated)
            before = self._total_train_tokens
            if self.flexpack_reduction == "document" and "doc_ids" in inputs:
                weight, documents = _document_weights(inputs["labels"], inputs["doc_ids"])
                model = _DocumentWeighted(model, weight)
                if num_items_in_batch is None:  # evaluation: this micro-batch's documents
                    num_items_in_batch = documents
            out = base.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
            if counted is not None and mode == "train":
                self._total_train_tokens = before + counted // self._tp_size
                self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
            return out

        def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
            """TRL's count of supervised tokens over the accumulated micro-batches (and ranks),
            or of documents with ``reduction="document"``."""
            if self.flexpack_reduction != "document" or not all(
                "doc_ids" in b and "labels" in b for b in batch_samples
            ):
                return base._get_num_items_in_batch(self, batch_samples, device)
            total = sum(_document_weights(b["labels"], b["doc_ids"])[1] for b in batch_samples)
            total = torch.as_tensor(total, device=device)
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                total = self.accelerator.gather(total).sum()
            return total

        def _flexpack_count(
            self, inputs: dict[str, Any], mode: str, truncated: Tensor | None = None
        ) -> int | None:
            """Count the micro-batch into the stats and TRL's metrics; its real tokens."""
            doc_ids, pos = inputs.get("doc_ids"), inputs.get("position_ids")
            if not isinstance(doc_ids, Tensor) or not isinstance(pos, Tensor):
                return None  # a collator of the user's own
            R, S = doc_ids.shape
            real = doc_ids >= 0
            docs = (doc_ids.amax(1) + 1).clamp(min=0).sum()
            longest = torch.where(real, pos, 0).amax() + 1
            lost = docs.new_tensor(0) if truncated is None else truncated.to(docs)
            local = torch.stack(
                [docs.new_tensor(R), docs.new_tensor(R * S), docs, real.sum(), docs * longest, lost]
            )
            rows, slots, docs, tokens, padded, lost = (
                self.accelerator.gather_for_metrics(local[None]).sum(0).tolist()
            )  # one host sync, as TRL's own metrics
            if mode == "train":
                s = self.flexpack_stats
                s.steps += 1
                s.rows, s.documents, s.tokens = s.rows + rows, s.documents + docs, s.tokens + tokens
                s.row_tokens, s.padded_tokens = s.row_tokens + slots, s.padded_tokens + padded
                s.truncated += lost
            metrics = self._metrics[mode]
            metrics["flexpack/rows"].append(float(rows))
            metrics["flexpack/fill"].append(tokens / max(slots, 1))
            metrics["flexpack/tokens"].append(float(tokens))
            metrics["flexpack/padding_removed"].append(float(max(padded - slots, 0)))
            if truncated is not None:
                metrics["flexpack/truncated"].append(float(lost))
            return int(tokens)

    SFTTrainer.__module__ = PUBLIC_MODULE
    SFTTrainer.__qualname__ = "SFTTrainer"
    return SFTTrainer


def _datasets():
    import datasets

    return datasets


def _datasets_columns(dataset: Any) -> list[str]:
    """Column names of a ``datasets.Dataset`` or ``IterableDataset`` (None when unknown: [])."""
    return list(getattr(dataset, "column_names", None) or [])


def __getattr__(name: str) -> type:
    # The trainer subclasses trl's, so it exists once trl is imported: on first access.
    if name == "SFTTrainer":
        return _sft_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
