"""Traffic classes of the prefix store: each class's retention, and the check of a configured set."""

from __future__ import annotations

import re

DAY_S = 86400.0
DEFAULT_TRAFFIC_TTL_S: dict[str, float] = {"agent": 3 * DAY_S, "chat": 7 * DAY_S}
"""The seed system's retention: agent traffic 3 days, chat 7 days."""
DEFAULT_TRAFFIC_CLASS = "chat"
_CLASS_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


def check_traffic_classes(ttl_s: dict[str, float], default_class: str) -> None:
    """Raise `ValueError` for a bad class name, a TTL <= 0, or a default class without a TTL."""
    for name, ttl in ttl_s.items():
        if not _CLASS_NAME.match(name):
            raise ValueError(f"traffic class {name!r} must be 1-32 of a-z, 0-9, '_' and '-' (a directory name)")
        if not ttl > 0:
            raise ValueError(f"traffic class {name!r} needs a TTL > 0 seconds, got {ttl}")
    if default_class not in ttl_s:
        raise ValueError(f"the default traffic class {default_class!r} has no TTL; classes: {sorted(ttl_s)}")
