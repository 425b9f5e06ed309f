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


def imported_modules(path: Path) -> set[str]:
    """Dotted names of every absolute import in `path` (`from a.b import c` gives a.b and a.b.c)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


# Rooms of node/ (DESIGN §1, issue 15): a room may not reach into the rooms listed for it.
ROOMS_FORBIDDEN = {
    "node/net/": ("node.duties", "node.runtime", "node.sim", "node.cli"),
    "node/store/": ("node.duties", "node.runtime.http", "node.runtime.daemon", "node.net", "node.sim", "node.cli"),
    "node/duties/": ("node.sim", "node.cli", "node.net.p2p", "node.net.twin"),
    "node/runtime/": ("node.sim", "node.cli", "node.duties"),
}


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


def test_node_rooms_only_reach_the_rooms_below_them() -> None:
    violations = []
    for path in sources("node"):
        rel = str(path.relative_to(ROOT))
        for room, forbidden in ROOMS_FORBIDDEN.items():
            if rel.startswith(room):
                violations += [f"{rel} imports {name}" for name in sorted(imported_modules(path))
                               if any(name == f or name.startswith(f + ".") for f in forbidden)]
    assert not violations, "\n".join(violations)


def test_only_the_command_line_uses_the_simulation_package() -> None:
    users = [str(p.relative_to(ROOT)) for p in sources("node") if any(
        m == "node.sim" or m.startswith("node.sim.") for m in imported_modules(p))]
    outside = [u for u in users if not u.startswith(("node/sim/", "node/cli/"))]
    assert users and not outside, f"node.sim imported outside node/sim and node/cli: {outside}"


def test_the_scan_sees_imports() -> None:
    roots = imported_roots(ROOT / "protocol" / "check.py")
    assert {"protocol", "collections", "dataclasses"} <= roots
    assert {"node.net.judge", "node.store.blobs.BlobStore"} <= imported_modules(ROOT / "node" / "net" / "twin.py")


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
