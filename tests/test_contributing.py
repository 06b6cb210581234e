"""CONTRIBUTING.md names real code: every path, module, class, function and
`Class.member` it quotes in backticks exists in the tree (private names and
inherited members included). A refactor that moves code without updating the
guide fails here instead of misleading the next contributor.

AST reads only; nothing is imported.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "CONTRIBUTING.md"
SOURCES = ("bus", "engine_node", "router_node", "trainer_bridge", "bench", "tests")
ALIASES = {"P": "protocol"}  # `P.Ack`: the guide writes protocol types as the code imports them
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


class Index:
    """Every name the tree defines: modules, top-level names, and per class its
    members (methods, class attributes, `self.x` assignments) and bases."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.names: set[str] = set()
        self.members: dict[str, set[str]] = {}
        self.bases: dict[str, set[str]] = {}
        files = [p for d in SOURCES for p in (ROOT / d).rglob("*.py")] + list(ROOT.glob("*.py"))
        for path in files:
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            self.modules.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
            self.names.add(parts[-1])
            self._read(ast.parse(path.read_text()))

    def _read(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                self.names.add(node.name)
                self.bases.setdefault(node.name, set()).update(ast.unparse(b).split(".")[-1] for b in node.bases)
                self.members.setdefault(node.name, set()).update(self._class_members(node))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                self.names.update(t.id for t in targets if isinstance(t, ast.Name))

    @staticmethod
    def _class_members(cls: ast.ClassDef) -> set[str]:
        found: set[str] = set()
        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                found.add(node.target.id)
            elif isinstance(node, ast.Assign):
                found.update(t.id for t in node.targets if isinstance(t, ast.Name))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                found.add(node.attr)
        return found

    def has_member(self, cls: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
        if member in self.members.get(cls, set()):
            return True
        return any(self.has_member(b, member, seen | {cls}) for b in self.bases.get(cls, set()) - seen)

    def resolves(self, ref: str) -> bool:
        head, *rest = ref.split(".")
        if head not in self.names and head not in self.modules and head not in ALIASES and external(head):
            return True
        head = ALIASES.get(head, head)
        if not rest:  # a bare name: defined anywhere, a class member included
            return head in self.names or head in self.modules or any(head in m for m in self.members.values())
        dotted = ".".join([head, *rest])
        if dotted in self.modules:
            return True
        # module.name or module.Class.member, then Class.member (inherited too)
        for cut in range(len(rest), 0, -1):
            module = ".".join([head, *rest[: cut - 1]])
            if module in self.modules or module.endswith(f".{head}") or module == head:
                tail = rest[cut - 1 :]
                if len(tail) == 1 and tail[0] in self.names:
                    return True
                if len(tail) == 2 and self.has_member(tail[0], tail[1]):
                    return True
        return len(rest) == 1 and self.has_member(head, rest[0])


def external(name: str) -> bool:
    """A builtin (`ValueError`) or an installed third-party module (`msgspec`)."""
    return hasattr(builtins, name) or (name.islower() and importlib.util.find_spec(name) is not None)


def quoted() -> list[str]:
    return re.findall(r"`([^`\n]+)`", GUIDE.read_text())


FILE = r"[\w.*-]+\.(md|py|sh|toml|json|png|txt|yaml)"


def paths_in(token: str) -> list[str]:
    """`dir/file.py`, `dir/`, `dir/sub/*.py` and bare `file.py` names."""
    found = []
    for word in token.split():
        if re.fullmatch(rf"\.?[\w-]+(/[\w.*-]+)*/({FILE})?", word) or re.fullmatch(
            rf"\.?[\w-]+(/[\w*-]+)*/{FILE}", word
        ):
            found.append(word)
        elif re.fullmatch(FILE, word) and "*" not in word:
            found.append(word)
    return found


def path_exists(path: str) -> bool:
    if "/" not in path:  # a bare file name is one at the root (launch.py): elsewhere, give its path
        return (ROOT / path).exists()
    return bool(list(ROOT.glob(path.rstrip("/"))))


def refs_in(token: str) -> list[str]:
    """Code references in a quoted token: `A.b`, `A.b/c/d` (members of one
    class), `f(...)` calls, CamelCase, snake_case, _private and CONSTANT names.
    Single lowercase words are left alone: they are op names, flags and prose."""
    token = token.split("(")[0].strip()
    if re.fullmatch(FILE, token) or not re.fullmatch(rf"{IDENT}(\.{IDENT})*(/{IDENT})*", token):
        return []
    first, *alternatives = token.split("/")
    refs = [first]
    if alternatives and "." in first:
        owner = first.rsplit(".", 1)[0]
        refs += [f"{owner}.{alt}" for alt in alternatives]
    return [r for r in refs if "." in r or "_" in r or r[0].isupper() or (r.isupper() and len(r) > 1)]


def test_the_guide_quotes_code() -> None:
    tokens = quoted()
    assert sum(len(paths_in(t)) for t in tokens) >= 10 and sum(len(refs_in(t)) for t in tokens) >= 20


def test_every_quoted_path_exists() -> None:
    missing = []
    for token in quoted():
        missing += [path for path in paths_in(token) if not path_exists(path)]
    assert not missing, f"CONTRIBUTING.md quotes paths that do not exist: {sorted(set(missing))}"


def test_every_quoted_name_exists() -> None:
    index = Index()
    missing = sorted({r for token in quoted() for r in refs_in(token) if not index.resolves(r)})
    assert not missing, f"CONTRIBUTING.md quotes names the code does not define: {missing}"


def test_the_index_refuses_invented_names() -> None:
    index = Index()
    assert index.resolves("Index.resolves") and index.resolves("Index._read")
    assert not index.resolves("Index.no_such_method") and not index.resolves("NoSuchClass")
