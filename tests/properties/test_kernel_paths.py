"""The two paths of flexpack._kernels make the same arrays (hypothesis).

Small inputs run the numpy twins (no compile), large ones the numba kernels; a plan must not
depend on which ran. Each property runs one input down both paths (``_kernels.forced``) and
compares every array: the plan's segments and stats, its layout, and materialized tokens and
labels; ``assemble_rows`` also on pieces of any length, empty ones included, as the streaming
buffer hands them over.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flexpack import _kernels, pack
from flexpack.packing import STRATEGIES


def _both(fn):
    with _kernels.forced("numpy"):
        a = fn()
    with _kernels.forced("numba"):
        b = fn()
    return a, b


def _same(a, b):
    if isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    else:  # a row count: a Python int from numpy, an int from numba
        assert int(a) == int(b)


@given(
    st.integers(1, 48).flatmap(
        lambda m: st.tuples(st.lists(st.integers(0, 3 * m), max_size=60), st.just(m))
    ),
    st.sampled_from(STRATEGIES),
    st.sampled_from(["error", "split", "truncate", "drop"]),
    st.one_of(st.none(), st.integers(1, 4)),
    st.one_of(st.none(), st.integers(0, 3)),
    st.booleans(),
)
def test_pack_layout_and_materialize_agree_on_both_paths(
    inp, strategy, overflow, max_docs, seed, prompt_labels
):
    lengths, max_len = inp
    if overflow == "error" and strategy != "wrap":
        overflow = "split"
    seqs = [list(range(1000 * (i + 1), 1000 * (i + 1) + n)) for i, n in enumerate(lengths)]
    if prompt_labels:
        seqs = [{"input_ids": s, "labels": [-100, *s[1:]]} for s in seqs]

    def run():
        plan = pack(
            lengths,
            max_len,
            strategy=strategy,
            overflow=overflow,
            seed=seed,
            max_docs_per_row=max_docs,
        )
        batch = plan.materialize(seqs, pad_id=7)
        return plan, plan.layout(), batch

    (plan_a, layout_a, batch_a), (plan_b, layout_b, batch_b) = _both(run)
    _same(plan_a.segments, plan_b.segments)
    assert plan_a.num_rows == plan_b.num_rows and plan_a.stats == plan_b.stats
    _same(plan_a.row_offsets, plan_b.row_offsets)
    assert layout_a == layout_b and batch_a.layout == batch_b.layout
    for name in ("input_ids", "labels", "doc_ids", "position_ids"):
        assert getattr(batch_a, name).equal(getattr(batch_b, name)), name


@given(
    st.integers(1, 64).flatmap(
        lambda m: st.tuples(st.lists(st.integers(1, m), max_size=80), st.just(m))
    ),
    st.one_of(st.none(), st.integers(1, 5)),
)
def test_each_packer_agrees_on_both_paths(inp, max_docs):
    """The packers alone, on pieces in any order (not only a plan's), ties everywhere."""
    sizes, max_len = inp
    sizes = np.array(sizes, dtype=np.int64)
    limit = np.iinfo(np.int64).max if max_docs is None else max_docs
    for packer in ("best_fit_decreasing", "first_fit_decreasing", "next_fit"):
        a, b = _both(lambda p=packer: getattr(_kernels, p)(sizes, max_len, limit))
        _same(a, b)
    lengths = np.concatenate([sizes, [0, 3 * max_len]]).astype(np.int64)
    _same(*_both(lambda: _kernels.wrap(lengths, max_len, limit)))
    for mode in (_kernels.SPLIT, _kernels.TRUNCATE, _kernels.DROP):
        _same(*_both(lambda m=mode: _kernels.make_pieces(lengths, max_len, m)))


@st.composite
def rows_of_pieces(draw):
    max_len = draw(st.integers(1, 16))
    rows = []
    for _ in range(draw(st.integers(0, 5))):
        row, room = [], max_len
        while draw(st.booleans()):
            n = draw(st.integers(0, room))  # empty pieces too
            row.append(n)
            room -= n
        rows.append(row)
    return rows, max_len


@given(rows_of_pieces(), st.booleans(), st.booleans(), st.integers(0, 5))
def test_assemble_rows_agrees_on_both_paths(case, with_tokens, with_labels, pad_id):
    rows, max_len = case
    num_docs = np.array([len(r) for r in rows], dtype=np.int64)
    n = np.array([k for r in rows for k in r], dtype=np.int64)
    gap = 3  # pieces start inside their sample, and samples lie apart in flat_ids
    seg = np.zeros((n.size, 4), dtype=np.int64)
    seg[:, 0] = np.repeat(np.arange(len(rows)), num_docs)
    seg[:, 1] = np.arange(n.size)
    seg[:, 2] = 1
    seg[:, 3] = 1 + n
    source = np.cumsum(n + gap) - (n + gap)
    flat = np.arange(int((n + gap).sum()) + 1, dtype=np.int64) + 100
    labels = -flat if with_labels else np.zeros(0, dtype=np.int64)
    args = (seg, num_docs, max_len, flat, labels, source, pad_id, with_tokens)
    _same(*_both(lambda: _kernels.assemble_rows(*args)))


def test_small_inputs_take_numpy_until_a_kernel_is_loaded(monkeypatch):
    monkeypatch.setattr(_kernels, "_LOADED", None)
    assert not _kernels.compiled_for("next_fit", _kernels.SMALL - 1)
    assert _kernels.compiled_for("next_fit", _kernels.SMALL)
    with _kernels.forced("numba"):
        assert _kernels.compiled_for("next_fit", 1)
        with _kernels.forced("numpy"):
            assert not _kernels.compiled_for("next_fit", 10**9)
    with pytest.raises(ValueError, match="'numpy' or 'numba'"):
        _kernels.forced("c").__enter__()
    monkeypatch.undo()
    _kernels.next_fit(np.array([1, 2]), 4, 10)  # compiled_for is False or already loaded
    with _kernels.forced("numba"):
        _kernels.next_fit(np.array([1, 2]), 4, 10)
    assert _kernels.compiled_for("next_fit", 1)  # loaded now: it serves every size


def test_no_writable_cache_folder_compiles_in_memory_and_says_so(tmp_path):
    """A read-only install with a read-only home: numba finds no cache folder and raises when a
    kernel is declared cache=True; flexpack compiles without the cache, and the first compile
    says so (made to take "more than a second" by setting the threshold to 0)."""
    code = (
        "import numpy as np\n"
        "from flexpack import _kernels as K\n"
        "K._NOTICE_AFTER = 0.0\n"
        "with K.forced('numba'):\n"
        "    rows, n = K.next_fit(np.array([3, 2, 2], dtype=np.int64), 4, 10)\n"
        "print(rows.tolist(), n)\n"
    )
    # IPythonCacheLocator finds nothing for a file on disk: numba has no locator left, as when
    # every folder it tries is read-only (root writes anywhere, so that cannot be staged here).
    numba = pytest.importorskip("numba")
    if not hasattr(numba.config, "CACHE_LOCATOR_CLASSES"):  # numba < 0.61 has no such setting
        pytest.skip("this numba cannot be told to find no cache folder")
    env = {**os.environ, "NUMBA_CACHE_LOCATOR_CLASSES": "IPythonCacheLocator"}
    env.pop("NUMBA_CACHE_DIR", None)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[0, 1, 1] 2"
    assert "flexpack: compiling the next_fit kernel (numba" in done.stderr
    assert "not cached: no writable cache folder; set NUMBA_CACHE_DIR" in done.stderr
    assert " done in " in done.stderr
