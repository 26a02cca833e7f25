"""LitGPT's SFT data modules on packed rows: :class:`PackedDataModule`.

Wraps a LitGPT ``DataModule`` (``Alpaca``, ``JSON``, ``Dolly``, ...) and packs its tokenized
samples (prompt masks kept) into rows of ``max_len`` with one global plan, equal rows per rank.
Imports neither litgpt nor the forward: it reads the samples the wrapped module yields.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor


class _PackedRows(torch.utils.data.Dataset):
    """Rows of a plan over in-memory samples (dicts with ``input_ids`` and ``labels``)."""

    def __init__(self, plan: Any, samples: list[dict[str, np.ndarray]], pad_id: int) -> None:
        self.plan, self.samples, self.pad_id = plan, samples, pad_id
        self.num_tokens = np.asarray(plan.row_lengths(), dtype=np.int64)

    def __len__(self) -> int:
        return self.plan.num_rows

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Tensor]]:
        batch = self.plan.materialize(self.samples, [int(i) for i in indices], pad_id=self.pad_id)
        cols = {
            "input_ids": batch.input_ids,
            "labels": batch.labels,
            "doc_ids": batch.doc_ids,
            "position_ids": batch.position_ids,
        }
        return [{k: v[i] for k, v in cols.items()} for i in range(len(indices))]


def _stack_rows(rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _sample_arrays(item: Any, where: str) -> dict[str, np.ndarray]:
    if not isinstance(item, dict) or "input_ids" not in item:
        got = sorted(item) if isinstance(item, dict) else type(item).__name__
        raise TypeError(
            f"{where} is {got}, expected a dict with 'input_ids' (and 'labels'), as LitGPT's "
            "SFTDataset yields; wrap a LitGPT SFT DataModule (Alpaca, JSON, Dolly, ...). For "
            "pretraining token streams (TinyStories, TextFiles) take the doc ids from the EOS "
            "tokens instead: flexpack.PackedLayout.from_eos (docs/litgpt.md)"
        )
    ids = torch.as_tensor(item["input_ids"]).reshape(-1).long().numpy()
    labels = item.get("labels")
    labels = ids if labels is None else torch.as_tensor(labels).reshape(-1).long().numpy()
    if len(labels) != len(ids):
        raise ValueError(
            f"{where} has {len(ids)} input_ids but {len(labels)} labels; they must match"
        )
    return {"input_ids": ids, "labels": labels}


class PackedDataModule:
    """A LitGPT ``DataModule`` whose loaders yield packed rows.

    Wraps any LitGPT SFT data module (``Alpaca``, ``JSON``, ``Dolly``, ``LIMA``, ...) with the
    same ``connect`` / ``prepare_data`` / ``setup`` / ``train_dataloader`` / ``val_dataloader``
    interface. ``setup`` tokenizes every sample once through the wrapped module's own datasets
    (its prompt style, prompt masking and truncation), plans all of them with
    :func:`flexpack.pack` (one global plan), and the loaders serve rows of ``max_len`` tokens::

        input_ids     (b, max_len) int64   pad id on padding
        labels        (b, max_len) int64   the sample's labels (-100 on masked prompts), -100 on
                                           each document's first token and on padding
        doc_ids       (b, max_len) int32   -1 on padding
        position_ids  (b, max_len) int64   restart at 0 in every document

    b is ``batch_size`` rows (given to ``connect``). Rows are dealt to ranks by
    :class:`flexpack.data.DistributedPackedSampler`: every rank gets the same number of rows
    (``remainder="pad"`` repeats a few rows, so every sample is seen each epoch), rows of
    similar size side by side, reshuffled every epoch from ``seed`` (call ``set_epoch``). Under
    Fabric pass ``use_distributed_sampler=False`` to ``fabric.setup_dataloaders``: the sampler
    already shards.

    Args:
        data: a LitGPT ``DataModule`` whose datasets yield dicts with ``input_ids`` and
            ``labels`` (LitGPT's ``SFTDataset``).
        max_len: S, tokens per row. Samples longer than this are truncated to it (as LitGPT's
            ``max_seq_length`` does).
        strategy: packing strategy of :func:`flexpack.pack` ("bfd" default).
        seed: seeds the plan's row order and the per-epoch shuffles.
        shuffle: reshuffle the training rows every epoch.
        pad_id: token id on padding (LitGPT's collate uses 0).
        remainder: what the sampler does with rows that do not divide among ranks ("pad",
            "drop", "error"; see ``flexpack.data.shard_rows``).
        num_workers: DataLoader workers.
        world_size, rank: data-parallel ranks and this one; default ``torch.distributed``'s (1
            and 0 when it is not initialized), read when a loader is made.

    Attributes:
        train_plan, val_plan: the :class:`flexpack.PackPlan` of each split (``.stats`` has rows,
            padding and efficiency), after ``setup``.

    Example (needs litgpt; tested in tests/test_integrations_litgpt.py)::

            from litgpt.data import JSON
            inner = JSON(Path("data.json"), val_split_fraction=0.1)
            data = PackedDataModule(inner, max_len=2048)
            data.connect(tokenizer, batch_size=2)
            data.setup()
            batch = next(iter(data.train_dataloader()))
            sorted(batch)
            # -> ['doc_ids', 'input_ids', 'labels', 'position_ids']
    """

    def __init__(
        self,
        data: Any,
        max_len: int,
        *,
        strategy: str = "bfd",
        seed: int = 0,
        shuffle: bool = True,
        pad_id: int = 0,
        remainder: str = "pad",
        num_workers: int = 0,
        world_size: int | None = None,
        rank: int | None = None,
    ) -> None:
        from flexpack.data._common import check_choice, check_positive_int
        from flexpack.packing import STRATEGIES

        for method in ("connect", "setup", "train_dataloader", "val_dataloader"):
            if not callable(getattr(data, method, None)):
                raise TypeError(
                    f"data must be a LitGPT DataModule (Alpaca, JSON, ...), got "
                    f"{type(data).__name__} without a {method}() method"
                )
        self.data = data
        self.max_len = check_positive_int("max_len", max_len)
        self.strategy = check_choice("strategy", strategy, STRATEGIES)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.pad_id = int(pad_id)
        self.remainder = check_choice("remainder", remainder, ("pad", "drop", "error"))
        self.num_workers = int(num_workers)
        self.world_size, self.rank = world_size, rank
        self.batch_size = 1
        self.train_plan = self.val_plan = None
        self._train = self._val = None
        self._epoch = 0

    def __repr__(self) -> str:
        return f"PackedDataModule({self.data!r}, max_len={self.max_len})"

    @property
    def prompt_style(self) -> Any:
        """The wrapped module's prompt style (LitGPT saves it beside a fine-tuned checkpoint)."""
        return getattr(self.data, "prompt_style", None)

    def connect(
        self,
        tokenizer: Any = None,
        batch_size: int = 1,
        max_seq_length: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Settings known only at run time, as on a LitGPT DataModule.

        Args:
            tokenizer: a ``litgpt.Tokenizer``.
            batch_size: packed rows per loader batch (per rank).
            max_seq_length: truncate samples to this many tokens (at most ``max_len``).
        """
        from flexpack.data._common import check_positive_int

        self.batch_size = check_positive_int("batch_size", batch_size)
        limit = self.max_len if max_seq_length is None else min(int(max_seq_length), self.max_len)
        self.data.connect(tokenizer=tokenizer, batch_size=1, max_seq_length=limit, **kwargs)

    def prepare_data(self) -> None:
        """The wrapped module's ``prepare_data`` (downloads, if it has any)."""
        prepare = getattr(self.data, "prepare_data", None)
        if callable(prepare):
            prepare()

    def setup(self, stage: str = "") -> None:
        """Tokenize every sample of both splits once and plan its rows."""
        from flexpack.packing import pack

        self.data.setup(stage)
        splits = {}
        for name in ("train", "val"):
            # Only the wrapped loader's dataset is used: its workers never start, so torch's
            # warning about their number (LitGPT's default is 4) does not apply.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*worker processes in total.*")
                dataset = getattr(self.data, f"{name}_dataloader")().dataset
            samples = [
                _sample_arrays(dataset[i], f"{name} sample {i}") for i in range(len(dataset))
            ]
            lengths = np.array([len(s["input_ids"]) for s in samples], dtype=np.int64)
            plan = pack(
                lengths, self.max_len, strategy=self.strategy, overflow="truncate", seed=self.seed
            )
            splits[name] = _PackedRows(plan, samples, self.pad_id)
        self._train, self._val = splits["train"], splits["val"]
        self.train_plan, self.val_plan = self._train.plan, self._val.plan

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's row shuffle for loaders made after this call (same on all ranks)."""
        self._epoch = int(epoch)

    def _loader(self, rows: _PackedRows | None, shuffle: bool) -> torch.utils.data.DataLoader:
        from flexpack.data import DistributedPackedSampler

        if rows is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        if len(rows) == 0:  # an empty split (e.g. no validation samples): an empty loader
            return torch.utils.data.DataLoader(rows, batch_size=self.batch_size)
        sampler = DistributedPackedSampler(
            rows,
            num_replicas=self.world_size,
            rank=self.rank,
            shuffle=shuffle,
            seed=self.seed,
            remainder=self.remainder,
        )
        sampler.set_epoch(self._epoch)
        return torch.utils.data.DataLoader(
            rows,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=_stack_rows,
        )

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        """Packed training rows, this rank's share, shuffled per epoch."""
        return self._loader(self._train, self.shuffle)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        """Packed validation rows, this rank's share, in plan order."""
        return self._loader(self._val, False)
