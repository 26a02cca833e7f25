"""Extract the demo corpus from the Python standard library's own docstrings (run once, committed).

The text is real English prose written by the CPython developers and distributed under the Python
Software Foundation License (permissive; see ``CORPUS_LICENSE.md``). Nothing is downloaded: the
docstrings come from the modules installed with the interpreter that runs this script.

    python flexpack/assets/make_corpus.py  # writes flexpack/assets/corpus.jsonl

Each line of ``corpus.jsonl`` is ``{"source": "module.qualname", "text": "..."}``. The documents
vary in length from a sentence to a page, which is what makes packing worth it.
"""

from __future__ import annotations

import codecs
import importlib
import inspect
import json
import random
import sys
import warnings
from pathlib import Path

# Pure-Python modules with well-written docstrings; a fixed list keeps the corpus reproducible.
MODULES = [
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "cmd", "codecs",
    "collections", "colorsys", "concurrent.futures", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "dis", "email", "enum", "fileinput",
    "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "gzip",
    "hashlib", "heapq", "hmac", "html", "http.client", "http.server", "imaplib", "inspect",
    "ipaddress", "json", "logging", "lzma", "mailbox", "mimetypes", "numbers", "operator",
    "optparse", "os", "pathlib", "pickle", "pickletools", "platform", "plistlib", "pprint",
    "profile", "queue", "quopri", "random", "re", "reprlib", "sched", "secrets", "selectors",
    "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver", "statistics", "string",
    "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "token",
    "tokenize", "trace", "traceback", "turtle", "types", "typing", "unittest", "urllib.parse",
    "urllib.request", "uuid", "warnings", "wave", "weakref", "webbrowser", "xml.dom.minidom",
    "zipfile", "zipimport",
]  # fmt: skip
MIN_CHARS, MAX_CHARS, TARGET_DOCS, SEED = 80, 6000, 600, 0


def zen_of_python() -> str:
    import this  # prints the Zen on first import; its text is rot13 in `this.s`

    return codecs.decode(this.s, "rot13")


def docstrings(module_name: str):
    """Yield (source, docstring) for a module, its public classes, functions and methods."""
    module = importlib.import_module(module_name)
    doc = inspect.getdoc(module)
    if doc:
        yield module_name, doc
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        doc = inspect.getdoc(obj)
        if doc:
            yield f"{module_name}.{name}", doc
        if inspect.isclass(obj):
            for attr, member in sorted(vars(obj).items()):
                if attr.startswith("_") or not inspect.isfunction(member):
                    continue
                doc = inspect.getdoc(member)
                if doc:
                    yield f"{module_name}.{name}.{attr}", doc


def main() -> None:
    warnings.simplefilter("ignore")
    seen: set[str] = set()
    docs = []
    for module_name in MODULES:
        try:
            items = list(docstrings(module_name))
        except ImportError:
            continue
        for source, text in items:
            text = text.strip()
            if MIN_CHARS <= len(text) <= MAX_CHARS and text not in seen:
                seen.add(text)
                docs.append({"source": source, "text": text})
    rng = random.Random(SEED)
    docs = rng.sample(docs, min(TARGET_DOCS, len(docs)))
    docs.insert(0, {"source": "this (The Zen of Python)", "text": zen_of_python().strip()})
    out = Path(__file__).with_name("corpus.jsonl")
    with out.open("w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
    n_bytes = sum(len(d["text"].encode()) for d in docs)
    print(
        f"{len(docs)} documents, {n_bytes} bytes of text, Python {sys.version.split()[0]} -> {out}"
    )


if __name__ == "__main__":
    main()
