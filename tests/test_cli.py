"""`flexpack pack` / `flexpack stats` on small files, through flexpack.cli.main."""

import json
import re
import sys

import numpy as np
import pytest

import flexpack
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
    out.parent.mkdir()  # a missing folder is refused, not created (issue 29)
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
        ('{"input_ids": [1, 2, 3, 4, 5]}\n', [], "1 of 1 samples are longer than --max-len 4"),
        ('{"input_ids": [1, 2, 3, 4, 5]}\n', [], "Pass --overflow split"),
        ('{"text": "hello"}\n', [], "flexpack packs token ids and does not tokenize"),
        ('["a", "b"]\n', [], "does not tokenize"),
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
    with pytest.raises(SystemExit) as exit_:
        main(["stats", str(tmp_path / "missing.jsonl"), "--max-len", "4"])
    assert exit_.value.code == 2 and "no such file" in capsys.readouterr().err
    csv = tmp_path / "in.csv"
    csv.write_text("1,2\n")
    with pytest.raises(SystemExit) as exit_:
        main(["stats", str(csv), "--max-len", "4"])
    assert exit_.value.code == 2 and "unknown format" in capsys.readouterr().err
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


# ----------------------------------------------------------------------------- issue 11


def test_help_and_argument_errors_do_not_import_torch():
    """`flexpack --help` imported torch (2-5 s); help and usage errors must be instant."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from flexpack.cli import main\n"
        "for argv in (['--help'], ['pack', '--help'], ['demo', '--docs', '0']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('torch' in sys.modules, 'numpy' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False False"


def test_help_shows_defaults_and_every_option_has_help(capsys):
    from flexpack.cli import build_parser

    parser = build_parser()
    assert "``" not in parser.description
    subs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, sub in subs.choices.items():
        for action in sub._actions:
            assert action.help, (name, action.dest)
        with pytest.raises(SystemExit):
            sub.parse_args(["--help"])
        text = capsys.readouterr().out
        assert "``" not in text
        if name == "pack":
            for default in ("(default: bfd)", "(default: 0)", "(default: error)"):
                assert default in " ".join(text.split()), default
        if name == "demo":
            assert "(default: 1024)" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--docs", "0"],
        ["demo", "--max-len", "0"],
        ["demo", "--max-len", "x"],
        ["stats", "IN", "--max-len", "0"],
        ["pack", "IN", "--max-len", "-4", "--out", "OUT"],
        ["pack", "IN", "--max-len", "4", "--out", "OUT", "--pad-id", "99999999999999999999"],
        ["pack", "IN", "--max-len", "4", "--out", "OUT", "--pad-id", "x"],
        ["pack", "IN", "--max-len", "4", "--out", "OUT", "--seed", "-1"],
        ["pack", "IN", "--max-len", "4", "--out", "OUT", "--max-docs-per-row", "0"],
        ["pack", "IN", "--max-len", "4", "--out", "DIR"],
        ["pack", "IN", "--max-len", "4", "--out", "FILE/sub/out.parquet"],
        ["pack", "IN", "--max-len", "4", "--out", "OUT", "--plot", "DIR"],
        ["demo", "--out", "FILE"],
    ],
)
def test_bad_flag_values_are_usage_errors(tmp_path, capsys, argv):
    """Every bad value: one error line (a bad flag: and one naming --help), exit status 2, no
    usage block, no traceback, and nothing read or written."""
    src = _write_jsonl(tmp_path / "in.jsonl", _samples(n=3))
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    names = {"IN": src, "OUT": tmp_path / "o.parquet", "DIR": tmp_path / "dir"}
    names["FILE/sub/out.parquet"] = tmp_path / "file" / "sub" / "out.parquet"
    names["FILE"] = tmp_path / "file"
    argv = [str(names.get(a, a)) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert re.match(r"flexpack \w+: error: ", lines[0]) and len(lines) <= 2, err
    assert lines[1:] in ([], [f"flexpack {argv[0]} --help lists the options"]), err
    assert "usage:" not in err and "Traceback" not in err
    assert not (tmp_path / "o.parquet").exists()


def test_unwritable_out_is_a_usage_error(tmp_path, capsys):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    src = _write_jsonl(tmp_path / "in.jsonl", _samples(n=3))
    with pytest.raises(SystemExit) as exit_:
        main(["pack", str(src), "--max-len", "64", "--out", str(locked / "o.parquet")])
    assert exit_.value.code == 2 and "permission denied" in capsys.readouterr().err


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


def test_input_that_is_a_directory_or_not_utf8(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["stats", str(tmp_path), "--max-len", "4"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("flexpack stats: error: ")
    assert "is a directory" in err and "usage:" not in err
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"input_ids": [1]}\n{"input_ids": [2], "note": "caf\xe9"}\n')
    assert main(["stats", str(latin), "--max-len", "4"]) == 2
    err = capsys.readouterr().err
    assert f"{latin}:2: not UTF-8" in err and "0xe9" in err


def test_bare_list_lines_are_token_ids(tmp_path, capsys):
    src = tmp_path / "lists.jsonl"
    src.write_text("[1, 2, 3]\n[4, 5]\n")
    out = tmp_path / "o.parquet"
    assert main(["pack", str(src), "--max-len", "8", "--out", str(out), "-q"]) == 0
    _check_packed(out, [[1, 2, 3], [4, 5]], 8)
    assert main(["pack", str(src), "--max-len", "8", "--out", str(out), "--labels-column", "l"])
    assert "a bare list has no 'l' field" in capsys.readouterr().err


def test_stats_prints_nothing_before_failing(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "in.jsonl", [[1] * 10, [2] * 3])
    assert main(["stats", str(src), "--max-len", "4"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--overflow split" in captured.err and "overflow=" not in captured.err


def test_stats_times_packing_apart_from_the_packer_load(tmp_path, capsys, monkeypatch):
    from flexpack import _kernels

    src = _write_jsonl(tmp_path / "in.jsonl", _samples(n=20))
    assert main(["stats", str(src), "--max-len", "64"]) == 0
    text = capsys.readouterr().out
    if not _kernels.compiled_for("best_fit_decreasing", 20):  # numba loaded by an earlier test
        assert "by numpy: under 4,096 samples" in text and "Loading" not in text
    # A large input (20 samples count as large here) loads the compiled kernels, timed apart.
    monkeypatch.setattr(_kernels, "SMALL", 8)
    assert main(["stats", str(src), "--max-len", "64"]) == 0
    text = capsys.readouterr().out
    assert "pack s" in text and "Loading the compiled packers" in text
    for strategy in ("bfd", "ffd", "greedy", "wrap"):
        assert re.search(rf"{strategy} \d+\.\d\d s", text), strategy


@pytest.mark.parametrize(
    ("blocked", "argv_tail", "words"),
    [
        ("pyarrow", [], "flexpack pack writes Parquet, which needs pyarrow: pip install"),
        ("matplotlib", ["--plot", "fill.png"], "--plot needs matplotlib: pip install"),
    ],
)
def test_missing_extras_are_named_before_reading_input(
    tmp_path, capsys, monkeypatch, blocked, argv_tail, words
):
    """`flexpack pack` after the README's [viz] install failed on pyarrow after all the work."""
    src = tmp_path / "in.jsonl"
    src.write_text("not json\n")  # reading it would fail: the extra must be named first
    monkeypatch.setitem(sys.modules, blocked, None)
    monkeypatch.setitem(sys.modules, f"{blocked}.parquet", None)
    argv = ["pack", str(src), "--max-len", "4", "--out", str(tmp_path / "o.parquet")]
    argv += [str(tmp_path / a) if a.endswith(".png") else a for a in argv_tail]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and words in err and ".[cli]" in err
    assert "not valid JSON" not in err


def test_parquet_nulls_name_the_row(tmp_path, capsys):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2], [3, None]])}), src)
    assert main(["stats", str(src), "--max-len", "4"]) == 2
    assert "row 1 of column 'input_ids' holds a null" in capsys.readouterr().err
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2], None])}), src)
    assert main(["stats", str(src), "--max-len", "4"]) == 2
    assert "row 1 of column 'input_ids' is null" in capsys.readouterr().err


def test_pack_says_where_it_wrote(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "in.jsonl", _samples(n=5))
    out = tmp_path / "o.parquet"
    assert main(["pack", str(src), "--max-len", "64", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"wrote       {out.resolve()}" in text
    assert "packer load (once)" in text or "pack (numpy)" in text


def test_litgpt_finetune_forwards_to_the_litgpt_entry_point(capsys):
    """`flexpack litgpt-finetune` is `python -m flexpack.integrations.litgpt finetune`."""
    with pytest.raises(SystemExit) as e:
        main(["litgpt-finetune", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--max-len" in out and "--data" in out


# ----------------------------------------------------------------------------- issue 20


def _usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err and err.startswith("flexpack ")
    assert "usage:" not in err and len(err.splitlines()) <= 2, err
    return err


@pytest.mark.parametrize("out", ["/proc/x.parquet", "/sys/x.parquet", "/proc/new/x.parquet"])
def test_out_where_nothing_can_be_written_is_a_usage_error_even_as_root(tmp_path, capsys, out):
    # os.access says yes to root: --out /proc/x.parquet was a pyarrow traceback after the work.
    import os

    if not os.path.isdir("/" + out.split("/")[1]):
        pytest.skip("no /proc or /sys here")
    src = _write_jsonl(tmp_path / "in.jsonl", _samples(n=3))
    err = _usage_error(["pack", str(src), "--max-len", "64", "--out", out], capsys)
    # /proc/new does not exist: refused as such, never created (issue 29)
    assert f"--out {out}: cannot write in" in err or "does not exist" in err


def test_out_that_is_not_a_regular_file_is_a_usage_error(tmp_path, capsys):
    # /dev/full (root: os.access yes) and a FIFO: the check must look at the file, not ask.
    import os

    src = _write_jsonl(tmp_path / "in.jsonl", _samples(n=3))
    fifo = tmp_path / "pipe.parquet"
    os.mkfifo(fifo)
    for out in (str(fifo), "/dev/full"):
        err = _usage_error(["pack", str(src), "--max-len", "64", "--out", out], capsys)
        assert "not a regular file" in err or "ending in .parquet" in err
    err = _usage_error(["pack", str(src), "--max-len", "64", "--out", str(fifo)], capsys)
    assert "exists and is not a regular file" in err


def test_out_must_end_in_parquet(tmp_path, capsys):
    # --out o.csv wrote Parquet inside a .csv.
    src = _write_jsonl(tmp_path / "in.jsonl", _samples(n=3))
    err = _usage_error(
        ["pack", str(src), "--max-len", "64", "--out", str(tmp_path / "o.csv")], capsys
    )
    assert "ending in .parquet or .pq" in err and "o.parquet" in err
    assert not (tmp_path / "o.csv").exists()
    assert main(["pack", str(src), "--max-len", "64", "--out", str(tmp_path / "o.pq"), "-q"]) == 0


@pytest.mark.parametrize(
    ("plot", "words"),
    [
        ("fill.xyz", "unknown image format .xyz"),
        ("fill", "no file extension"),
        ("/proc/fill.png", "cannot write in /proc"),
    ],
)
def test_plot_path_and_format_are_checked_before_any_work(tmp_path, capsys, plot, words):
    # A bad --plot failed only after the Parquet was written.
    src = _write_jsonl(tmp_path / "in.jsonl", _samples(n=3))
    out = tmp_path / "o.parquet"
    plot = plot if plot.startswith("/") else str(tmp_path / plot)
    err = _usage_error(
        ["pack", str(src), "--max-len", "64", "--out", str(out), "--plot", plot], capsys
    )
    assert words in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("lines", "labels", "where", "words"),
    [
        (['{"input_ids": [1]}', "", '{"input_ids": [2]}', '{"input_ids": [1.5]}'], None, 4,
         "token ids must be a list of integer token ids"),
        (['{"input_ids": [1]}', "", '{"input_ids": [1, 99999999999999999999]}'], None, 3,
         "does not fit int64"),
        (['{"input_ids": [1], "l": [1]}', '{"input_ids": [1, 2], "l": [1]}'], "l", 2,
         "2 token ids but 1 labels"),
        (['{"input_ids": [1], "l": [1]}', '{"input_ids": [1], "l": "x"}'], "l", 2,
         "labels must be a list of integer labels"),
        (['[1, 2]', '[3, -1]'], None, 2, "token id -1 is negative"),
    ],
)  # fmt: skip
def test_per_sample_errors_name_the_1_based_line(tmp_path, capsys, lines, labels, where, words):
    # A type error named "sample 3" for line 4; an oversized id, a labels length mismatch and a
    # negative id named no line (docs/packing.md promises file and line).
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    argv = ["pack", str(src), "--max-len", "8", "--out", str(tmp_path / "o.parquet")]
    argv += ["--labels-column", labels] if labels else []
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{src}:{where}: " in err and words in err, err
    assert not (tmp_path / "o.parquet").exists()


def test_a_null_labels_field_labels_its_sample_by_its_tokens(tmp_path):
    # The rule of every flexpack path (docs/data.md); it was an error that named no line.
    src = tmp_path / "in.jsonl"
    src.write_text(
        '{"input_ids": [1, 2, 3], "l": [-100, 2, 3]}\n{"input_ids": [4, 5], "l": null}\n'
    )
    out = tmp_path / "o.parquet"
    assert (
        main(["pack", str(src), "--max-len", "8", "--out", str(out), "-q", "--labels-column", "l"])
        == 0
    )
    want = [
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
        {"input_ids": [4, 5], "labels": [4, 5]},
    ]
    _check_packed(out, want, 8)
    pqin = tmp_path / "in.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5]], "l": [[-100, 2, 3], None]}), pqin)
    assert (
        main(["pack", str(pqin), "--max-len", "8", "--out", str(out), "-q", "--labels-column", "l"])
        == 0
    )
    _check_packed(out, want, 8)


def _jsonl(path, lines):
    import json

    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


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


def test_parquet_ids_past_int64_negative_or_mislabelled_name_the_row(tmp_path, capsys):
    # uint64 ids >= 2**63 wrapped to negative ids (exit 0); the shared check refuses them.
    src = tmp_path / "in.parquet"
    big = pa.array([[1, 2], [3, 2**63 + 1]], pa.list_(pa.uint64()))
    pq.write_table(pa.table({"input_ids": big}), src)
    assert main(["stats", str(src), "--max-len", "4"]) == 2
    assert f"row 1 of column 'input_ids' holds {2**63 + 1}" in capsys.readouterr().err
    pq.write_table(pa.table({"input_ids": [[1, 2], [3, -4]]}), src)
    assert main(["stats", str(src), "--max-len", "4"]) == 2
    assert "row 1 of column 'input_ids': token id -4 is negative" in capsys.readouterr().err
    pq.write_table(pa.table({"input_ids": [[1, 2], [3]], "l": [[1, 2], [3, 4]]}), src)
    out = str(tmp_path / "o.parquet")
    assert main(["pack", str(src), "--max-len", "4", "--out", out, "--labels-column", "l"]) == 2
    assert "row 1: 1 token ids in 'input_ids' but 2 labels in 'l'" in capsys.readouterr().err


def test_pad_id_must_be_a_token_id(tmp_path, capsys):
    # --pad-id -1 was accepted and written on every padding position.
    src = _write_jsonl(tmp_path / "in.jsonl", _samples(n=3))
    argv = ["pack", str(src), "--max-len", "64", "--out", str(tmp_path / "o.parquet")]
    err = _usage_error([*argv, "--pad-id", "-1"], capsys)
    assert "--pad-id" in err and "0..2**63 - 1" in err


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_empty_input_is_an_error_not_an_empty_parquet(tmp_path, capsys, content):
    # An empty file gave a 0-row Parquet, "efficiency 0.00%", exit 0.
    src = tmp_path / "in.jsonl"
    src.write_text(content)
    out = tmp_path / "o.parquet"
    assert main(["pack", str(src), "--max-len", "8", "--out", str(out)]) == 2
    assert "no samples" in capsys.readouterr().err and not out.exists()
    empty = tmp_path / "in.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([], pa.list_(pa.int64()))}), empty)
    assert main(["stats", str(empty), "--max-len", "8"]) == 2
    assert "no samples" in capsys.readouterr().err


def test_column_on_bare_list_lines_is_an_error(tmp_path, capsys):
    # --column tokens on a file of bare lists was silently ignored.
    src = tmp_path / "lists.jsonl"
    src.write_text("[1, 2, 3]\n[4, 5]\n")
    out = tmp_path / "o.parquet"
    assert main(["pack", str(src), "--max-len", "8", "--out", str(out), "--column", "tokens"]) == 2
    err = capsys.readouterr().err
    assert f"{src}:1: a bare list has no 'tokens' field for --column" in err
    assert main(["pack", str(src), "--max-len", "8", "--out", str(out), "-q"]) == 0


# ----------------------------------------------------------------------------- issue 38


_IN_A_FRESH_PROCESS = """
import sys
from flexpack.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(code, "torch" in sys.modules, "numba" in sys.modules)
"""


@pytest.mark.parametrize(
    ("content", "argv", "words"),
    [
        (None, ["stats", "MISSING", "--max-len", "8"], "MISSING: no such file"),
        (None, ["pack", "MISSING", "--max-len", "8", "--out", "o.parquet"], "no such file"),
        ("[1, 2]\n", ["stats", "IN", "--max-len", "0"], "expected a positive integer, got 0"),
        ("[1, 2]\nnot json\n", ["stats", "IN", "--max-len", "8"], "IN:2: not valid JSON"),
        ("[1]\n[1, 2, 3]\n", ["pack", "IN", "--max-len", "2", "--out", "o.parquet"],
         "the first is IN:2"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_before_torch_loads(tmp_path, content, argv, words):
    """Issue 38: a missing file or --max-len 0 printed 7 lines of usage first, and errors in the
    input took 12-16 s on a busy machine, because torch loaded before the file was read."""
    import subprocess

    src = tmp_path / "in.jsonl"
    if content is not None:
        src.write_text(content)
    names = {"IN": str(src), "MISSING": str(tmp_path / "missing.jsonl")}
    argv = [names.get(a, a) for a in argv]
    words = words.replace("MISSING", names["MISSING"]).replace("IN", names["IN"])
    done = subprocess.run(
        [sys.executable, "-c", _IN_A_FRESH_PROCESS, *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.stdout.split() == ["2", "False", "False"], done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith(f"flexpack {argv[0]}: error: ") and words in lines[0], lines
    assert len(lines) <= 2 and "usage:" not in done.stderr
    assert not (tmp_path / "o.parquet").exists()


def test_stats_on_a_small_file_loads_neither_torch_nor_numba(tmp_path):
    import subprocess

    src = _write_jsonl(tmp_path / "in.jsonl", _samples(n=30))
    done = subprocess.run(
        [sys.executable, "-c", _IN_A_FRESH_PROCESS, "stats", str(src), "--max-len", "64"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split()[-3:] == ["0", "False", "False"], done.stdout + done.stderr
    assert "30 samples" in done.stdout and "by numpy" in done.stdout


def test_overflow_error_names_the_sample_as_the_file_does(tmp_path, capsys):
    # It said "first: sample 1", 0-based, where every other error names the 1-based line.
    src = tmp_path / "in.jsonl"
    src.write_text('[1]\n\n{"input_ids": [1, 2, 3]}\n[1, 2, 3, 4]\n')
    assert main(["stats", str(src), "--max-len", "2"]) == 2
    err = capsys.readouterr().err
    assert "2 of 3 samples are longer than --max-len 2 (longest 4 tokens;" in err
    assert f"the first is {src}:3)" in err
    pqin = tmp_path / "in.parquet"
    pq.write_table(pa.table({"input_ids": [[1], [1, 2, 3]]}), pqin)
    assert main(["stats", str(pqin), "--max-len", "2"]) == 2
    assert f"the first is {pqin}: row 1 of column 'input_ids')" in capsys.readouterr().err


def test_help_names_the_install_for_a_wheel_and_for_a_checkout(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "pip install 'flexpack[cli]'" in text and "pip install -e '.[cli]'" in text


def test_demo_help_and_output_say_where_the_pictures_go(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--out DIR" in help_text and "current folder" in help_text
    assert "(default: flexpack-demo)" in help_text
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--docs", "4", "--max-len", "512"]) == 0
    text = capsys.readouterr().out
    where = tmp_path / "flexpack-demo"
    assert f"pictures go to {where} (flexpack demo --out DIR puts them elsewhere)" in text
    assert text.index("pictures go to") < text.index("padded to")
    if "skipped the mask PNGs" not in text:
        assert (where / "mask.png").exists()


def test_fill_plot_log_axis_starts_below_one_row(tmp_path, monkeypatch):
    # The log axis of fill.png started at 10 when every bar held 10 rows or more.
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    src = _write_jsonl(tmp_path / "in.jsonl", [[1] * 30] * 200)  # every bar: 10 rows or more
    out, png = tmp_path / "o.parquet", tmp_path / "fill.png"
    argv = ["pack", str(src), "--max-len", "64", "--out", str(out), "--plot", str(png), "-q"]
    assert main(argv) == 0
    fill = figures[-1].axes[1]
    assert fill.get_yscale() == "log" and fill.get_ylim()[0] < 1 <= fill.get_ylim()[1]
    assert png.read_bytes()[:4] == b"\x89PNG"
