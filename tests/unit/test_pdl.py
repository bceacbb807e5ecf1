"""Programmatic dependent launch (kernels/common_triton.py): a kernel
launched with launch_pdl may start before the kernel ahead of it in the
stream has finished, so it must wait (pdl_prologue) before it touches
memory that kernel may write (before it, a kernel may only read what no
kernel of a step writes, such as weights). These run on the CPU: the GPU
timing is in docs/benchmarks.md and tests/gpu runs the kernels with it on."""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "kernels"


def _launches_with_pdl(tree: ast.Module) -> set[str]:
    """Names of the kernels launched as NAME[grid](..., launch_pdl=...) or
    with **pdl_launch(t) (directly, or through a name assigned it)."""
    bound = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and _calls_pdl_launch(n.value)
             for t in n.targets if isinstance(t, ast.Name)}
    names = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name)
                and any(k.arg == "launch_pdl" or (k.arg is None and (_calls_pdl_launch(k.value) or (
                    isinstance(k.value, ast.Name) and k.value.id in bound))) for k in node.keywords)):
            names.add(node.func.value.id)
    return names


def _calls_pdl_launch(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "pdl_launch"


# Kernels that read memory no kernel of a step writes before they wait, and
# which pointer parameters those are: the GEMVs' first weight tile.
READ_BEFORE_WAIT = {"gemv_triton.py:_gemv_kernel": {"w_ptr"}, "gemv_triton.py:_gemv_rows_kernel": {"w_ptr"},
                    "gemv_triton.py:_gemv_pair_kernel": {"w_ptr"}}


def _waits_before_touching_other_kernels_memory(fn: ast.FunctionDef, may_read: set[str]) -> bool:
    """pdl_prologue is a statement of fn's body, and nothing before it
    stores, or names a pointer parameter outside may_read."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    at = next((i for i, s in enumerate(body) if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
               and getattr(s.value.func, "id", None) == "pdl_prologue"), None)
    if at is None:
        return False
    pointers = {a.arg for a in fn.args.args if a.arg.endswith("_ptr")} - may_read
    before = [n for s in body[:at] for n in ast.walk(s)]
    named = {n.id for n in before if isinstance(n, ast.Name)}
    stores = [n for n in before if isinstance(n, ast.Attribute) and (n.attr == "store" or n.attr.startswith("atomic"))]
    return not (named & pointers) and not stores


def test_every_kernel_launched_with_pdl_waits_before_touching_what_kernels_write():
    launched = {}
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        for name in _launches_with_pdl(tree):
            key = f"{path.name}:{name}"
            launched[key] = _waits_before_touching_other_kernels_memory(functions[name],
                                                                        READ_BEFORE_WAIT.get(key, set()))
    # the decode step's kernels: norm, rotary and KV write (alone and in one
    # launch), attention and its reduce, SiLU-and-multiply, the FP8
    # quantizer, GEMVs (one row, two rows, a few rows) and skinny GEMM; the
    # MoE routing, alignment, gate/up, down and the sum of a token's k rows
    assert len(launched) == 17, sorted(launched)
    assert all(launched.values()), [k for k, ok in launched.items() if not ok]


def test_the_prologue_is_grid_dependency_control_on_hopper_and_nothing_without():
    """Compiled for sm90 on this machine (no GPU needed): with PDL the wait
    comes before the kernel's first global load; without, no such instruction."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tandem.kernels.cache_write import _write_kv_kernel

    signature = {name: "*bf16" for name in ("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr")}
    signature["slot_mapping_ptr"] = "*i64"
    signature.update({name: "i32" for name in ("stride_key_tok", "stride_key_head", "stride_value_tok",
                                                "stride_value_head", "stride_cache_block", "stride_cache_slot",
                                                "stride_cache_head")})
    signature.update({"k_scale": "fp32", "v_scale": "fp32"})
    constexprs = {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "HEADS_PAD": 8, "BLOCK_SIZE": 16, "FP8": False,
                  "SCALED": False}
    signature.update({name: "constexpr" for name in (*constexprs, "PDL")})
    for pdl in (False, True):
        source = ASTSource(fn=_write_kv_kernel, signature=signature, constexprs={**constexprs, "PDL": pdl})
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 4, "launch_pdl": pdl}).asm["ptx"]
        if not pdl:
            assert "griddepcontrol" not in ptx
            continue
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
        assert "griddepcontrol.launch_dependents" in ptx


def test_pdl_is_off_for_cpu_tensors_and_under_tandem_pdl_0(monkeypatch):
    from tandem.kernels import common_triton

    assert not common_triton.pdl_enabled(torch.zeros(1))
    assert common_triton.pdl_launch(torch.zeros(1)) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setenv("TANDEM_PDL", "0")
    common_triton._pdl_on.cache_clear()
    try:
        assert common_triton._pdl_on(0) is False  # decided before any CUDA call
    finally:
        common_triton._pdl_on.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pdl_follows_the_device_capability():
    from tandem.kernels import common_triton

    common_triton._pdl_on.cache_clear()
    expected = torch.cuda.get_device_capability(0) >= (9, 0)
    assert common_triton.pdl_enabled(torch.zeros(1, device="cuda")) == expected
