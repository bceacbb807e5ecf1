"""A process started with die_with_parent ends when its parent is killed
outright (SIGKILL: no cleanup of the parent's runs)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

# The parent starts a child that would sleep for a minute, prints its pid, then waits.
PARENT = """
import subprocess, sys, time
from tandem.services.common.parent_death import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn={hook})
print(child.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("hook,ends", [("die_with_parent", True), ("None", False)])
def test_the_child_ends_with_its_killed_parent(hook, ends):
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(hook=hook)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + (10 if ends else 1)  # without the hook: still there after 1 s
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(child) is not ends
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
