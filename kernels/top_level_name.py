"""The top-level name `kernels`, which this folder shadows.

The repository keeps the architecture's layout, so this folder is
kernels/ at the root and installs as tandem.kernels (setup.py). While the
root is on sys.path (pytest, `python -m` run from the root) it is also
importable as top-level `kernels`, the name of Hugging Face's package, which
transformers 5.25 requires and imports (transformers.activations): ours
would be found first, and importing transformers failed. Imported under that
name, kernels/__init__.py hands it over to the installed package.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def hand_over(name: str, init_file: str) -> bool:
    """Put the package installed under `name` in sys.modules in place of this
    folder's, searching sys.path without the folder's parent; False where none
    is installed (transformers before 5.25 then reads ours as "not
    available": it has no __version__)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    # The import statement returns what sys.modules holds once this folder's
    # __init__ has run: the installed package.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return True
