"""The dependency direction of DESIGN §1, checked on the source tree and on a live import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "training", "validator", "node")
P2P_LIBS = {"libp2p", "trio"}
P2P_PACKAGE = "node/net/p2p/"

FORBIDDEN = {
    "protocol": {
        "training",
        "validator",
        "node",
        "torch",
        "transformers",
        "safetensors",
        *P2P_LIBS,
        "asyncio",
        "aiohttp",
    },
    "training": {"validator", "node", *P2P_LIBS, "asyncio", "aiohttp"},
    "validator": {"node", *P2P_LIBS, "aiohttp"},
    "node": set(),
}


def imported_roots(path: Path) -> set[str]:
    """Top-level names of every module `path` imports (relative imports resolved to our packages)."""
    package = path.relative_to(ROOT).parts[0]
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            roots.add(package if node.level else (node.module or "").split(".")[0])
    return roots


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_imports_go_one_way() -> None:
    violations = [
        f"{path.relative_to(ROOT)} imports {name}"
        for package in PACKAGES
        for path in sources(package)
        for name in sorted(imported_roots(path) & FORBIDDEN[package])
    ]
    assert not violations, "\n".join(violations)


def test_only_the_p2p_package_touches_libp2p_or_trio() -> None:
    users = [str(p.relative_to(ROOT)) for p in sources("node") if imported_roots(p) & P2P_LIBS]
    outside = [user for user in users if not user.startswith(P2P_PACKAGE)]
    assert users and not outside, f"libp2p/trio imported outside {P2P_PACKAGE}: {outside}"


def test_the_scan_sees_imports() -> None:
    roots = imported_roots(ROOT / "protocol" / "check.py")
    assert {"protocol", "collections", "dataclasses"} <= roots


def test_importing_protocol_pulls_in_no_heavy_library() -> None:
    code = (
        "import importlib, pkgutil, sys, protocol\n"
        "for m in pkgutil.iter_modules(protocol.__path__):\n"
        "    importlib.import_module('protocol.' + m.name)\n"
        "heavy = {'torch', 'transformers', 'safetensors', 'libp2p', 'trio', 'aiohttp'}\n"
        "heavy = sorted(heavy & set(sys.modules))\n"
        "assert len([m for m in sys.modules if m.startswith('protocol.')]) >= 8, sys.modules\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
