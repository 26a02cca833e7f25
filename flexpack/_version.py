"""flexpack's version, on the ground floor: modules read it without importing the package face."""

from __future__ import annotations

import importlib.metadata


def _version() -> str:
    try:
        return importlib.metadata.version("flexpack")
    except importlib.metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return "0.2.0"


__version__ = _version()
