"""The dependency direction of DESIGN §1, checked on the source tree and on a live import; and what no product
module may do to the process: patch torch's or transformers' weight inits, set torch's threads or the
environment on import, or grow past 500 lines; and no import circles among product modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "training", "miner", "validator", "node")
PRODUCT = (*PACKAGES, "bench")
MAX_LINES = 500
P2P_LIBS = {"libp2p", "trio"}
P2P_PACKAGE = "node/net/p2p/"

FORBIDDEN = {
    "protocol": {
        "training",
        "miner",
        "validator",
        "node",
        "torch",
        "transformers",
        "safetensors",
        *P2P_LIBS,
        "asyncio",
        "aiohttp",
    },
    "training": {"miner", "validator", "node", *P2P_LIBS, "asyncio", "aiohttp"},
    "miner": {"validator", "node", *P2P_LIBS, "asyncio", "aiohttp"},
    "validator": {"miner", "node", *P2P_LIBS, "aiohttp"},
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
    "node/store/": ("node.duties", "node.runtime", "node.net", "node.sim", "node.cli"),
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


# The duties shared by both roles (consensus, results, plans, reports) are protocol: only a role's own duty reaches
# into its role's package, so a miner's round never passes through validator/ (ranking is protocol.ranking's).
ROLE_DUTIES = {"validator": ("node/duties/validator.py",), "miner": ("node/duties/miner.py", "node/duties/feedback.py")}


def test_only_a_roles_own_duty_reaches_into_its_package() -> None:
    violations = [f"{path.relative_to(ROOT)} imports {name}" for path in sources("node/duties")
                  for name in sorted(imported_modules(path)) for role, own in ROLE_DUTIES.items()
                  if name.split(".")[0] == role and str(path.relative_to(ROOT)) not in own]
    assert not violations, "\n".join(violations)
    assert "validator.merge.rank_reports" not in imported_modules(ROOT / "node/duties/results.py")


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


# -- What no product module does to the process ----------------------------------------------------------

INIT_MODULES = ("torch.nn.init", "transformers.initialization")
THREAD_SETTERS = {"torch.set_num_threads", "torch.set_num_interop_threads"}
ENVIRON_WRITERS = {"os.putenv", "os.unsetenv", *(f"os.environ.{m}" for m in ("update", "setdefault", "pop",
                                                                                 "popitem", "clear", "__setitem__"))}


def product_sources() -> list[Path]:
    return [path for package in PRODUCT for path in sources(package)]


def import_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted name it stands for, from every import in the module."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    root = alias.name.split(".")[0]
                    aliases[root] = root
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def dotted(expr: ast.expr, aliases: dict[str, str]) -> str | None:
    """`a.b.c` as the dotted name it stands for (imports resolved), or None for anything else."""
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    return ".".join([aliases.get(expr.id, expr.id), *reversed(parts)])


def is_init_target(name: str | None) -> bool:
    """Whether `name` is a weight-init module of torch or transformers, or a function in one."""
    return name is not None and (
        any(name == m or name.startswith(m + ".") for m in INIT_MODULES)
        or (name.startswith("transformers.") and "init" in name.rsplit(".", 1)[-1]))


def init_patches(source: str) -> list[str]:
    """Assignments and setattr calls that rewrite torch's or transformers' weight-init functions."""
    tree = ast.parse(source)
    aliases = import_aliases(tree)
    # names bound to several objects at once: `MODULES = (a, b)` and `for m in (a, b)` (or `in MODULES`)
    groups: dict[str, list[ast.expr]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple | ast.List):
            groups.update({t.id: node.value.elts for t in node.targets if isinstance(t, ast.Name)})
    for node in ast.walk(tree):
        if isinstance(node, ast.For | ast.comprehension) and isinstance(node.target, ast.Name):
            items = node.iter
            elts = items.elts if isinstance(items, ast.Tuple | ast.List) else (
                groups.get(items.id, []) if isinstance(items, ast.Name) else [])
            groups.setdefault(node.target.id, []).extend(elts)

    def names(expr: ast.expr) -> list[str | None]:
        if isinstance(expr, ast.Name) and expr.id in groups:
            return [dotted(e, aliases) for e in groups[expr.id]]
        return [dotted(expr, aliases)]

    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and any(
                    is_init_target(f"{n}.{target.attr}") for n in names(target.value) if n):
                found.append(f"line {node.lineno}: assigns {ast.unparse(target)}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
                and node.args and any(is_init_target(n) for n in names(node.args[0]))):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def import_time_nodes(tree: ast.Module) -> list[ast.AST]:
    """Every node that runs when the module is imported: not function bodies, not `if __name__ == "__main__"`."""
    pending: list[ast.AST] = list(tree.body)
    seen: list[ast.AST] = []
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"':
            pending.extend(node.orelse)
            continue
        seen.append(node)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            pending.extend([*node.decorator_list, *node.args.defaults,
                            *(d for d in node.args.kw_defaults if d is not None)])
        elif isinstance(node, ast.Lambda):
            pending.extend(node.args.defaults)
        else:
            pending.extend(ast.iter_child_nodes(node))
    return seen


def import_time_process_changes(source: str) -> list[str]:
    """Calls to torch.set_num_threads and writes to os.environ that run when the module is imported."""
    tree = ast.parse(source)
    aliases = import_aliases(tree)
    found = []
    for node in import_time_nodes(tree):
        if isinstance(node, ast.Call) and dotted(node.func, aliases) in THREAD_SETTERS | ENVIRON_WRITERS:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        found += [f"line {node.lineno}: writes {ast.unparse(t)}" for t in targets
                  if isinstance(t, ast.Subscript) and dotted(t.value, aliases) == "os.environ"]
    return found


def test_no_module_patches_torch_or_transformers_weight_inits() -> None:
    violations = [f"{path.relative_to(ROOT)} {found}" for path in product_sources()
                  for found in init_patches(path.read_text(encoding="utf-8"))]
    assert not violations, "pass a torch.Generator instead of rewriting the init functions:\n" + "\n".join(violations)


def test_no_module_sets_threads_or_the_environment_on_import() -> None:
    violations = [f"{path.relative_to(ROOT)} {found}" for path in product_sources()
                  for found in import_time_process_changes(path.read_text(encoding="utf-8"))]
    assert not violations, "importing a module must not change the process:\n" + "\n".join(violations)


def test_the_process_scans_see_what_they_forbid() -> None:
    patched = (
        "import torch\nimport torch.nn.init as tinit\nimport transformers.initialization as hf_init\n"
        "from transformers import modeling_utils\n"
        "torch.nn.init.normal_ = draw\n"
        "tinit.uniform_ = draw\n"
        "modeling_utils._init_weights = draw\n"
        "for _module in (torch.nn.init, hf_init):\n"
        "    for _name in NAMES:\n"
        "        setattr(_module, _name, draw)\n"
    )
    assert len(init_patches(patched)) == 4
    assert init_patches("import torch\nsetattr(model.get_submodule(m), a, torch.nn.Parameter(x))\n") == []
    on_import = (
        "import os\nimport torch\nfrom os import environ\n"
        "torch.set_num_threads(1)\n"
        "os.environ['A'] = '1'\n"
        "environ.setdefault('B', '1')\n"
        "class C:\n    os.environ.update(D='1')\n"
        "def f(x=torch.set_num_threads(2)):\n    torch.set_num_threads(1)\n    os.environ['E'] = '1'\n"
        "if __name__ == '__main__':\n    torch.set_num_threads(4)\n"
    )
    assert len(import_time_process_changes(on_import)) == 5


def test_no_product_file_exceeds_the_line_limit() -> None:
    long = [f"{path.relative_to(ROOT)}: {n} lines" for package in PRODUCT if (ROOT / package).is_dir()
            for path in sorted((ROOT / package).rglob("*")) if path.suffix in (".py", ".js", ".html", ".css")
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES]
    assert not long, f"split these files (at most {MAX_LINES} lines each):\n" + "\n".join(long)


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_two_product_modules_import_each_other_even_through_others() -> None:
    """Import circles, counting every import (also those only for type checking or inside a function): a module
    that needs another's names while that one needs its own has two jobs tangled, or one in the wrong room."""
    modules = {_module_of(path): path for package in PACKAGES for path in sources(package)}
    graph = {name: {m for m in imported_modules(path) if m in modules and m != name and not name.startswith(m + ".")}
             for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(name: str) -> None:  # Tarjan's strongly connected components
        index[name] = low[name] = len(index)
        stack.append(name)
        for other in sorted(graph[name]):
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == name:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)
