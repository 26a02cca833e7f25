"""pack_multimodal and the VLM forward contract, on tiny random Qwen2-VL, Qwen2.5-VL and Gemma 3.

Reference: every sample run alone, as its processor output, through the same weights under
transformers' own ``sdpa`` (the model computes its own mRoPE positions and Gemma 3 its own
bidirectional image mask). Negative controls: the same rows without ``doc_ids`` (naive
concatenation) and, for Gemma 3, without the image spans, leak far past the tolerance.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from _rows import documents
from hypothesis import given
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from flexpack.integrations import multimodal  # noqa: E402
from flexpack.integrations.transformers import (  # noqa: E402
    collate_multimodal,
    flexpack_attention_forward,
    pack_multimodal,
    register,
)

FP32 = 1e-4
IMAGE, VIDEO, START, END = 100, 101, 102, 103  # Qwen placeholder / marker tokens
G_IMAGE, G_BOI, G_EOI = 100, 101, 102  # Gemma 3
ROPE = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}


def tiny_qwen(attn: str, family: str = "qwen2_vl", seed: int = 0):
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rope_parameters=ROPE,
                pad_token_id=0)  # fmt: skip
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
               vision_end_token_id=END, attn_implementation=attn)  # fmt: skip
    if family == "qwen2_vl":
        vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=2,
                      spatial_merge_size=2, temporal_patch_size=1, mlp_ratio=2)  # fmt: skip
        config, cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    else:  # windowed vision attention: one window per 4x4 patches, a full layer after it
        vision = dict(depth=2, hidden_size=16, intermediate_size=32, out_hidden_size=32,
                      num_heads=2, patch_size=2, spatial_merge_size=2, temporal_patch_size=1,
                      window_size=8, fullatt_block_indexes=[1])  # fmt: skip
        config = transformers.Qwen2_5_VLConfig
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    return cls(config(text_config=text, vision_config=vision, **ids)).eval()


def tiny_gemma3(attn: str, seed: int = 0):
    config = transformers.Gemma3Config(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, query_pre_attn_scalar=8, sliding_window=6,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=8, patch_size=2),
        mm_tokens_per_image=4, image_token_index=G_IMAGE, boi_token_index=G_BOI,
        eoi_token_index=G_EOI, attn_implementation=attn,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # initialised to zeros: images would not reach the text at all
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.5)
    return model


def words(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(1, 90, (n,), generator=g).tolist()


def qwen_sample(g, parts, *, prompt: int = 0) -> dict:
    """A processor-like sample: parts are ints (text words), ("image", t, h, w), ("video", ...)."""
    ids, types, s = [], [], {}
    for p in parts:
        if isinstance(p, int):
            ids += words(g, p)
            types += [0] * p
            continue
        kind, *grid = p
        n = grid[0] * grid[1] * grid[2]
        token, type_id = (IMAGE, 1) if kind == "image" else (VIDEO, 2)
        ids += [START] + [token] * (n // 4) + [END]
        types += [0] + [type_id] * (n // 4) + [0]
        px, gk = ("pixel_values", "image_grid_thw") if kind == "image" else (
            "pixel_values_videos", "video_grid_thw")  # fmt: skip
        s[px] = torch.cat([s.get(px, torch.zeros(0, 12)), torch.randn(n, 12, generator=g)])
        s[gk] = torch.cat([s.get(gk, torch.zeros(0, 3, dtype=torch.long)), torch.tensor([grid])])
    s["input_ids"] = torch.tensor([ids])
    s["mm_token_type_ids"] = torch.tensor([types])
    if prompt := min(prompt, len(ids)):
        s["labels"] = torch.tensor([[-100] * prompt + ids[prompt:]])
    return s


def gemma_sample(g, parts) -> dict:
    ids, types, pixels = [], [], []
    for p in parts:
        if p == "image":
            ids += [G_BOI] + [G_IMAGE] * 4 + [G_EOI]
            types += [0, 1, 1, 1, 1, 0]
            pixels.append(torch.randn(3, 8, 8, generator=g))
        else:
            ids += words(g, p)
            types += [0] * p
    s = {"input_ids": torch.tensor([ids]), "token_type_ids": torch.tensor([types])}
    if pixels:
        s["pixel_values"] = torch.stack(pixels)
    return s


def qwen_samples(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        qwen_sample(g, [3, ("image", 1, 4, 4), 5], prompt=4),
        qwen_sample(g, [6]),  # text only
        qwen_sample(g, [2, ("image", 1, 4, 8), 1, ("image", 1, 4, 4), 3]),
        qwen_sample(g, [1, ("video", 2, 4, 4), 9]),
        qwen_sample(g, [4, ("image", 1, 8, 4), 2]),
    ]


def gemma_samples(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        gemma_sample(g, [3, "image", 5]),
        gemma_sample(g, [6]),
        gemma_sample(g, [2, "image", "image", 3]),  # two images back to back
        gemma_sample(g, [9, "image", 2]),
        gemma_sample(g, ["image", 7]),
    ]


def alone(reference, sample: dict) -> torch.Tensor:
    """(L, V) logits of one sample run alone, as the processor returned it."""
    return reference(**{k: v for k, v in sample.items() if k != "labels"}).logits[0]


def per_sample(logits: torch.Tensor, sample_ids: torch.Tensor, i: int) -> torch.Tensor:
    return logits[sample_ids == i]


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss of (B, S) HF-style unshifted labels."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


def check_forward(model, reference, samples, batch, leaky_batches) -> None:
    """Logits of each sample in the packed batch = alone (fp32); the leaky batches are not."""
    sample_ids = batch.pop("sample_ids")
    packed = model(**batch).logits  # with grad: the SDPA paths that train on CPU
    worst = 0.0
    for i, s in enumerate(samples):
        worst = max(worst, (per_sample(packed, sample_ids, i) - alone(reference, s)).abs().max())
    assert worst < FP32
    for runner, leaky in leaky_batches:
        out = runner(**leaky).logits
        leak = max((per_sample(out, sample_ids, i) - alone(reference, s)).abs().max()
                   for i, s in enumerate(samples))  # fmt: skip
        assert leak > 100 * FP32


def check_gradients(model, reference, samples, batch) -> None:
    """One backward of the packed batch = the sum of the samples' backwards alone."""
    labels = batch["labels"]
    loss_sum(model(**batch).logits, labels).backward()
    total = 0.0
    for s in samples:
        types = s.get("mm_token_type_ids", s.get("token_type_ids"))
        lab = s.get("labels", torch.where(types == 0, s["input_ids"], -100))  # image tokens: -100
        total = total + loss_sum(alone(reference, s)[None], lab)
    total.backward()
    pairs = list(zip(model.parameters(), reference.parameters(), strict=True))
    assert sum(p.grad is not None for p, _ in pairs) > 10
    for p, q in pairs:
        if q.grad is not None:
            assert (p.grad - q.grad).abs().max() < FP32 * max(1.0, q.grad.abs().max())
    vision = [p for n, p in model.named_parameters() if "vis" in n and p.grad is not None]
    assert vision and any(p.grad.abs().max() > 0 for p in vision)  # the tower trains too


# ----------------------------------------------------------------------------- Qwen2-VL family


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_packed_rows_give_every_sample_its_logits_and_gradients_alone(family):
    model, reference = tiny_qwen(register(), family), tiny_qwen("sdpa", family)
    samples = qwen_samples()
    rows = pack_multimodal(samples, 48, model=model)
    assert len(rows) == 2 and rows.stats.placed == rows.stats.tokens
    row = rows[0]
    assert row["position_ids"].shape == (3, 1, 48) and row["doc_ids"].dtype == torch.int32
    batch = collate_multimodal(rows, sample_ids=True)  # B = 2, images of both rows in order
    assert batch["position_ids"].shape == (3, 2, 48)
    naive = {k: v for k, v in batch.items() if k not in ("doc_ids", "sample_ids")}
    check_forward(model, reference, samples, dict(batch), [(reference, naive)])
    batch.pop("sample_ids")
    check_gradients(model, reference, samples, batch)


def test_mrope_positions_are_the_models_own_per_sample():
    model = tiny_qwen(register())
    samples = qwen_samples()
    (row,) = pack_multimodal(samples[:3], 64, model=model, strategy="greedy")
    for i, s in enumerate(samples[:3]):
        want, _ = model.model.get_rope_index(
            s["input_ids"], s["mm_token_type_ids"], image_grid_thw=s.get("image_grid_thw")
        )
        assert torch.equal(row["position_ids"][:, 0, row["sample_ids"][0] == i], want[:, 0])
    grids = [samples[0]["image_grid_thw"], samples[2]["image_grid_thw"]]
    assert torch.equal(row["image_grid_thw"], torch.cat(grids))


# ----------------------------------------------------------------------------- Gemma 3


def test_gemma3_rows_keep_bidirectional_images_and_sliding_window_per_sample():
    model, reference = tiny_gemma3(register()), tiny_gemma3("sdpa")
    samples = gemma_samples()
    rows = pack_multimodal(samples, 40, model=model)
    assert len(rows) == 2
    batch = collate_multimodal(rows, sample_ids=True)
    assert batch["position_ids"].shape == (2, 40)
    spans = batch["image_span_ids"]
    assert spans.max() >= 2 and ((spans >= 0) == (batch["token_type_ids"] == 1)).all()
    naive = {k: v for k, v in batch.items() if k not in ("doc_ids", "sample_ids", "image_span_ids")}
    causal_images = {k: v for k, v in batch.items() if k not in ("sample_ids", "image_span_ids")}
    check_forward(
        model, reference, samples, dict(batch), [(reference, naive), (model, causal_images)]
    )
    batch.pop("sample_ids")
    check_gradients(model, reference, samples, batch)


def test_image_span_mask_is_document_and_causal_or_same_image_within_the_window():
    doc = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, -1]])
    span = torch.tensor([[-1, 0, 0, 0, -1, 1, 1, -1, -1]])
    kwargs = {"doc_ids": doc, "image_span_ids": span, "sliding_window": 2}
    mask = multimodal._image_span_mask(torch.device("cpu"), 1, 9, None, kwargs, True)
    q, kv = torch.meshgrid(torch.arange(9), torch.arange(9), indexing="ij")
    got = mask.mask_mod(torch.tensor(0), torch.tensor(0), q, kv)
    d, s = doc[0], span[0]
    want = (d[q] == d[kv]) & (d[q] >= 0) & ((kv <= q) | ((s[q] == s[kv]) & (s[q] >= 0)))
    assert torch.equal(got, want & (kv > q - 2))
    assert got[1, 3] and not got[3, 0] and not got[5, 4]  # ahead in an image; window; document


# ----------------------------------------------------------------------------- vision calls


class _VisionAttention(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config, self.is_causal, self.num_key_value_groups = config, False, 1


def test_vision_tower_calls_run_as_sdpa_and_never_read_the_text_doc_ids():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    vision = _VisionAttention(transformers.Qwen2VLVisionConfig())
    q, k, v = torch.randn(3, 1, 2, 20, 8).unbind(0)  # one image of 20 patches
    text = {"doc_ids": torch.zeros(1, 48, dtype=torch.int32), "position_ids": torch.zeros(1, 48)}
    got, _ = flexpack_attention_forward(vision, q, k, v, None, scaling=0.3, is_causal=False,
                                        **text)  # fmt: skip
    want, _ = sdpa_attention_forward(vision, q, k, v, None, scaling=0.3, is_causal=False)
    assert torch.equal(got, want)
    # A flash-style call (images back to back, cu_seq_lens_q): one block per image.
    cu = torch.tensor([0, 12, 20], dtype=torch.int32)
    got, _ = flexpack_attention_forward(vision, q, k, v, None, scaling=0.3, is_causal=False,
                                        cu_seq_lens_q=cu, cu_seq_lens_k=cu, **text)  # fmt: skip
    blocks = [sdpa_attention_forward(vision, *(t[:, :, a:b] for t in (q, k, v)), None,
                                     scaling=0.3, is_causal=False)[0]
              for a, b in ((0, 12), (12, 20))]  # fmt: skip
    assert (got - torch.cat(blocks, dim=1)).abs().max() < 1e-6
    # Towers without a vision config: a non-causal call whose length is not the row's.
    anon = _VisionAttention(None)
    assert multimodal._vision_call(anon, q, {"is_causal": False, **text})
    assert not multimodal._vision_call(anon, q, {"doc_ids": torch.zeros(1, 20)})  # an encoder
    text_layer = _VisionAttention(transformers.Qwen2VLTextConfig())
    text_layer.is_causal = True
    assert not multimodal._vision_call(text_layer, q, text)


# ----------------------------------------------------------------------------- overflow


def test_overflow_policies_never_cut_inside_an_image_and_count_what_they_leave_out():
    model = tiny_qwen(register())
    g = torch.Generator().manual_seed(5)
    long = qwen_sample(g, [5, ("image", 1, 4, 8), 6, ("image", 1, 4, 4), 3])  # 5+10+6+6+3
    short = qwen_sample(g, [4])
    with pytest.raises(ValueError, match=r"longer than max_len=12.*overflow='split'"):
        pack_multimodal([long, short], 12, model=model)

    rows = pack_multimodal([long, short], 12, model=model, overflow="truncate")
    assert rows.stats.truncated == 30 - 6 and rows.stats.truncated_samples == 1
    assert all("pixel_values" not in r for r in rows)  # the straddling image left with its pixels
    rows = pack_multimodal([long, short], 16, model=model, overflow="truncate")
    (kept,) = [r for r in rows if "pixel_values" in r]
    assert kept["image_grid_thw"].tolist() == [[1, 4, 8]] and kept["pixel_values"].shape[0] == 32
    assert rows.stats.truncated == 30 - 16

    rows = pack_multimodal([long, short], 12, model=model, overflow="drop")
    assert rows.stats.dropped == 30 and rows.stats.dropped_samples == 1 and len(rows) == 1

    rows = pack_multimodal([long, short], 12, model=model, overflow="split", strategy="greedy")
    assert rows.stats.split_samples == 1 and rows.stats.placed == 34
    batch = collate_multimodal(rows, sample_ids=True)
    pieces = [(r, a, b) for r, a, b in documents(batch["doc_ids"])
              if batch["sample_ids"][r, a] == 0]  # fmt: skip
    got = torch.cat([batch["input_ids"][r, a:b] for r, a, b in pieces])
    assert torch.equal(got, long["input_ids"][0])
    assert [b - a for _, a, b in pieces] == [6, 12, 12]  # cut before the image at 6, then 18
    with pytest.raises(ValueError, match=r"image span of 8 tokens.*max_len=6"):
        pack_multimodal([long], 6, model=model, overflow="split")

    # A split piece is a document of its own: it gets the logits it gets alone.
    reference = tiny_qwen("sdpa")
    sample_ids = batch.pop("sample_ids")
    with torch.no_grad():
        packed = model(**batch).logits
    for k, (r, a, b) in enumerate(pieces):
        ids = batch["input_ids"][r : r + 1, a:b]
        piece = {"input_ids": ids, "mm_token_type_ids": (ids == IMAGE).long()}
        if k:  # pieces 1 and 2 hold images 0 and 1 (32 and 16 patches)
            first, n = (0, 32) if k == 1 else (32, 16)
            piece["image_grid_thw"] = long["image_grid_thw"][k - 1 : k]
            piece["pixel_values"] = long["pixel_values"][first : first + n]
        with torch.no_grad():
            assert (packed[r, a:b] - alone(reference, piece)).abs().max() < FP32
    assert (sample_ids[batch["doc_ids"] >= 0] >= 0).all()


def test_bad_inputs_say_what_was_expected():
    model = tiny_qwen(register())
    g = torch.Generator().manual_seed(0)
    s = qwen_sample(g, [2, ("image", 1, 4, 4), 2])
    with pytest.raises(ValueError, match="strategy 'bfd', 'ffd' or 'greedy'"):
        pack_multimodal([s], 32, model=model, strategy="wrap")
    with pytest.raises(ValueError, match="placeholder token"):
        pack_multimodal([s], 32, model=model, pad_id=IMAGE)
    bad = dict(s, image_grid_thw=torch.tensor([[1, 4, 8]]))
    with pytest.raises(ValueError, match="pixel_values has 16 rows but image_grid_thw"):
        pack_multimodal([bad], 32, model=model)
    with pytest.raises(ValueError, match="no 'pixel_values'"):
        pack_multimodal([{k: v for k, v in s.items() if k != "pixel_values"}], 32, model=model)
    with pytest.raises(ValueError, match=r"keys \['image_sizes'\].*would be lost"):
        pack_multimodal([dict(s, image_sizes=[[8, 8]])], 32, model=model)
    padded = dict(s, attention_mask=torch.tensor([[1] * 7 + [0]]))
    with pytest.raises(ValueError, match="has padding"):
        pack_multimodal([padded], 32, model=model)
    with pytest.raises(TypeError, match="with 'input_ids'"):
        pack_multimodal([{"text": "hi"}], 32, model=model)
    with pytest.raises(ValueError, match="model_type='llama'"):
        pack_multimodal([s], 32, model=transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
            num_attention_heads=1)))  # fmt: skip
    with pytest.raises(ValueError, match="does not match rows"):
        collate_multimodal([pack_multimodal([s], 32, model=model)[0],
                            pack_multimodal([s], 16, model=model)[0]])  # fmt: skip


def test_pack_multimodal_warns_for_a_model_without_flexpack_attention():
    pytest.importorskip("transformers")
    import warnings

    from test_vlm import qwen_samples, tiny_qwen

    from flexpack.integrations.transformers import pack_multimodal, register

    with pytest.warns(UserWarning, match=r"attn_implementation='sdpa'.*register\(\)"):
        pack_multimodal(qwen_samples(), 48, model=tiny_qwen("sdpa"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pack_multimodal(qwen_samples(), 48, model=tiny_qwen(register()))


# ----------------------------------------------------------------------------- properties


@pytest.fixture(scope="module")
def qwen_model():
    return tiny_qwen(register())


@st.composite
def vlm_samples(draw):
    """Processor-like Qwen samples: text runs and images of 2x2 token grids or wider."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    out = []
    for _ in range(draw(st.integers(1, 6))):
        parts = []
        for _ in range(draw(st.integers(1, 4))):
            if draw(st.booleans()):
                parts.append(draw(st.integers(1, 9)))
            else:
                parts.append(("image", 1, 4, 4 * draw(st.integers(1, 2))))
        out.append(qwen_sample(g, parts, prompt=draw(st.integers(0, 2))))
    return out


def split(ids: torch.Tensor, max_len: int) -> list[tuple[int, ...]]:
    """Reference cuts: max_len tokens, moved back while they would fall between two image
    tokens (images sit between their start and end markers, so that is inside an image)."""
    out, start, L = [], 0, len(ids)
    while start < L:
        c = min(start + max_len, L)
        while c < L and ids[c - 1] == IMAGE and ids[c] == IMAGE:
            c -= 1
        out.append(tuple(ids[start:c].tolist()))
        start = c
    return out


@given(
    samples=vlm_samples(),
    max_len=st.integers(12, 40),
    overflow=st.sampled_from(["split", "truncate", "drop"]),
    strategy=st.sampled_from(["bfd", "ffd", "greedy"]),
)
def test_rows_hold_whole_images_their_pixels_and_every_token_accounted(
    qwen_model, samples, max_len, overflow, strategy
):
    rows = pack_multimodal(samples, max_len, model=qwen_model, strategy=strategy,
                           overflow=overflow)  # fmt: skip
    st_ = rows.stats
    assert st_.tokens == st_.placed + st_.truncated + st_.dropped
    kept: dict[int, list[torch.Tensor]] = {}
    for r in rows:
        ids, docs, owner = r["input_ids"][0], r["doc_ids"][0], r["sample_ids"][0]
        assert ids.shape == (max_len,) and ((docs < 0) == (owner < 0)).all()
        images = ids == IMAGE
        grids = r.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long))
        assert int(images.sum()) == int((grids.prod(-1) // 4).sum())
        assert r.get("pixel_values", torch.zeros(0, 12)).shape[0] == int(grids.prod(-1).sum())
        assert (r["labels"][0, docs < 0] == -100).all()
        runs: list[int] = []
        for d in range(int(docs.max()) + 1 if (docs >= 0).any() else 0):
            at = (docs == d).nonzero().flatten()
            assert r["labels"][0, at[0]] == -100  # boundary
            img = images[at].tolist()  # the document's image runs: whole images only
            runs += [
                n for n, prev in zip(itertools.accumulate(img, lambda c, x: c + 1 if x else 0),
                                     [*img[1:], False], strict=True) if n and not prev
            ]  # fmt: skip
            kept.setdefault(int(owner[at[0]]), []).append(ids[at])
        assert runs == (grids.prod(-1) // 4).tolist()  # images in row order, none cut
    if rows:  # collate_multimodal: rows stacked, images concatenated in row order
        batch = collate_multimodal(rows, sample_ids=True)
        for key, value in batch.items():
            parts = [r[key] for r in rows if key in r]
            dim = 1 if key == "position_ids" else 0
            assert torch.equal(value, torch.cat(parts, dim=dim)), key
        assert set(batch) == {k for r in rows for k in r}
    for i, s in enumerate(samples):
        ids = s["input_ids"][0]
        got = torch.cat(kept[i]) if i in kept else ids[:0]
        if len(ids) <= max_len:
            assert torch.equal(got, ids)
        elif overflow == "split":  # the pieces (rows shuffled) are the reference's cuts
            assert sorted(tuple(p.tolist()) for p in kept[i]) == sorted(split(ids, max_len))
        elif overflow == "truncate":
            assert torch.equal(got, ids[: len(got)]) and len(got) <= max_len
            assert len(got) == len(ids) or ids[len(got)] != IMAGE or ids[len(got) - 1] != IMAGE
        else:
            assert got.numel() == 0


def test_packed_qwen_rows_under_bf16_autocast_stay_within_bf16_noise_of_each_sample_alone():
    model, reference = tiny_qwen(register()), tiny_qwen("sdpa")
    samples = qwen_samples(seed=3)
    batch = collate_multimodal(pack_multimodal(samples, 48, model=model), sample_ids=True)
    sample_ids = batch.pop("sample_ids")
    naive = {k: v for k, v in batch.items() if k != "doc_ids"}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        packed, leaky = model(**batch).logits, reference(**naive).logits
        want = [alone(reference, s).float() for s in samples]
    assert packed.dtype == torch.bfloat16
    err = max(
        (per_sample(packed, sample_ids, i).float() - w).abs().max() for i, w in enumerate(want)
    )
    leak = max(
        (per_sample(leaky, sample_ids, i).float() - w).abs().max() for i, w in enumerate(want)
    )
    assert err < 0.05 < leak


# ----------------------------------------------------------------------------- CUDA (faked)


def test_gemma3_row_attention_on_the_faked_cuda_device(fake_cuda, monkeypatch):
    """A packed Gemma 3 row's text attention on CUDA: the image-span mask is built on the
    device (one host sync, the window's) and runs on compiled flex (replaced by a dense
    recorder: Triton kernels are not faked); the vision tower's calls stay sdpa, on the device."""
    from fake_cuda import to_cpu, to_fake_cuda

    from flexpack import _attention_flex

    calls = []

    def recorded_flex(config):
        def run(q, k, v, *, score_mod, block_mask, scale, enable_gqa):
            calls.append(block_mask)
            assert q.is_cuda and block_mask.kv_num_blocks.is_cuda and score_mod is None
            B, _, S, _ = q.shape
            with fake_cuda.paused():
                at = torch.arange(S, device=q.device)
                b = torch.arange(B, device=q.device).view(B, 1, 1, 1)
                allowed = block_mask.mask_mod(b, b * 0, at.view(1, 1, S, 1), at.view(1, 1, 1, S))
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=allowed, scale=scale, enable_gqa=enable_gqa
                )
                return torch.where(allowed.any(-1, keepdim=True), out, 0.0)

        return run

    monkeypatch.setattr(_attention_flex, "compiled_flex_attention", recorded_flex)
    with fake_cuda.paused():
        model = tiny_gemma3("sdpa")
        (row,) = pack_multimodal(gemma_samples()[:3], 40, model=model)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 40, 8, generator=g)
    k, v = torch.randn(2, 1, 2, 40, 8, generator=g).unbind(0)
    text = model.model.language_model.layers[0].self_attn  # a sliding layer, causal
    for window in (6, None):
        cpu_kwargs = {"doc_ids": row["doc_ids"], "image_span_ids": row["image_span_ids"]}
        want, _ = flexpack_attention_forward(
            text, q.requires_grad_(), k, v, None, sliding_window=window, **cpu_kwargs
        )  # CPU with grad: the dense SDPA path
        on_gpu = {name: to_fake_cuda(t) for name, t in cpu_kwargs.items()}
        with fake_cuda.count() as syncs:
            multimodal._image_span_mask(torch.device("cuda", 0), 1, 40, None,
                                        dict(on_gpu, sliding_window=window), True)  # fmt: skip
        # No sync: the window's 0-d tensor, made on the host by masks.sliding_window, is filled
        # on the doc ids' device when composed (Mask.to), not copied there.
        assert syncs == []
        with torch.no_grad():
            got, _ = flexpack_attention_forward(
                text, *(to_fake_cuda(t.detach()) for t in (q, k, v)), None,
                sliding_window=window, **on_gpu,
            )  # fmt: skip
        assert got.is_cuda and (to_cpu(got) - want).abs().max() < 1e-5
    assert len(calls) == 2
    vision = next(m for n, m in model.named_modules() if n.endswith("encoder.layers.0.self_attn"))
    x = to_fake_cuda(torch.randn(3, 2, 2, 16, 8, generator=g))
    out, _ = flexpack_attention_forward(vision, x[0], x[1], x[2], None, **on_gpu)
    assert out.is_cuda and out.shape == (2, 16, 2, 8)
