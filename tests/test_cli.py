"""`flexpack pack` / `flexpack stats` on small files, through flexpack.cli.main."""

import json

import numpy as np
import pytest

from flexpack import pack
from flexpack.cli import main

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")


def _samples(n=50, seed=0, longest=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 500, rng.integers(1, longest)).tolist() for _ in range(n)]


def _write_jsonl(path, samples, column="input_ids", extra=None):
    with path.open("w") as f:
        for k, s in enumerate(samples):
            record = {column: s, "id": k}
            if extra:
                record.update(extra(s))
            f.write(json.dumps(record) + "\n")
        f.write("\n")  # blank lines are skipped
    return path


def _check_packed(out, samples, max_len, **pack_kwargs):
    table = pq.read_table(out)
    assert table.column_names == ["input_ids", "labels", "doc_ids", "position_ids"]
    rows = table.to_pydict()
    lengths = [len(s["input_ids"]) if isinstance(s, dict) else len(s) for s in samples]
    plan = pack(lengths, max_len, **pack_kwargs)
    expected = plan.materialize(samples)
    assert rows["input_ids"] == expected.input_ids.tolist()
    assert rows["labels"] == expected.labels.tolist()
    assert rows["doc_ids"] == expected.doc_ids.tolist()
    assert rows["position_ids"] == expected.position_ids.tolist()


def test_pack_jsonl(tmp_path, capsys):
    samples = _samples()
    src = _write_jsonl(tmp_path / "in.jsonl", samples)
    out = tmp_path / "out" / "packed.parquet"
    assert main(["pack", str(src), "--max-len", "64", "--out", str(out)]) == 0
    _check_packed(out, samples, 64)
    text = capsys.readouterr().out
    for word in ("samples", "rows", "lower bound", "efficiency", "truncated", "dropped", "time"):
        assert word in text
    assert "50" in text


def test_pack_parquet_with_options_and_labels(tmp_path, capsys):
    samples = _samples(seed=1, longest=90)
    labels = [[-100, *s[1:]] for s in samples]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"tokens": samples, "lab": labels}), src)
    out = tmp_path / "packed.parquet"
    args = ["pack", str(src), "--max-len", "48", "--out", str(out), "--column", "tokens"]
    args += ["--strategy", "greedy", "--overflow", "split", "--labels-column", "lab", "--quiet"]
    assert main(args) == 0
    assert capsys.readouterr().out == ""
    dicts = [{"input_ids": s, "labels": lab} for s, lab in zip(samples, labels, strict=True)]
    _check_packed(out, dicts, 48, strategy="greedy", overflow="split")


def test_pack_truncate_summary_and_plot(tmp_path, capsys):
    samples = [[1] * 100, [2] * 10]
    src = _write_jsonl(tmp_path / "in.jsonl", samples)
    png = tmp_path / "fill.png"
    args = ["pack", str(src), "--max-len", "32", "--out", str(tmp_path / "o.parquet")]
    assert main([*args, "--overflow", "truncate", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "truncated   68 tokens (1 samples)" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stats_prints_every_strategy(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "in.jsonl", _samples(n=200))
    assert main(["stats", str(src), "--max-len", "64"]) == 0
    text = capsys.readouterr().out
    for strategy in ("bfd", "ffd", "greedy", "wrap"):
        assert f"\n{strategy} " in text
    assert "200 samples" in text
    assert not list(tmp_path.glob("*.parquet"))


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        ('{"input_ids": [1, 2, 3, 4, 5]}\n', [], "1 of 1 samples are longer than max_len=4"),
        ('{"tokens": [1]}\n', [], "no 'input_ids' field"),
        ("not json\n", [], "not valid JSON"),
        ('{"input_ids": [1.5]}\n', [], "list of integer token ids"),
        ('{"input_ids": [1, 2.7]}\n', [], "list of integer token ids"),  # not just the first
        ('{"input_ids": [1, true]}\n', [], "list of integer token ids"),
        ('{"input_ids": [1]}\n', ["--strategy", "nope"], None),
    ],
)
def test_pack_errors(tmp_path, capsys, content, args, message):
    src = tmp_path / "in.jsonl"
    src.write_text(content)
    argv = ["pack", str(src), "--max-len", "4", "--out", str(tmp_path / "o.parquet"), *args]
    if message is None:
        with pytest.raises(SystemExit):
            main(argv)
        return
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("flexpack pack: error:")


def test_input_errors(tmp_path, capsys):
    assert main(["stats", str(tmp_path / "missing.jsonl"), "--max-len", "4"]) == 2
    assert "no such file" in capsys.readouterr().err
    csv = tmp_path / "in.csv"
    csv.write_text("1,2\n")
    assert main(["stats", str(csv), "--max-len", "4"]) == 2
    assert "unknown format" in capsys.readouterr().err
    bad = tmp_path / "in.parquet"
    pq.write_table(pa.table({"x": [[1]]}), bad)
    assert main(["stats", str(bad), "--max-len", "4"]) == 2
    assert "no column 'input_ids'" in capsys.readouterr().err


def test_demo_runs_from_the_cli(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--docs", "12", "--max-len", "256"]) == 0
    assert "-> OK" in capsys.readouterr().out


def test_docs_commands_run(tmp_path, monkeypatch, capsys):
    """The `$ flexpack ...` lines of docs/packing.md run as written."""
    import shlex
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs" / "packing.md"
    commands = [ln[2:] for ln in docs.read_text().splitlines() if ln.startswith("$ flexpack ")]
    assert len(commands) >= 3
    _write_jsonl(tmp_path / "data.jsonl", _samples(n=100, longest=64))
    monkeypatch.chdir(tmp_path)
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, command
    assert (tmp_path / "packed.parquet").exists() and (tmp_path / "fill.png").exists()


def test_parquet_float_tokens_are_an_error_not_truncated(tmp_path, capsys):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([[1.5, 2.0], [3.0]])}), src)
    argv = ["pack", str(src), "--max-len", "4", "--out", str(tmp_path / "o.parquet")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "input_ids" in err and "double" in err and "integer" in err
    assert not (tmp_path / "o.parquet").exists()
