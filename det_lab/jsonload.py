"""``loads``: JSON text to Python, through orjson where it can.

Listings and the exporter parse thousands of run records at a time; orjson (already installed
with DVC) parses them several times faster than the standard library. It refuses what the standard
library's ``json.dumps`` may write (``NaN``, ``Infinity``: a diverged loss) and integers beyond
64 bits; those, and damaged text, are parsed by ``json.loads``, so the result and the
``ValueError`` for damaged text are the standard library's.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(data: bytes | str) -> Any:
    """``json.loads(data)``, parsed by orjson when it can."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)
