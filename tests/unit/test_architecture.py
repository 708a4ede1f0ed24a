"""The rules of ARCHITECTURE.md that code can check: the layers (a folder each) import only
downwards, no import circle (function-level imports and importlib's included), no decision
between TensorFlow and JAX outside `tpu_magic/backends/`, and a map that names every module.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tpu_magic"
# Top to bottom. A module may import modules of its own folder and of the layers below;
# folders that share a layer may not import each other.
LAYERS = [
    ("tpu_magic", "tpu_magic.datasets", "tpu_magic.notebook"),
    ("tpu_magic.hosts",),
    ("tpu_magic.connecting", "tpu_magic.training"),
    ("tpu_magic.backends",),
    ("tpu_magic.core",),
]
# Modules that reason about installed packages by name (the doctor's diagnoses, the
# version checks): they name frameworks, they do not choose code paths by backend.
ABOUT_PACKAGES = {"connecting/doctor.py", "core/deps.py"}
BACKEND_WORDS = {"tf", "jax", "tensorflow", "MirroredStrategy", "TPUStrategy",
                 "OneDeviceStrategy", "DataParallel"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
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
    """tpu_magic modules the module imports: at the top, in a function, or by name through
    importlib (any string that names a module, as `backends._MODULES` does)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
            found |= subs or ({node.module} & set(modules))
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & set(modules)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value in modules and node.value != "tpu_magic":
            found.add(node.value)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(_tree(path), modules) - {name} for name, path in modules.items()}


def _folder(module: str) -> tuple[int, str]:
    """(the layer's index, the folder) a module belongs to: the longest listed prefix."""
    best = None
    for index, folders in enumerate(LAYERS):
        for folder in folders:
            if (module == folder or module.startswith(folder + ".")) and \
                    (best is None or len(folder) > len(best[1])):
                best = (index, folder)
    assert best is not None, f"{module} is in no layer: add its folder to LAYERS"
    return best


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports against the layers: upwards, or sideways into another folder of one layer."""
    found = []
    for module, imported in sorted(graph.items()):
        layer, folder = _folder(module)
        for other in sorted(imported):
            their_layer, their_folder = _folder(other)
            if their_layer < layer or (their_layer == layer and their_folder != folder
                                       and layer != 0):
                found.append(f"{module} → {other}")
    return found


def circles(graph: dict[str, set[str]]) -> list[str]:
    found = []

    def visit(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                found.append(" → ".join(path + [start]))
            elif nxt not in path and nxt > start:  # each circle once, from its smallest name
                visit(start, nxt, path + [nxt])

    for name in sorted(graph):
        visit(name, name, [name])
    return found


def test_every_import_goes_down_the_layers():
    assert upward(_graph()) == []


def test_no_module_imports_one_that_imports_it_back():
    assert circles(_graph()) == []


def test_the_rules_find_an_upward_import_and_a_circle_where_there_is_one():
    planted = _graph()
    planted["tpu_magic.core.errors"] = {"tpu_magic.training.cell"}  # core reaching up
    planted["tpu_magic.training.report"] = {"tpu_magic.connecting.check"}  # sideways
    assert upward(planted) == ["tpu_magic.core.errors → tpu_magic.training.cell",
                               "tpu_magic.training.report → tpu_magic.connecting.check"]
    assert any("tpu_magic.core.errors" in c for c in circles(planted))
    text = 'import importlib\n_M = {"tf": "tpu_magic.backends.tf.backend"}\n'
    assert _imports(ast.parse(text), _modules()) == {"tpu_magic.backends.tf.backend"}


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
        relative = path.relative_to(PACKAGE).as_posix()
        if name.startswith("tpu_magic.backends") or relative in ABOUT_PACKAGES:
            continue
        lines = _branches_on_backend(_tree(path))
        if lines:
            found[name] = lines
    assert found == {}


def test_the_rule_finds_a_branch_where_there_is_one():
    tree = ast.parse('if session.backend == "jax":\n    pass\nok = hasattr(s, "extended")\n')
    assert _branches_on_backend(tree) == [1, 3]


def _docstring_only(path: Path) -> bool:
    """A folder's `__init__.py` that only says what the folder is."""
    body = ast.parse(path.read_text()).body
    return len(body) == 1 and isinstance(body[0], ast.Expr)


def test_the_map_names_every_module_and_only_modules_that_exist():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    named = {name for name in re.findall(r"`((?:[a-z_]+/)*[a-z_]+\.py)`", text)
             if "/" not in name or (PACKAGE / name.split("/")[0]).is_dir()}  # not tests/...
    on_disk = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
               if not _docstring_only(p) or p.parent == PACKAGE}
    assert on_disk - named == set(), "modules ARCHITECTURE.md does not name"
    assert named - on_disk == set(), "ARCHITECTURE.md names modules that do not exist"
    for folders in LAYERS:
        for folder in folders[1:] if folders[0] == "tpu_magic" else folders:
            short = folder.removeprefix("tpu_magic.")
            if not short.endswith("datasets"):
                assert f"`{short}/`" in text, f"ARCHITECTURE.md does not show the folder {short}/"


LONGEST_FUNCTION = 60  # lines, decorators left out: a longer one is two jobs


def _long_functions(tree: ast.Module, limit: int = LONGEST_FUNCTION) -> list[str]:
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_no_function_is_longer_than_sixty_lines():
    found = {name: _long_functions(_tree(path)) for name, path in _modules().items()}
    assert {name: long for name, long in found.items() if long} == {}


def test_the_length_rule_finds_a_long_function():
    tree = ast.parse("def f():\n" + "    x = 1\n" * 60 + "def g():\n    pass\n")
    assert _long_functions(tree) == ["f (61 lines)"]


# The modules that write module-level state (ARCHITECTURE.md, "core."): the process's own
# state, the registries and the two swaps of Keras's functions. Each must be named there.
WRITERS = {"core/process.py", "training/routing.py", "notebook/workspace.py",
           "hosts/progress.py", "backends/jax/compile_cache.py",
           "backends/jax/replica_steps.py", "backends/tf/replica_steps.py"}
_MUTATORS = {"append", "add", "update", "pop", "clear", "setdefault", "extend", "remove",
             "discard", "popitem", "insert"}


def module_writes(tree: ast.Module) -> list[str]:
    """What a module's functions write of module-level state: `global` rebinding, items of
    its module-level containers set or changed, and the process's environment."""
    top = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
           and isinstance(node.value, (ast.Dict, ast.List, ast.Set, ast.Call))
           for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
           if isinstance(t, ast.Name)}

    def named(value: ast.AST) -> str | None:
        text = ast.unparse(value)
        return text if text in top or text == "os.environ" else None

    found = set()
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Global):
                found.add("global " + ", ".join(node.names))
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                for target in getattr(node, "targets", None) or [node.target]:
                    if isinstance(target, ast.Subscript) and named(target.value):
                        found.add(f"{named(target.value)}[...]")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in _MUTATORS and named(node.func.value):
                found.add(f"{named(node.func.value)}.{node.func.attr}()")
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == "os.putenv":
                found.add("os.putenv()")
    return sorted(found)


def test_only_the_named_modules_write_module_level_state():
    writes = {path.relative_to(PACKAGE).as_posix(): module_writes(_tree(path))
              for path in _modules().values()}
    assert {m: w for m, w in writes.items() if w and m not in WRITERS} == {}
    environment = {m for m, w in writes.items() if any("os.environ" in x or "putenv" in x
                                                        for x in w)}
    assert environment == {"core/process.py"}  # the environment is written there alone
    rule = (ROOT / "ARCHITECTURE.md").read_text().split("- **core.**")[1].split("- **")[0]
    assert {m for m in WRITERS if f"`{m}`" not in rule} == set(), "writers the rule omits"


def test_the_write_rule_finds_a_write_where_there_is_one():
    tree = ast.parse("import os\n_seen = {}\nLIMIT = 3\ndef f(k):\n    _seen[k] = 1\n"
                     "    os.environ['X'] = '1'\n    local = {}\n    local['a'] = 1\n"
                     "def g():\n    global LIMIT\n    LIMIT = 4\n    _seen.clear()\n")
    assert module_writes(tree) == ["_seen.clear()", "_seen[...]", "global LIMIT",
                                   "os.environ[...]"]


# The shape ARCHITECTURE.md describes, held: thin magics over the logic, a cell that routes
# and records (its steps are modules of their own), and training/'s top level a few files
# beside a folder a job.
MAGIC_LINES, CELL_LINES, TRAINING_FILES = 30, 250, 12


def _definitions(path: Path) -> dict[str, int]:
    """Each top-level class's and each class's methods' lines, by name."""
    found = {}
    for node in ast.walk(_tree(path)):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            found[node.name] = node.end_lineno - node.lineno + 1
    return found


def test_the_magics_are_thin_and_the_cell_routes_and_records():
    magics = _definitions(PACKAGE / "notebook" / "magics.py")
    assert {name: magics[name] for name in ("tpu_connect", "tpu_train", "tpu_sync")
            if magics[name] > MAGIC_LINES} == {}
    assert _definitions(PACKAGE / "training" / "cell.py")["TrainingCell"] <= CELL_LINES
    top = sorted(p.name for p in (PACKAGE / "training").glob("*.py"))
    assert len(top) <= TRAINING_FILES, top


# What tpu_magic keeps about a user's objects is in `core/record.py` (a record beside each
# object), and a method it replaces while a call runs is `core/overrides.py`'s: no other
# module writes a user's object behind Keras's back, and nothing is kept as an attribute.
OBJECT_WRITERS = {"core/record.py", "core/overrides.py"}


def object_writes(tree: ast.Module) -> list[str]:
    """The module's `object.__setattr__` calls and `_tpu_magic*` names (attributes kept on
    another's object), as text."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "object.__setattr__":
            found.append(ast.unparse(node))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value.startswith("_tpu_magic"):
            found.append(repr(node.value))
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_tpu_magic"):
            found.append(ast.unparse(node))
    return found


def test_only_the_record_and_the_overrides_write_a_users_object():
    writes = {path.relative_to(PACKAGE).as_posix(): object_writes(_tree(path))
              for path in _modules().values()}
    assert {m: w for m, w in writes.items() if w and m not in OBJECT_WRITERS} == {}


def test_the_object_rule_finds_a_write_where_there_is_one():
    tree = ast.parse("def f(model):\n    object.__setattr__(model, 'x', 1)\n"
                     "    model._tpu_magic_loop = 2\n    return getattr(model, '_tpu_magic_y')\n")
    assert object_writes(tree) == ["object.__setattr__(model, 'x', 1)",
                                   "model._tpu_magic_loop", "'_tpu_magic_y'"]


def test_the_unit_tests_folders_mirror_the_package():
    # a module's direct tests sit in the folder of the same name under tests/unit
    unit = Path(__file__).parent
    folders = {p.relative_to(unit) for p in unit.rglob("*") if p.is_dir()
               and p.name != "__pycache__"}
    assert folders and {str(f) for f in folders if not (PACKAGE / f).is_dir()} == set()


# tests/: the unit suite, the JAX process's suite, what the suites share, the import blocker
OWN_FOLDERS = {"unit", "jax_backend", "support", "without_tensorflow", "artifacts"}
DRIVERS = {"conftest.py", "test_unit.py", "test_jax.py"}  # start the other processes' suites


def test_the_end_to_end_tests_folders_mirror_the_package():
    # a behaviour's end-to-end tests (TensorFlow's process) sit in the folder of the layer
    # that owns it (tests/training/checkpoints/ for tpu_magic/training/checkpoints/); a
    # `published/` folder holds published code run beside plain Keras
    tests = Path(__file__).parent.parent
    folders = {p.relative_to(tests) for p in tests.rglob("*") if p.is_dir()
               and p.name != "__pycache__" and p.relative_to(tests).parts[0] not in OWN_FOLDERS}
    assert folders and {str(f) for f in folders
                        if not (PACKAGE / f).is_dir() and f.name != "published"} == set()
    assert {p.name for p in tests.glob("*.py")} == DRIVERS

