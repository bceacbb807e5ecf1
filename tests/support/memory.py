"""This process's memory, as the kernel counts it."""
from __future__ import annotations

import os


def resident_bytes() -> int:
    """Bytes of this process resident in memory now (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
