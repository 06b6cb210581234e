"""The code-health limits CONTRIBUTING.md states, enforced over the product
(bus/, engine_node/, router_node/, trainer_bridge/, launcher/, launch.py): small rooms
(a file <= 600 lines, a function <= 80), no import cycle between project
modules (function-local imports count: a cycle hidden inside a function is
still a cycle), and no silent broad `except`.

Pure AST reads of the source tree: no process starts, no module is imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bus", "engine_node", "router_node", "trainer_bridge", "launcher")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
# A broad handler may hand the exception on (raise, or use the bound name in a
# reply/result) or log it; anything else swallows failures nobody will see.
BROAD = {"Exception", "BaseException"}
LOG_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "msg"}


def product_files() -> list[Path]:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    files.append(ROOT / "launch.py")
    return files


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_the_walk_finds_the_product() -> None:
    names = {module_name(p) for p in product_files()}
    assert {"bus.protocol", "engine_node.node", "router_node.router", "trainer_bridge.client", "launch"} <= names
    assert {"launcher.config", "engine_node.backends.vllm.backend", "engine_node.backends.torch.backend"} <= names
    assert {"trainer_bridge.skyrl.engine", "trainer_bridge.ray.cluster"} <= names


@pytest.mark.parametrize("path", product_files(), ids=rel)
def test_file_is_small(path: Path) -> None:
    lines = path.read_text().count("\n")
    assert lines <= MAX_FILE_LINES, f"{rel(path)} has {lines} lines (limit {MAX_FILE_LINES}): split it by concept"


def functions(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def test_functions_are_short() -> None:
    long = []
    for path in product_files():
        for fn in functions(parse(path)):
            length = (fn.end_lineno or fn.lineno) - fn.lineno + 1
            if length > MAX_FUNCTION_LINES:
                long.append(f"{rel(path)}:{fn.lineno} {fn.name} ({length} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def is_broad(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in BROAD for n in names)


def hands_on_or_logs(handler: ast.ExceptHandler) -> bool:
    for node in ast.walk(ast.Module(body=handler.body, type_ignores=[])):
        if isinstance(node, ast.Raise):
            return True
        if handler.name and isinstance(node, ast.Name) and node.id == handler.name:
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOG_METHODS:
            return True
    return False


def test_no_silent_broad_except() -> None:
    silent = []
    for path in product_files():
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.ExceptHandler) and is_broad(node) and not hands_on_or_logs(node):
                silent.append(f"{rel(path)}:{node.lineno}")
    assert not silent, "broad except handlers that neither re-raise, use the exception nor log:\n" + "\n".join(silent)


def test_the_except_rule_sees_a_silent_handler() -> None:
    tree = ast.parse(
        "try:\n    f()\nexcept Exception:\n    pass\ntry:\n    f()\nexcept Exception as e:\n    log.warning('x', error=str(e))\n"
    )
    handlers = [n for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler)]
    assert [hands_on_or_logs(h) for h in handlers] == [False, True]


def outside_type_checking(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import of a module, function bodies included, except those under
    `if TYPE_CHECKING:` (they never run, so they cannot form a runtime cycle)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in skip:
            yield node


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in product_files()}
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for mod, path in paths.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in outside_type_checking(parse(path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from pkg import sub` imports the submodule when one exists
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            graph[mod].update(t for t in targets if t in paths and t != mod)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def local_project_imports(path: Path) -> Iterator[tuple[int, str]]:
    lines = path.read_text().splitlines()
    tree = parse(path)
    seen: set[int] = set()
    for fn in functions(tree):
        for node in ast.walk(fn):
            if not isinstance(node, ast.Import | ast.ImportFrom) or id(node) in seen:
                continue
            seen.add(id(node))
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            project = node.level > 0 if isinstance(node, ast.ImportFrom) else False
            project = project or any(n.split(".")[0] in (*PACKAGES, "launch") for n in names)
            if project and "# lazy:" not in lines[node.lineno - 1]:
                yield node.lineno, ast.unparse(node)


def test_no_local_project_imports() -> None:
    """A project import inside a function hides an import cycle or a slow
    import; the second is legitimate (a backend that imports vLLM, the Ray
    placement) and says so with a `# lazy: <why>` comment on the line."""
    found = [f"{rel(p)}:{line} {text}" for p in product_files() for line, text in local_project_imports(p)]
    assert not found, "function-local project imports without '# lazy: <why>':\n" + "\n".join(found)


def shipped_packages() -> set[str]:
    """The packages a non-editable `pip install .` puts in site-packages, as
    pyproject.toml's [tool.setuptools] says (a listed `packages`, else `find`)."""
    tomllib = pytest.importorskip("tomllib")  # 3.11+; the 3.10 runs skip this check
    from setuptools import find_namespace_packages, find_packages

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    if "packages" in cfg and isinstance(cfg["packages"], list):
        return set(cfg["packages"])
    find = cfg["packages"]["find"]
    finder = find_namespace_packages if find.get("namespaces", False) else find_packages
    return set(finder(where=str(ROOT), include=find.get("include", ["*"]), exclude=find.get("exclude", ())))


def test_a_non_editable_install_ships_every_product_package() -> None:
    """Issue 35: the layout's subpackages (launcher/, backends/vllm/, skyrl/, ...)
    ship with `pip install .`; the hand-kept list before it had already dropped
    engine_node.transports and trainer_bridge.transports."""
    product = {module_name(p) for p in product_files() if p.name == "__init__.py"}
    missing = product - shipped_packages()
    assert not missing, f"packages pyproject.toml does not ship: {sorted(missing)}"
