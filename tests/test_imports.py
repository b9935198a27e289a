"""The package's modules import each other without cycles: every import counts, the ones inside
functions included (a cycle hidden there still ties two modules together); imports only for
type checking (``if TYPE_CHECKING:``) do not run and do not count."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# where each installed package's modules live in the checkout (pyproject's package-dir)
PACKAGES = {
    "sglang_ext": ROOT / "sglang_ext",
    "sglang_ext.policies": ROOT / "policies",
    "sglang_ext.kernels": ROOT / "kernels",
    "sglang_ext.server": ROOT / "server",
}


def package_modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            if package == "sglang_ext" and parts and f"sglang_ext.{parts[0]}" in PACKAGES:
                continue  # not a module of the installed package
            modules[name] = path
    return modules


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported(tree: ast.AST, name: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name if is_package else name.rsplit(".", 1)[0]
                anchor = anchor.rsplit(".", node.level - 1)[0] if node.level > 1 else anchor
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:  # a submodule by name, else the module itself
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {module for module in found if module in modules and module != name}


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {
        name: imported(ast.parse(path.read_text()), name, path.name == "__init__.py", modules)
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "sglang_ext.policies.lethe.runtime" in graph["sglang_ext.policies.lethe.policy"]
    assert "sglang_ext.kernels.rasr" in graph["sglang_ext.policies.lethe.runtime"]
    assert {"sglang_ext.engine", "sglang_ext.launch"} <= graph.keys()


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_among_the_package_modules():
    assert cycles(import_graph()) == []


def test_a_checkout_on_the_path_imports_as_installed(tmp_path):
    """Without the install's finders, a checkout on PYTHONPATH still has sglang_ext.policies."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
        "import sglang_ext.policies, sglang_ext.kernels.rasr, sglang_ext.server.validation\n"
        "print(sglang_ext.policies.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == str(ROOT / "policies" / "__init__.py")
