"""Importing the router's modules loads no torch and no model code: the
engine package exports its names lazily and the loader imports torch only
where weights are loaded. (At start the router still loads torch through
transformers' AutoConfig, which reads the model's context length; engines
reporting it to the router is what removes that.)"""
from __future__ import annotations

import subprocess
import sys


def test_importing_the_router_loads_no_torch():
    code = ("import sys, tandem.services.router.app, tandem.services.router.server, "
            "tandem.services.router.grpc_api, tandem.engine.request, tandem.engine.loader; "
            "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('tandem.engine.model') "
            "or m.startswith('tandem.kernels')); print(heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_engine_package_still_exports_its_names():
    import tandem.engine as engine

    assert set(engine.__all__) <= set(dir(engine))
    for name in engine.__all__:
        assert getattr(engine, name).__name__ == name
