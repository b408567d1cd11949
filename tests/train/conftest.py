"""Shared by the recipe tests: a fake machine's Python packages (two roots, files to keep and files to skip)."""
from __future__ import annotations

import pytest

PACKAGES = [f"pkg{i}" for i in range(12)]


def _module_text(package: str, name: str, n_funcs: int) -> str:
    lines = [f'"""Module {name} of {package}."""', "import os", ""]
    for i in range(n_funcs):
        lines += [f"def {name}_{i}(x, y={i}):", f"    total = x * {i % 7} + y", "    for k in range(3):",
                  f"        total += k * {package!r}.__len__()", "    return total", ""]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def fake_site(tmp_path_factory):
    """Two roots of fake packages: directories with submodules, single-file modules, and things to skip."""
    base = tmp_path_factory.mktemp("site")
    roots = [base / "stdlib", base / "site-packages"]
    for root in roots:
        root.mkdir()
    for i, package in enumerate(PACKAGES):
        root = roots[i % 2]
        if i % 3 == 2:  # a single-file module
            (root / f"{package}.py").write_text(_module_text(package, "mod", 30))
            continue
        (root / package / "sub").mkdir(parents=True)
        (root / package / "__init__.py").write_text(f"from .core import *  # {package}\n")
        for j, name in enumerate(["core", "util", "io"]):
            (root / package / f"{name}.py").write_text(_module_text(package, name, 25 + j))
        (root / package / "sub" / "deep.py").write_text(_module_text(package, "deep", 20))
        (root / package / "__pycache__").mkdir()
        (root / package / "__pycache__" / "x.py").write_text("skipped = True\n")
    (roots[1] / "pkg1").joinpath("latin1.py").write_bytes(b"s = '\xe9'\n")  # not UTF-8: skipped
    (roots[1] / "pkg0-1.0.dist-info").mkdir()
    (roots[1] / "pkg0-1.0.dist-info" / "meta.py").write_text("x = 1\n")
    (roots[1] / "__editable___pkg9_1_0_finder.py").write_text("MAPPING = {}\n")  # pip install -e: skipped
    (roots[1] / "pkg1").joinpath("big.py").write_text("# " + "x" * (1 << 20) + "\n")  # over 1 MB: skipped
    return [str(r) for r in roots]
