"""No docstring example is skipped whole: pytest would report it as ``_pytest/doctest.py:464``,
which names nothing. Examples that cannot run here (Ray, LitGPT) are literal blocks that name
the test which runs the same code instead."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import flexpack


def test_no_doctest_is_skipped_whole():
    finder = doctest.DocTestFinder()
    skipped = []
    for info in pkgutil.walk_packages(flexpack.__path__, "flexpack."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for test in finder.find(module):
            examples = test.examples
            if examples and all(e.options.get(doctest.SKIP) for e in examples):
                skipped.append(test.name)
    assert skipped == []
