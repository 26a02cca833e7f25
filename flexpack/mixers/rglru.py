"""(being written)"""

from __future__ import annotations

ROOMS: tuple = ()
