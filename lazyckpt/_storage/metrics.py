"""Bytes read from storage, from tensorstore's own counters."""

from __future__ import annotations

import tensorstore as ts


def bytes_read() -> int:
    """Total bytes tensorstore has read from any kvstore in this process so far."""
    total = 0
    for metric in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/"):
        if metric["name"].endswith("/bytes_read"):
            total += sum(int(v.get("value", 0)) for v in metric["values"])
    return total
