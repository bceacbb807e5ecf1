"""What the kernel checks (layer_ops_check, fused_moe_check, fp8_check) share:
their command line and the loop that runs their cases.

A check module yields (name, (agrees, relative error)) per case from
`cases(device)`; run_checks prints each disagreement and a last line
`checked N cases, F failed`, which CI's interpreter tests read.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Iterable

Case = tuple[str, tuple[bool, float]]


def relative_error(out, ref) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    return float((out.float() - ref.float()).abs().max()) / max(float(ref.float().abs().max()), 1e-6)


def check_parser(module: str, doc: str) -> argparse.ArgumentParser:
    """The check's parser: --device, and the module docstring's first paragraph as description."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    return p


def run_checks(cases: Callable[[str], Iterable[Case]], device: str) -> int:
    """Exit status: 0 when every case agrees, 1 when one does not, 2 for
    the CPU without Triton's interpreter (the kernels cannot run there)."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("error: Triton kernels run on the CPU only under TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    failed = total = 0
    for name, (ok, err) in cases(device):
        total += 1
        if not ok:
            failed += 1
            print(f"FAIL {name}: relative error {err:.2e}")
    print(f"checked {total} cases, {failed} failed")
    return 1 if failed else 0
