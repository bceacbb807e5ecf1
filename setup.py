"""Build glue that pyproject.toml cannot express declaratively.

1. The repository keeps the layout of the architecture (engine/, kernels/,
   services/, bench/, protos/) while the import tree is one package,
   `tandem`: engine/ becomes tandem.engine and so on. Generic top-level names
   such as `kernels` would collide with real PyPI packages.
2. gRPC stubs are generated from protos/tandem/v1/*.proto at build time (also
   for editable installs) and are never committed.
"""
from __future__ import annotations

import glob
import os

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
FOLDERS = {  # import name -> folder
    "tandem.engine": "engine",
    "tandem.kernels": "kernels",
    "tandem.services": "services",
    "tandem.bench": "bench",
    "tandem.v1": "protos/tandem/v1",
}


def discover_packages() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    for name, folder in FOLDERS.items():
        for dirpath, _dirs, files in os.walk(os.path.join(ROOT, folder)):
            if "__init__.py" not in files or "__pycache__" in dirpath:
                continue
            rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
            packages.append(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    return packages, dict(FOLDERS)


def generate_grpc_stubs() -> None:
    from grpc_tools import protoc  # build requirement, see pyproject.toml

    import grpc_tools

    protos = sorted(glob.glob(os.path.join(ROOT, "protos", "tandem", "v1", "*.proto")))
    if not protos:
        return
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    out = os.path.join(ROOT, "protos")
    args = ["grpc_tools.protoc", f"-I{out}", f"-I{include}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + " ".join(protos))


class BuildWithStubs(build_py):
    def run(self) -> None:
        generate_grpc_stubs()
        super().run()


packages, package_dir = discover_packages()
setup(packages=packages, package_dir=package_dir, package_data={"tandem.v1": ["*.proto", "*.pyi"]},
      cmdclass={"build_py": BuildWithStubs})
