"""Red-team regressions (issue 29): each test failed on the code before its fix.

The per-tensor caches against every write a user can make between two calls (numpy views,
``.data``, inference mode), packed rows on models without flexpack attention, unclear errors and
what a new user trips on. Results are pinned against references (numpy twins, float64
attention); errors against the message a user needs.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import flexpack
from flexpack import masks as fm
from flexpack.testing.references import dense_mask, reference_attention


def _qkv(B: int, S: int, H: int = 2, D: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, S, D, dtype=torch.float64, generator=g) for _ in range(3))


def _twin(d) -> torch.Tensor:
    """(B, 1, S, S) document-causal mask of ids ``d``, written from the spec."""
    d = np.asarray(d)
    S = d.shape[-1]
    dq, dkv = d[:, :, None], d[:, None, :]
    out = (dq == dkv) & (dq >= 0) & (np.arange(S)[:, None] >= np.arange(S)[None, :])
    return torch.from_numpy(out[:, None])


def _check(ids: torch.Tensor, want_ids) -> None:
    """The mask and attention built from ``ids`` now are those of ``want_ids``."""
    B, S = ids.shape
    mask = fm.document(ids) & fm.causal()
    want = _twin(want_ids)
    assert torch.equal(dense_mask(mask), want)
    assert torch.equal(dense_mask(mask.block_mask(block_size=2)), want)
    q, k, v = _qkv(B, S)
    got = flexpack.attention(q, k, v, mask)
    torch.testing.assert_close(got, reference_attention(q, k, v, want))


# ----------------------------------------------------------------------------- stale caches

FIRST, SECOND = [[0, 0, 0, 0]], [[0, 0, 1, 1]]


def test_a_write_through_a_numpy_view_is_seen():
    # A collate buffer reused through numpy: token 2 attended to document 0.
    buf = np.array(FIRST)
    ids = torch.from_numpy(buf)
    _check(ids, FIRST)
    buf[:] = SECOND
    _check(ids, SECOND)


def test_a_write_through_dot_data_is_seen():
    ids = torch.tensor(FIRST)
    _check(ids, FIRST)
    ids.data[:, 2:] = 1  # .data has its own version counter: ids._version stays
    _check(ids, SECOND)


def test_dot_data_reassignment_is_seen():
    ids = torch.tensor(FIRST)
    _check(ids, FIRST)
    ids.data = torch.tensor(SECOND)
    _check(ids, SECOND)


def test_block_mask_functions_see_numpy_writes():
    from flexpack.block_mask import packed_layout

    buf = np.array([[0, 0, 1, 1]])
    ids = torch.from_numpy(buf)
    assert packed_layout(ids)
    buf[:] = [[0, 1, 0, 1]]  # no longer a packed layout: the order facts must be derived again
    assert not packed_layout(ids)


def test_every_mask_builds_and_runs_under_inference_mode():
    # RuntimeError: Inference tensors do not track version counter.
    with torch.inference_mode():
        ids = torch.tensor([[0, 0, 1, 1, -1]])
        _check(ids, ids.tolist())
        m = fm.document(ids) & fm.sliding_window(1) | ~fm.padding(ids)
        assert m.to("meta").doc_ids.device.type == "meta"
        assert torch.equal(dense_mask(m.block_mask(block_size=2)), dense_mask(m))
        flexpack.document_causal_mask(ids, block_size=2)
        ids[0, 1] = 1  # inference tensors can be written in place inside inference mode
        _check(ids, [[0, 1, 1, 1, -1]])


def test_mask_to_sees_a_numpy_write():
    buf = np.array([[0, 0, 1, 1]])
    m = fm.document(torch.from_numpy(buf.copy()))
    src = m.doc_ids
    moved = m.to("meta")
    src.data[0, 0] = 5  # the snapshot itself, written without a version bump
    assert m.to("meta") is not moved


def test_clear_caches_forgets_everything():
    ids = torch.tensor(FIRST)
    _check(ids, FIRST)
    flexpack.clear_caches()
    _check(ids, FIRST)


# ----------------------------------------------------------------------------- transformers cache


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    from flexpack.integrations.transformers import register

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        attn_implementation=register(),
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_transformers_position_ids_written_through_numpy_are_seen():
    model = _tiny_llama()
    input_ids = torch.arange(1, 9)[None]
    first, second = np.array([[0, 1, 2, 3, 4, 5, 6, 7]]), np.array([[0, 1, 2, 0, 1, 2, 3, 4]])
    buf = first.copy()
    pos = torch.from_numpy(buf)
    with torch.no_grad():
        model(input_ids, position_ids=pos)
        buf[:] = second
        got = model(input_ids, position_ids=pos).logits
        want = model(input_ids, position_ids=torch.from_numpy(second.copy())).logits
        pos.data[:] = torch.from_numpy(first)
        got_first = model(input_ids, position_ids=pos).logits
        want_first = model(input_ids, position_ids=torch.from_numpy(first.copy())).logits
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_first, want_first)


def test_transformers_forward_and_generate_under_inference_mode():
    model = _tiny_llama()
    input_ids = torch.arange(1, 9)[None]
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        want = model(input_ids, position_ids=pos).logits
        want_gen = model.generate(input_ids[:, :3], max_new_tokens=3, do_sample=False)
    with torch.inference_mode():
        got = model(input_ids, position_ids=pos).logits
        got_gen = model.generate(input_ids[:, :3], max_new_tokens=3, do_sample=False)
    torch.testing.assert_close(got, want)
    assert torch.equal(got_gen, want_gen)


# ----------------------------------------------------------------------------- unclear errors


def test_shard_context_names_ragged_rows():
    from flexpack.parallel import shard_context

    with pytest.raises(ValueError, match=r"rows of lengths \[3, 1\].*Pad the shorter rows"):
        shard_context([[0, 0, 1], [1]], 1, 0)


def test_shard_rows_refuses_float_counts():
    from flexpack.data.dataset import shard_rows

    with pytest.raises(TypeError, match=r"num_tokens must be integers.*float64.*\[1.5, 2.0\]"):
        shard_rows([1.5, 2], 1)
    assert shard_rows(np.array([3, 2], dtype=np.uint8), 1).tolist() == [[0, 1]]


@pytest.mark.parametrize("name", ["scale", "softcap"])
def test_attention_takes_numpy_scalars(name):
    q, k, v = _qkv(1, 4)
    mask = fm.document(torch.tensor([[0, 0, 1, 1]])) & fm.causal()
    want = flexpack.attention(q, k, v, mask, **{name: 0.5})
    got = flexpack.attention(q, k, v, mask, **{name: np.float32(0.5)})
    torch.testing.assert_close(got, want)
    with pytest.raises(TypeError, match=rf"{name} must be a float or None, got 'x'"):
        flexpack.attention(q, k, v, mask, **{name: "x"})


def test_pack_sequences_refuses_text_before_reporting_lengths():
    with pytest.raises(TypeError, match="does not tokenize"):
        flexpack.pack_sequences(["hello world"], max_len=8)


def test_python_api_refuses_negative_token_and_pad_ids_as_the_cli_does():
    with pytest.raises(ValueError, match="token id -2"):
        flexpack.pack_sequences([[1, -2, 3]], max_len=8)
    with pytest.raises(ValueError, match="token id -2"):
        flexpack.pack_sequences([np.array([1, -2, 3])], max_len=8)
    with pytest.raises(ValueError, match=r"pad_id must be a token id in 0\.\.2\*\*63 - 1"):
        flexpack.pack_sequences([[1, 2]], max_len=8, pad_id=-1)
    labels = flexpack.pack_sequences([{"input_ids": [1, 2], "labels": [-100, 2]}], 4).labels
    assert labels.tolist() == [[-100, 2, -100, -100]]


def test_pack_dataset_of_only_empty_samples_says_so():
    datasets = pytest.importorskip("datasets")
    from flexpack.integrations.datasets import pack_dataset

    ds = datasets.Dataset.from_dict({"input_ids": [[], []]})
    with pytest.raises(ValueError, match="every sample is empty"):
        pack_dataset(ds, max_len=8)


def test_gpt2_dropout_refusal_names_attn_pdrop():
    transformers = pytest.importorskip("transformers")
    from flexpack.integrations.transformers import packed_forward_kwargs, register

    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16, attn_pdrop=0.1,
        attn_implementation=register(),
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).train()
    batch = flexpack.pack_sequences([[1, 2, 3], [4, 5]], max_len=8)
    with pytest.raises(ValueError, match=r"set the config's attn_pdrop to 0\.0"):
        model(**packed_forward_kwargs(batch))


def test_gemma3_bidirectional_refusal_names_the_flag_not_a_window():
    transformers = pytest.importorskip("transformers")
    from flexpack.integrations.transformers import packed_forward_kwargs, register

    config = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
        use_bidirectional_attention=True, attn_implementation=register(),
    )  # fmt: skip
    model = transformers.Gemma3ForCausalLM(config).eval()
    batch = flexpack.pack_sequences([[1, 2, 3], [4, 5]], max_len=8)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True") as e:
        model(**packed_forward_kwargs(batch))
    assert "(3)" not in str(e.value)


# ----------------------------------------------------------------------------- the command line


def _jsonl(path, lines):
    import json

    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def test_cli_refuses_out_in_a_missing_folder_before_reading(tmp_path, capsys):
    from flexpack.cli import main

    missing = tmp_path / "nonexistent" / "dir"
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\xff not read: the refusal comes first\n")
    with pytest.raises(SystemExit) as e:
        main(["pack", str(src), "--max-len", "4", "--out", str(missing / "o.parquet")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "does not exist" in err and "mkdir -p" in err
    assert not missing.parent.exists()


def test_cli_counts_empty_samples_and_labels_records_without_labels(tmp_path, capsys):
    pq = pytest.importorskip("pyarrow.parquet")
    from flexpack.cli import main

    src = _jsonl(
        tmp_path / "in.jsonl",
        [
            {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
            {"input_ids": []},
            {"input_ids": [4, 5]},  # no labels field: labelled by its tokens, as a null one
        ],
    )
    out = tmp_path / "o.parquet"
    argv = ["pack", src, "--max-len", "4", "--out", str(out), "--labels-column", "labels"]
    assert main(argv) == 0
    summary = capsys.readouterr().out
    assert "samples     3" in summary and "empty       1 samples" in summary
    labels = sorted(map(tuple, pq.read_table(out).column("labels").to_pylist()))
    assert labels == [(-100, 2, 3, -100), (-100, 5, -100, -100)]
    assert flexpack.pack([3, 0, 2], 4).stats.empty_samples == 1


def test_a_one_row_mask_broadcasts_over_the_batch_as_documented():
    import inspect

    doc = " ".join(inspect.getdoc(flexpack.attention).split())
    assert "A mask of batch size 1 is broadcast" in doc
    q, k, v = _qkv(3, 4)
    d = torch.tensor([[0, 0, 1, 1]])
    got = flexpack.attention(q, k, v, fm.document(d) & fm.causal())
    torch.testing.assert_close(got, reference_attention(q, k, v, _twin(d.expand(3, 4))))


# ----------------------------------------------------------------------------- a new user


def test_the_hf_extra_installs_what_the_trainer_blocks_need():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    hf = re.search(r"^hf = \[(.*)\]$", (root / "pyproject.toml").read_text(), re.M).group(1)
    assert "Trainer(" in (root / "docs" / "vlm.md").read_text()
    assert "transformers" in hf and "accelerate" in hf  # transformers.Trainer imports accelerate


# ------------------------------------------------------------------------ no flexpack attention


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


def test_readme_offers_the_quick_demo_and_says_how_long_things_take():
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert "flexpack demo --docs 64" in text
    assert (
        re.search(r"takes about \d+ minutes idle", text) and "45 minutes on a busy machine" in text
    )


def test_stamps_of_cuda_tensors_make_no_host_sync(fake_cuda):
    # On CUDA a content comparison would be a sync per layer: stamps trust version and storage.
    from flexpack._tensor_cache import PerTensor

    ids = torch.tensor([[0, 0, 1, 1]], device="cuda")
    cache = PerTensor()
    with fake_cuda.count() as syncs:
        first = cache.get(ids, lambda: object())
        assert cache.get(ids, lambda: object()) is first
        ids.add_(1)  # an in-place op bumps the version: seen without a sync
        assert cache.get(ids, lambda: object()) is not first
    assert syncs == []  # (`.data = other` is seen by data_ptr, which the fake reports as 0)


def test_packed_forward_kwargs_given_a_model_warns_without_flexpack_attention():
    transformers = pytest.importorskip("transformers")
    import warnings

    from flexpack.integrations.transformers import packed_forward_kwargs

    batch = flexpack.pack_sequences([[1, 2, 3], [4, 5]], max_len=8)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa",
    )  # fmt: skip
    sdpa = transformers.LlamaForCausalLM(config)
    with pytest.warns(UserWarning, match="packed_forward_kwargs: .*'sdpa'.*attend to each other"):
        packed_forward_kwargs(batch, model=sdpa)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packed_forward_kwargs(batch, model=_tiny_llama())
        packed_forward_kwargs(batch)  # no model: nothing to check


def test_pack_trees_refuses_negative_token_and_pad_ids_as_pack_sequences_does():
    with pytest.raises(ValueError, match=r"groups\[0\].*token id -3"):
        flexpack.pack_trees([([1, 2], [[3, -3]])], 8)
    with pytest.raises(ValueError, match="pad_id must be a token id"):
        flexpack.pack_trees([([1, 2], [[3]])], 8, pad_id=-1)
    with pytest.raises(ValueError, match="pad_id must be a token id"):
        flexpack.pack_sequences([[1, 2]], 8, pad_id=-1)
