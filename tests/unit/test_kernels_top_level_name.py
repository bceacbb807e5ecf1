"""kernels/ at the repository root against Hugging Face's `kernels` package
(kernels/top_level_name.py): with the root on sys.path, as under pytest or
`python -c` run from the root, importing transformers works and top-level
`kernels` is the installed package, while tandem.kernels stays ours."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CODE = """
import importlib.machinery, os, sys
root = os.getcwd()
assert sys.path[0] in ("", root), sys.path[:2]  # the root is first: our folder is found as `kernels`
installed = importlib.machinery.PathFinder.find_spec("kernels", [p for p in sys.path if p not in ("", root)])
import transformers.activations  # transformers 5.25 imports `kernels` here
from transformers import LlamaConfig
import kernels
import tandem.kernels
print("installed" if installed else "absent", kernels.__file__, tandem.kernels.__file__)
assert tandem.kernels.paged_attention is not None
if installed:
    assert kernels.__file__ == installed.origin, (kernels.__file__, installed.origin)
    assert os.path.dirname(kernels.__file__) != os.path.join(root, "kernels"), kernels.__file__
else:  # ours under that name, empty: no __version__, so transformers deems it missing
    assert not hasattr(kernels, "__version__") and not hasattr(kernels, "paged_attention")
"""


def test_transformers_imports_and_gets_the_installed_kernels_package_from_the_repository_root():
    result = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    where, top_level, ours = result.stdout.split()
    assert ours == os.path.join(ROOT, "kernels", "__init__.py")
