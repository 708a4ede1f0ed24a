"""The rules of ARCHITECTURE.md that code can check: no import circle, and no decision
between TensorFlow and JAX outside `tpu_magic/backends/`."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tpu_magic"
# Modules that reason about installed packages by name (the doctor's diagnoses, the
# version checks): they name frameworks, they do not choose code paths by backend.
ABOUT_PACKAGES = {"doctor.py", "deps.py", "compile_cache.py"}
BACKEND_WORDS = {"tf", "jax", "tensorflow", "MirroredStrategy", "TPUStrategy",
                 "OneDeviceStrategy", "DataParallel"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _tree(path: Path) -> ast.Module:
    """The module's syntax tree, `if TYPE_CHECKING:` blocks (types, not imports) emptied."""
    tree = ast.parse(path.read_text())
    for node in list(ast.walk(tree)):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            node.body = [ast.Pass()]
    return tree


def _imports(tree: ast.Module, modules: dict[str, Path]) -> set[str]:
    """tpu_magic modules imported anywhere in the module (at the top or in a function)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
            found |= subs or ({node.module} & set(modules))
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & set(modules)
    return found


def test_no_module_imports_one_that_imports_it_back():
    modules = _modules()
    graph = {name: _imports(_tree(path), modules) - {name} for name, path in modules.items()}
    circles = []

    def visit(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt == start:
                circles.append(" → ".join(path + [start]))
            elif nxt not in path and nxt > start:  # each circle once, from its smallest name
                visit(start, nxt, path + [nxt])

    for name in sorted(graph):
        visit(name, name, [name])
    assert circles == []


def _branches_on_backend(tree: ast.Module) -> list[int]:
    """Lines that compare with a backend's or strategy's name, or probe a strategy's type."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            names = [n.value for n in ast.walk(node)
                     if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            if BACKEND_WORDS & set(names):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("hasattr",
                                                                              "isinstance"):
            text = ast.unparse(node)
            if "extended" in text or "distribute" in text or "DataParallel" in text:
                lines.append(node.lineno)
    return lines


def test_only_the_backends_choose_between_tensorflow_and_jax():
    found = {}
    for name, path in _modules().items():
        if name.startswith("tpu_magic.backends") or path.name in ABOUT_PACKAGES:
            continue
        lines = _branches_on_backend(_tree(path))
        if lines:
            found[name] = lines
    assert found == {}


def test_the_rule_finds_a_branch_where_there_is_one():
    tree = ast.parse('if session.backend == "jax":\n    pass\nok = hasattr(s, "extended")\n')
    assert _branches_on_backend(tree) == [1, 3]
