"""Vision-language samples in packed rows: mRoPE positions, image spans, pixel batches.

:func:`pack_multimodal` packs what a model's processor returns for single samples (token ids,
labels, the model's own image tensors) into rows of ``max_len`` tokens that the model runs as
``model(**row)`` with ``attn_implementation=flexpack.integrations.transformers.register()``;
every sample of a row then gets the logits it gets alone. A row (B = 1, S = ``max_len``) holds:

==========================  ==================  ===============================================
key                         shape, dtype        meaning
==========================  ==================  ===============================================
``input_ids``               (1, S) int64        the samples back to back; the pad id after them
``labels``                  (1, S) int64        the sample's labels (default: its ids, -100 on
                                                image tokens); -100 on each sample's first token
                                                and on padding
``doc_ids``                 (1, S) int32        sample of each token within the row, -1 padding
``position_ids``            (3, 1, S) int64     the model's own mRoPE positions (Qwen2-VL,
                                                Qwen2.5-VL), computed per sample by its
                                                ``get_rope_index``; (1, S) for 1-D RoPE (Gemma 3)
``mm_token_type_ids``       (1, S) int64        Qwen2-VL family: 0 text, 1 image, 2 video
``token_type_ids``          (1, S) int64        Gemma 3: 1 on image tokens
``image_span_ids``          (1, S) int32        Gemma 3: image of each token in the row, -1 for
                                                text; one image's tokens attend both ways
``pixel_values``, ...       the model's own     the row's images in row order: ``pixel_values``
                                                and ``image_grid_thw`` (Qwen2-VL family; videos:
                                                ``pixel_values_videos``, ``video_grid_thw``,
                                                ``second_per_grid_ts``), ``pixel_values``
                                                (n_images, C, H, W) for Gemma 3
``sample_ids``              (1, S) int64        index in ``samples`` of each token, -1 padding;
                                                pop it before the call
==========================  ==================  ===============================================

The text decoder reads ``doc_ids`` (never the 3-D positions, which carry no boundary); the vision
tower keeps its own per-image attention (flexpack's attention function hands its calls to
transformers' ``sdpa``, see :func:`_vision_call`); Gemma 3's image tokens attend each other both
ways inside their own image and sample, within the sliding window on sliding layers
(``document & (causal | same image) & window``). :func:`collate_multimodal` stacks rows into
(B, S) batches, e.g. as a ``Trainer``'s ``data_collator``. transformers is imported lazily.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexpack._choices import OVERFLOWS
from flexpack._tensor_cache import PerThread, all_match, stamps
from flexpack.integrations._mixers_check import has_attention
from flexpack.packing import DocsPerRow, PackStats, pack

__all__ = ["MultimodalRows", "collate_multimodal", "pack_multimodal"]

IGNORE_INDEX = -100
_STRATEGIES = ("bfd", "ffd", "greedy")  # "wrap" cuts samples anywhere: not inside an image
# Per-token keys of a row (stacked along the batch dimension by collate_multimodal).
_TOKEN_KEYS = (
    "input_ids",
    "labels",
    "doc_ids",
    "sample_ids",
    "mm_token_type_ids",
    "token_type_ids",
    "image_span_ids",
)


# ----------------------------------------------------------------------------- model families


@dataclass(frozen=True)
class _Visual:
    """One kind of visual input (images, videos) of a model family."""

    type_id: int  # its value in the token-type ids
    token_id: int  # its placeholder token in input_ids
    pixel_key: str  # pixel tensor, rows per item from the grid (or one row per item)
    item_keys: tuple[str, ...]  # tensors with one row per item (grids, timings), in order
    grid_key: str | None  # (n, 3) grid giving tokens and pixel rows per item; None: fixed
    tokens: int  # tokens per item when grid_key is None


@dataclass(frozen=True)
class _Family:
    name: str
    type_key: str  # "mm_token_type_ids" (Qwen2-VL family) or "token_type_ids" (Gemma 3)
    visuals: tuple[_Visual, ...]
    rope_index: Callable[..., Any] | None  # the model's get_rope_index; None: 1-D positions
    merge: int  # spatial merge: tokens per item = prod(grid) // merge**2
    bidirectional_images: bool  # image tokens attend each other both ways (Gemma 3)


_MROPE = ("qwen2_vl", "qwen2_5_vl")


def _runs_flexpack_attention(model: Any) -> bool | None:
    """Whether ``model``'s text layers run flexpack attention; None when flexpack cannot tell
    (no transformers config)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    impl = getattr(text, "_attn_implementation", None)
    if not isinstance(impl, str):
        return None
    from transformers import AttentionInterface

    fn = getattr(AttentionInterface, "_global_mapping", {}).get(impl)  # no "eager" in it
    return getattr(fn, "__name__", "") == "flexpack_attention_forward"


def warn_without_flexpack_attention(model: Any, what: str) -> None:
    """Warn when packed rows are made for, or fed to, a model whose attention ignores doc_ids:
    its documents would attend to each other (0.52 off on Qwen2-VL, silently). A model without
    attention (RWKV, Mamba, xLSTM: its recurrent mixers read the doc_ids) has none to warn of."""
    if _runs_flexpack_attention(model) is not False:
        return
    if isinstance(model, torch.nn.Module) and not has_attention(model):
        return
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    impl = text._attn_implementation
    warnings.warn(
        f"{what}: this {type(model).__name__} runs attn_implementation={impl!r}, which ignores "
        "the packed rows' doc_ids: their documents would attend to each other. Load it with "
        "attn_implementation=flexpack.integrations.transformers.register(), or switch this "
        "instance with model.set_attn_implementation(register()) before training on the rows.",
        UserWarning,
        stacklevel=3,
    )


def _family(model: Any) -> _Family:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in _MROPE:
        rope = next(
            (
                m.get_rope_index
                for m in model.modules()
                if callable(getattr(m, "get_rope_index", 0))
            ),
            None,
        )
        if rope is None:
            raise TypeError(
                f"pack_multimodal needs the model's get_rope_index for {model_type}; got a "
                f"{type(model).__name__} without one. Pass the model itself (e.g. "
                "Qwen2VLForConditionalGeneration), not its text or vision part."
            )
        image = _Visual(1, config.image_token_id, "pixel_values", ("image_grid_thw",),
                        "image_grid_thw", 0)  # fmt: skip
        video = _Visual(2, config.video_token_id, "pixel_values_videos",
                        ("video_grid_thw", "second_per_grid_ts"), "video_grid_thw", 0)  # fmt: skip
        return _Family(
            model_type,
            "mm_token_type_ids",
            (image, video),
            rope,
            int(config.vision_config.spatial_merge_size),
            False,
        )
    if model_type == "gemma3":
        token = getattr(config, "image_token_id", None)
        token = config.image_token_index if token is None else token
        image = _Visual(1, int(token), "pixel_values", (), None, int(config.mm_tokens_per_image))
        return _Family("gemma3", "token_type_ids", (image,), None, 1, True)
    raise ValueError(
        f"pack_multimodal knows Qwen2-VL, Qwen2.5-VL (mRoPE) and Gemma 3 models; got "
        f"{type(model).__name__} with model_type={model_type!r}. Pass one of those models (the "
        "ForConditionalGeneration class); for text-only models use flexpack.pack_sequences."
    )


# ----------------------------------------------------------------------------- samples


@dataclass(frozen=True)
class _Item:
    """One image or video of a sample: its token span and its rows in the sample's tensors."""

    kind: int  # index into _Family.visuals
    index: int  # its number among the sample's items of that kind
    start: int  # token span [start, stop) in the sample
    stop: int
    pixel_start: int  # rows [pixel_start, pixel_stop) of the kind's pixel tensor
    pixel_stop: int


@dataclass(frozen=True)
class _Sample:
    ids: Tensor  # (L,) int64
    labels: Tensor  # (L,) int64: given labels, or ids with -100 on visual tokens
    types: Tensor  # (L,) int64 token types
    items: tuple[_Item, ...]  # in token order
    tensors: dict[str, Tensor]  # the sample's visual tensors by key


@dataclass(frozen=True)
class _Piece:
    """Tokens [start, stop) of one sample: one document of a row."""

    sample: int
    start: int
    stop: int
    items: tuple[_Item, ...]

    @property
    def length(self) -> int:
        return self.stop - self.start


def _tokens(x: Any, what: str) -> Tensor:
    """(L,) int64 from a list, an array, an (L,) or a processor's (1, L) tensor."""
    t = x if isinstance(x, Tensor) else torch.as_tensor(x)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(
            f"{what} must be integer token ids of shape (L,) or (1, L) (one sample, as a "
            f"processor returns it); got {t.dtype} of shape {tuple(t.shape)}."
        )
    return t.to(torch.int64)


def _parse(sample: Any, i: int, family: _Family) -> _Sample:
    if not isinstance(sample, Mapping) or "input_ids" not in sample:
        got = sorted(sample)[:8] if isinstance(sample, Mapping) else type(sample).__name__
        raise TypeError(
            f"samples[{i}] must be a dict of what the processor returns for one sample, with "
            f"'input_ids'; got {got}."
        )
    known = {"input_ids", "labels", "attention_mask", family.type_key}
    known |= {k for v in family.visuals for k in (v.pixel_key, *v.item_keys)}
    unknown = sorted(set(sample) - known)
    if unknown:
        raise ValueError(
            f"samples[{i}] has keys {unknown} that pack_multimodal does not know for "
            f"{family.name} (it knows {sorted(known)}); they would be lost. Drop them from the "
            "sample, or pack them yourself."
        )
    ids = _tokens(sample["input_ids"], f"samples[{i}]['input_ids']")
    L = ids.shape[0]
    mask = sample.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ValueError(
            f"samples[{i}] has padding (attention_mask has zeros): pass one unpadded sample per "
            "dict (the processor called on one sample, padding=False)."
        )
    types = sample.get(family.type_key)
    if types is None:  # text-only samples, or a processor that left them out: from the ids
        types = torch.zeros(L, dtype=torch.int64)
        for v in family.visuals:
            types[ids == v.token_id] = v.type_id
    else:
        types = _tokens(types, f"samples[{i}][{family.type_key!r}]")
        if types.shape[0] != L:
            raise ValueError(
                f"samples[{i}] has {L} input_ids but {types.shape[0]} {family.type_key}; they "
                "must have the same length (pass what the processor returned for this sample)."
            )
    items: list[_Item] = []
    tensors: dict[str, Tensor] = {}
    for k, v in enumerate(family.visuals):
        at = torch.nonzero(types == v.type_id).flatten()
        pixels = sample.get(v.pixel_key)
        if pixels is None:
            if at.numel():
                raise ValueError(
                    f"samples[{i}] has {at.numel()} tokens of type {v.type_id} "
                    f"({family.type_key}) but no {v.pixel_key!r}; pass the processor's "
                    f"{v.pixel_key} with the sample."
                )
            continue
        pixels = torch.as_tensor(pixels)
        if v.grid_key is None:  # Gemma 3: one pixel row, a fixed number of tokens per image
            if pixels.dim() == 3:
                pixels = pixels[None]
            n = pixels.shape[0]
            per_item, rows = [v.tokens] * n, [1] * n
        else:
            grid = sample.get(v.grid_key)
            if grid is None:
                raise ValueError(
                    f"samples[{i}] has {v.pixel_key!r} but no {v.grid_key!r}; pass the "
                    f"processor's {v.grid_key} with the sample."
                )
            grid = torch.as_tensor(grid).reshape(-1, 3).to(torch.int64)
            tensors[v.grid_key] = grid
            rows = grid.prod(-1).tolist()
            per_item = [r // family.merge**2 for r in rows]
            if pixels.shape[0] != sum(rows):
                raise ValueError(
                    f"samples[{i}]: {v.pixel_key} has {pixels.shape[0]} rows but "
                    f"{v.grid_key} {grid.tolist()} gives {sum(rows)} patches."
                )
        tensors[v.pixel_key] = pixels
        for key in v.item_keys:
            if key != v.grid_key and sample.get(key) is not None:
                tensors[key] = torch.as_tensor(sample[key]).reshape(-1)
        if sum(per_item) != at.numel():
            raise ValueError(
                f"samples[{i}] has {at.numel()} tokens of type {v.type_id} ({family.type_key}) "
                f"but its {v.pixel_key} make {sum(per_item)} ({per_item} per item); the "
                "placeholders and the pixels must come from one processor call."
            )
        offset, pixel = 0, 0
        for j, (n, r) in enumerate(zip(per_item, rows, strict=True)):
            start, stop = int(at[offset]), int(at[offset + n - 1]) + 1
            if stop - start != n:
                raise ValueError(
                    f"samples[{i}]: item {j} of {v.pixel_key} should fill {n} consecutive "
                    f"placeholder tokens, but they are spread over positions {start}..{stop - 1}."
                )
            items.append(_Item(k, j, start, stop, pixel, pixel + r))
            offset, pixel = offset + n, pixel + r
    labels = sample.get("labels")
    if labels is None:  # the ids themselves, no loss on the image placeholders
        labels = torch.where(types == 0, ids, IGNORE_INDEX)
    else:
        labels = _tokens(labels, f"samples[{i}]['labels']")
        if labels.shape[0] != L:
            raise ValueError(
                f"samples[{i}] has {L} input_ids but {labels.shape[0]} labels; they must have "
                "the same length."
            )
    items.sort(key=lambda it: it.start)
    return _Sample(ids, labels, types, tuple(items), tensors)


def _pieces(
    s: _Sample, i: int, max_len: int, overflow: str
) -> tuple[list[_Piece], int]:  # (pieces, tokens left out)
    """The sample as documents of at most max_len tokens, never cut inside an image span."""
    L = s.ids.shape[0]
    if L <= max_len:
        return ([_Piece(i, 0, L, s.items)] if L else []), 0
    if overflow == "drop":
        return [], L

    def cut(start: int) -> int:  # the last cut point <= start + max_len outside every span
        c = start + max_len
        for it in s.items:
            if it.start < c < it.stop:
                return it.start
        return c

    def inside(a: int, b: int) -> tuple[_Item, ...]:
        return tuple(it for it in s.items if a <= it.start and it.stop <= b)

    if overflow == "truncate":
        c = cut(0)
        return ([_Piece(i, 0, c, inside(0, c))] if c else []), L - c
    pieces, start = [], 0  # split
    while start < L:
        c = min(cut(start), L)
        if c == start:
            it = next(it for it in s.items if it.start == start)
            raise ValueError(
                f"samples[{i}] holds an image span of {it.stop - it.start} tokens, longer than "
                f"max_len={max_len}, and overflow='split' never cuts inside an image; raise "
                "max_len or pass overflow='truncate' or 'drop'."
            )
        pieces.append(_Piece(i, start, c, inside(start, c)))
        start = c
    return pieces, 0


def _positions(piece: _Piece, s: _Sample, family: _Family) -> Tensor:
    """(3, L) mRoPE positions of the piece alone (the model's get_rope_index), or (1, L)."""
    n = piece.length
    plain = torch.arange(n, dtype=torch.int64)
    if family.rope_index is None:
        return plain[None]
    if not piece.items:  # text only: the model's own default, arange on all three axes
        return plain[None].expand(3, n).clone()
    kwargs: dict[str, Any] = {}
    for k, v in enumerate(family.visuals):
        mine = [it.index for it in piece.items if it.kind == k]
        if not mine:
            continue
        for key in v.item_keys:
            if key in s.tensors:
                kwargs[key] = s.tensors[key][mine]
    accepted = inspect.signature(family.rope_index).parameters
    kwargs = {k: t for k, t in kwargs.items() if k in accepted}
    ids = s.ids[piece.start : piece.stop][None]
    types = s.types[piece.start : piece.stop][None]
    positions, _ = family.rope_index(ids, mm_token_type_ids=types, **kwargs)
    return positions[:, 0].to(torch.int64)  # (3, L)


# ----------------------------------------------------------------------------- rows


class MultimodalRows(list):
    """The rows of :func:`pack_multimodal`: a list of row dicts, with ``stats``.

    Attributes:
        stats: :class:`flexpack.PackStats` over the samples given: ``truncated`` / ``dropped``
            count the tokens (image placeholders included) the overflow policy left out,
            ``split_samples`` the samples cut into several documents.
    """

    def __init__(self, rows: list[dict[str, Tensor]], stats: PackStats) -> None:
        super().__init__(rows)
        self.stats = stats


def pack_multimodal(
    samples: Sequence[Mapping[str, Any]],
    max_len: int,
    *,
    model: Any,
    strategy: str = "bfd",
    overflow: str = "error",
    seed: int | None = 0,
    pad_id: int | None = None,
) -> MultimodalRows:
    """Pack vision-language samples into rows of ``max_len`` tokens, one ``model(**row)`` each.

    Args:
        samples: one dict per sample, what the model's processor returns for it (tensors of
            shape (1, L) or (L,), or lists): ``input_ids``, optional ``labels`` (e.g. -100 on
            the prompt; default the ids with -100 on image tokens), and the model's image keys:
            ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids`` (and the video keys) for
            Qwen2-VL / Qwen2.5-VL; ``pixel_values`` (n_images, C, H, W), ``token_type_ids`` for
            Gemma 3. Text-only samples need ``input_ids`` only.
        max_len: S, tokens per row.
        model: the model the rows are for (it gives the image token ids, the merge size and the
            mRoPE function ``get_rope_index``); it is only read.
        strategy: ``"bfd"``, ``"ffd"`` or ``"greedy"`` (:func:`flexpack.pack`; ``"wrap"`` would
            cut inside images).
        overflow: samples longer than ``max_len``: ``"error"``, ``"split"`` (documents of at
            most ``max_len`` tokens, each with its own positions), ``"truncate"`` or
            ``"drop"``. Cuts fall only between image spans: a truncated sample loses the whole
            image that would straddle the cut (and its pixels); what is left out is counted in
            ``stats``.
        seed: shuffles the rows of ``"bfd"``/``"ffd"``; ``None`` keeps the packer's order.
        pad_id: token id on padding; default the model's ``pad_token_id``, else 0.

    Returns:
        :class:`MultimodalRows`, a list of row dicts (keys and shapes in the module docstring)
        with ``.stats``. Pop ``sample_ids`` before ``model(**row)``, or stack rows with
        :func:`collate_multimodal`, which leaves it out.

    Raises:
        TypeError: a sample is not a dict with integer ``input_ids``.
        ValueError: a model family it does not know, an unknown strategy or overflow, samples
            longer than ``max_len`` with ``overflow="error"``, an image span longer than
            ``max_len`` with ``"split"``, image placeholders that do not match the pixels, or a
            ``pad_id`` equal to an image token.

    Example:
        >>> import torch, transformers
        >>> from flexpack.integrations.transformers import pack_multimodal, register
        >>> model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        ...     text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        ...         head_dim=8),
        ...     vision_config=dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        ...         num_attention_heads=2, image_size=4, patch_size=2),
        ...     mm_tokens_per_image=1, image_token_index=60, attn_implementation=register()))
        >>> photo = {"input_ids": [[5, 60, 6, 7]], "token_type_ids": [[0, 1, 0, 0]],
        ...          "pixel_values": torch.randn(1, 3, 4, 4)}
        >>> rows = pack_multimodal([photo, {"input_ids": [8, 9]}], 8, model=model)
        >>> row = rows[0]
        >>> row["doc_ids"]
        tensor([[ 0,  0,  0,  0,  1,  1, -1, -1]], dtype=torch.int32)
        >>> row["image_span_ids"], row["pixel_values"].shape
        (tensor([[-1,  0, -1, -1, -1, -1, -1, -1]], dtype=torch.int32), torch.Size([1, 3, 4, 4]))
        >>> row["labels"]
        tensor([[-100, -100,    6,    7, -100,    9, -100, -100]])
        >>> logits = model(**{k: v for k, v in row.items() if k != "sample_ids"}).logits
    """
    if strategy not in _STRATEGIES:
        raise ValueError(
            f"pack_multimodal takes strategy 'bfd', 'ffd' or 'greedy'; got {strategy!r} ('wrap' "
            "cuts samples at row ends, which would cut inside images)."
        )
    if overflow not in OVERFLOWS:
        raise ValueError(f"unknown overflow {overflow!r}; choose one of {', '.join(OVERFLOWS)}")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be an int >= 1 (tokens per row); got {max_len!r}")
    if isinstance(samples, Mapping) or not isinstance(samples, Sequence):
        raise TypeError(
            f"samples must be a sequence of per-sample dicts; got {type(samples).__name__}. "
            "Wrap one sample in a list, or an iterator in list(...)."
        )
    family = _family(model)
    warn_without_flexpack_attention(model, "pack_multimodal")
    pad_id = _pad_id(model, pad_id, family)
    parsed = [_parse(s, i, family) for i, s in enumerate(samples)]
    lengths = [s.ids.shape[0] for s in parsed]
    if overflow == "error" and any(n > max_len for n in lengths):
        long = [i for i, n in enumerate(lengths) if n > max_len]
        raise ValueError(
            f"{len(long)} of {len(parsed)} samples are longer than max_len={max_len} (longest "
            f"{max(lengths)} tokens, first at index {long[0]}). Pass overflow='split' (documents "
            "of at most max_len tokens, cut between images), 'truncate' or 'drop', or raise "
            "max_len."
        )
    pieces: list[_Piece] = []
    left_out = [0] * len(parsed)
    for i, s in enumerate(parsed):
        mine, left_out[i] = _pieces(s, i, max_len, overflow)
        pieces.extend(mine)
    plan = pack([p.length for p in pieces], max_len, strategy=strategy, seed=seed)
    rows = [
        _row([pieces[int(j)] for j in plan.segments[a:b, 1]], parsed, family, max_len, pad_id)
        for a, b in zip(plan.row_offsets[:-1], plan.row_offsets[1:], strict=True)
    ]
    tokens, placed = sum(lengths), sum(p.length for p in pieces)
    long = sum(n > max_len for n in lengths)
    stats = PackStats(
        samples=len(parsed),
        tokens=tokens,
        placed=placed,
        truncated=tokens - placed if overflow == "truncate" else 0,
        dropped=tokens - placed if overflow == "drop" else 0,
        truncated_samples=long if overflow == "truncate" else 0,
        dropped_samples=long if overflow == "drop" else 0,
        split_samples=long if overflow == "split" else 0,
        rows=plan.num_rows,
        max_len=max_len,
        lower_bound_rows=-(-placed // max_len),
        docs_per_row=DocsPerRow(
            plan.stats.docs_per_row.min, plan.stats.docs_per_row.mean, plan.stats.docs_per_row.max
        ),
    )
    return MultimodalRows(rows, stats)


def _pad_id(model: Any, pad_id: int | None, family: _Family) -> int:
    if pad_id is None:
        config = model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        pad_id = getattr(text, "pad_token_id", None)
        pad_id = getattr(config, "pad_token_id", None) if pad_id is None else pad_id
        pad_id = 0 if pad_id is None else pad_id
    if isinstance(pad_id, bool) or not isinstance(pad_id, int):
        raise TypeError(f"pad_id must be an int token id; got {pad_id!r}")
    visual = {v.token_id for v in family.visuals}
    if pad_id in visual:
        raise ValueError(
            f"pad_id={pad_id} is an image/video placeholder token of this model (the model "
            "would look for pixels for every padding token); pass another pad_id, e.g. 0."
        )
    return pad_id


def _row(
    pieces: list[_Piece], parsed: list[_Sample], family: _Family, S: int, pad_id: int
) -> dict[str, Tensor]:
    """One packed row (B = 1) from its documents, in row order."""
    used = sum(p.length for p in pieces)
    pad = S - used

    def cat(parts: list[Tensor], fill: int, dtype: torch.dtype) -> Tensor:
        parts = [*parts, torch.full((pad,), fill, dtype=dtype)]
        return torch.cat([p.to(dtype) for p in parts])[None]

    ids, labels, types, docs, owners, spans, positions = [], [], [], [], [], [], []
    visuals: dict[str, list[Tensor]] = {}
    span = 0
    for d, p in enumerate(pieces):
        s = parsed[p.sample]
        n = p.length
        ids.append(s.ids[p.start : p.stop])
        lab = s.labels[p.start : p.stop].clone()
        lab[0] = IGNORE_INDEX  # it would be predicted from the previous document
        labels.append(lab)
        types.append(s.types[p.start : p.stop])
        docs.append(torch.full((n,), d, dtype=torch.int32))
        owners.append(torch.full((n,), p.sample, dtype=torch.int64))
        positions.append(_positions(p, s, family))
        ids_of_span = torch.full((n,), -1, dtype=torch.int32)
        for it in p.items:
            ids_of_span[it.start - p.start : it.stop - p.start] = span
            span += 1
            v = family.visuals[it.kind]
            visuals.setdefault(v.pixel_key, []).append(
                s.tensors[v.pixel_key][it.pixel_start : it.pixel_stop]
            )
            for key in v.item_keys:
                if key in s.tensors:
                    visuals.setdefault(key, []).append(s.tensors[key][it.index : it.index + 1])
        spans.append(ids_of_span)
    row = {
        "input_ids": cat(ids, pad_id, torch.int64),
        "labels": cat(labels, IGNORE_INDEX, torch.int64),
        "doc_ids": cat(docs, -1, torch.int32),
        "sample_ids": cat(owners, -1, torch.int64),
        family.type_key: cat(types, 0, torch.int64),
    }
    rank = 3 if family.rope_index is not None else 1
    positions.append(torch.zeros(rank, pad, dtype=torch.int64))
    flat = torch.cat(positions, dim=1)  # (rank, S)
    row["position_ids"] = flat[:, None] if rank == 3 else flat  # (3, 1, S) or (1, S)
    if family.bidirectional_images:
        row["image_span_ids"] = cat(spans, -1, torch.int32)
    for key, parts in visuals.items():
        row[key] = torch.cat(parts)
    return row


def collate_multimodal(
    rows: Sequence[Mapping[str, Tensor]], *, sample_ids: bool = False
) -> dict[str, Tensor]:
    """Stack rows of :func:`pack_multimodal` into one (B, S) batch for ``model(**batch)``.

    Per-token tensors are stacked along the batch dimension (``position_ids`` (3, 1, S) along
    its second); image tensors (``pixel_values``, ``image_grid_thw``, ...) are concatenated in
    row order, the order in which the model fills the image placeholders of a batch. Usable
    as a ``Trainer``'s ``data_collator``.

    Args:
        rows: row dicts of one :func:`pack_multimodal` call (same ``max_len``), as tensors or
            as the lists a ``datasets.Dataset`` of them returns (None for absent images).
        sample_ids: keep ``sample_ids`` (B, S) in the batch (default: left out, as the model
            call needs).

    Returns:
        ``{"input_ids": (B, S), "labels": (B, S), "doc_ids": (B, S), "position_ids":
        (3, B, S) or (B, S), ...}``.

    Raises:
        ValueError: no rows, or rows of different lengths or keys.

    Example:
        >>> import torch
        >>> row = {"input_ids": torch.ones(1, 4, dtype=torch.long),
        ...        "position_ids": torch.zeros(3, 1, 4, dtype=torch.long),
        ...        "sample_ids": torch.zeros(1, 4, dtype=torch.long)}
        >>> batch = collate_multimodal([row, row])
        >>> batch["input_ids"].shape, batch["position_ids"].shape, "sample_ids" in batch
        (torch.Size([2, 4]), torch.Size([3, 2, 4]), False)
    """
    if not rows:
        raise ValueError("collate_multimodal got no rows; pass a non-empty list of row dicts.")
    # Rows read back from a datasets.Dataset come as lists, with None for a row's absent images.
    rows = [{k: _as_tensor(k, v) for k, v in r.items() if v is not None} for r in rows]
    first = rows[0]
    S = first["input_ids"].shape[-1]
    token_keys = [k for k in _TOKEN_KEYS if k in first and (sample_ids or k != "sample_ids")]
    for j, r in enumerate(rows):
        missing = [k for k in token_keys if k not in r]
        if r["input_ids"].shape[-1] != S or missing:
            raise ValueError(
                f"rows[{j}] does not match rows[0] (length {r['input_ids'].shape[-1]} vs {S}, "
                f"missing {missing}); collate rows of one pack_multimodal call."
            )
    batch = {k: torch.cat([r[k] for r in rows]) for k in token_keys}
    if "position_ids" in first:
        dim = 1 if first["position_ids"].dim() == 3 else 0
        batch["position_ids"] = torch.cat([r["position_ids"] for r in rows], dim=dim)
    images = dict.fromkeys(k for r in rows for k in r if k not in _TOKEN_KEYS)  # ordered
    for k in images:
        if k != "position_ids":
            batch[k] = torch.cat([r[k] for r in rows if k in r])
    return batch


def _as_tensor(key: str, value: Any) -> Tensor:
    if isinstance(value, Tensor):
        return value
    t = torch.as_tensor(value)
    return t.to(torch.int32) if key in ("doc_ids", "image_span_ids") else t


# ----------------------------------------------------------------------------- attention


def _vision_call(module: torch.nn.Module, query: Tensor, kwargs: Mapping[str, Any]) -> bool:
    """Whether this attention call comes from a vision tower (its own per-image sequences).

    Vision towers call the model's attention function too (Qwen2-VL's once per image, with the
    text's keywords, ``doc_ids`` included, passed along; SigLIP's once per image batch), and the
    text's documents mean nothing there. A call is a vision call when its module's config is a
    vision config (``base_config_key == "vision_config"``, as transformers' sub-configs say), or,
    for other towers, when it is non-causal and its length disagrees with the row's doc ids.
    """
    config = getattr(module, "config", None)
    if getattr(config, "base_config_key", None) == "vision_config":
        return True
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if is_causal:
        return False
    ids = kwargs.get("doc_ids")
    ids = kwargs.get("seq_idx") if ids is None else ids
    return isinstance(ids, Tensor) and ids.shape[-1] != query.shape[2]


def _vision_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    scaling: float | None,
    dropout: float,
    kwargs: Mapping[str, Any],
) -> tuple[Tensor, None]:
    """A vision tower's call, run as transformers' ``sdpa`` runs it (its own mask, dropout and
    all); the text's ``doc_ids`` / ``position_ids`` / ``seq_idx`` are not read. A flash-style
    call with ``cu_seq_lens_q`` (B = 1, its images back to back) gets one block per image."""
    cu = kwargs.get("cu_seq_lens_q")
    own = {k: v for k, v in kwargs.items() if k not in ("doc_ids", "seq_idx", "position_ids")}
    if cu is not None:
        from flexpack import masks
        from flexpack.attention import attention

        S = query.shape[2]
        lengths = torch.diff(cu.to(device=query.device, dtype=torch.int64))
        if query.shape[0] != 1 or int(lengths.sum()) != S:
            raise ValueError(
                f"a vision call with cu_seq_lens_q {cu.tolist()} must cover its {S} tokens in "
                f"one row; got query of shape {tuple(query.shape)}."
            )
        ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=query.device), lengths)
        mask = masks.document(ids[None])
        if own.get("is_causal", getattr(module, "is_causal", False)):
            mask = mask & masks.causal()
        out = attention(query, key, value, mask, scale=scaling,
                        enable_gqa=key.shape[1] != query.shape[1])  # fmt: skip
        return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    own.pop("is_causal", None)
    is_causal = kwargs.get("is_causal")
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
        is_causal=False if is_causal is None else is_causal, **own,
    )  # fmt: skip


_span_caches = PerThread()  # one per thread, as flexpack.integrations.transformers' mask cache


def _image_span_mask(
    device: torch.device,
    B: int,
    S: int,
    padding: Tensor | None,
    kwargs: Mapping[str, Any],
    is_causal: bool,
):
    """Gemma 3's text mask on packed rows: ``document & (causal | same image) [& window]``.

    Built once per forward and (causal, window) for all layers, as the plain document masks."""
    from flexpack import masks

    doc_ids, spans = kwargs.get("doc_ids"), kwargs["image_span_ids"]
    window = kwargs.get("sliding_window")
    for name, t in (("doc_ids", doc_ids), ("image_span_ids", spans)):
        if not isinstance(t, Tensor) or tuple(t.shape) not in ((B, S), (1, S)):
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(
                f"image_span_ids rows need doc_ids and image_span_ids of shape (B, S) = {(B, S)}"
                f" (pack_multimodal rows carry both); got {name} {got}."
            )
    sources = (padding, doc_ids, spans)
    key = (device, B, S)  # and stamps of the sources (flexpack._tensor_cache)
    _span_cache = _span_caches.get()
    if _span_cache.get("key") != key or not all_match(_span_cache.get("sources"), sources):
        d = doc_ids.to(device=device, dtype=torch.int32).expand(B, S)
        if padding is not None:
            d = torch.where(padding[:, -S:].to(device=device, dtype=torch.bool), d, -1)
        sp = torch.where(d >= 0, spans.to(device=device, dtype=torch.int32).expand(B, S), -1)
        _span_cache.clear()
        _span_cache.update(
            key=key, sources=stamps(sources), ids=(d.contiguous(), sp.contiguous()), masks={}
        )
    built = _span_cache["masks"]
    if (is_causal, window) not in built:
        d, sp = _span_cache["ids"]
        mask = masks.document(d)
        if is_causal:
            mask = mask & (masks.causal() | masks.document(sp))
        if window is not None:
            if not is_causal:
                raise ValueError(
                    f"flexpack attention got a sliding window ({window}) on a non-causal layer; "
                    "only causal sliding windows are supported."
                )
            # transformers keeps kv_idx > q_idx - window: q - kv <= window - 1, future keys in
            # the same image included (Gemma 3's AND(sliding_window, OR(causal, image)))
            mask = mask & masks.sliding_window(int(window) - 1)
        built[(is_causal, window)] = mask
    return built[(is_causal, window)]
