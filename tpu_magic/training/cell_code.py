"""Reading a cell's code: the names it uses, the classes whose layout maps lay out the model
it builds, and whether it trains with its own loop.

The code is IPython's transformed cell (`!cmd` and `%magic` lines already Python calls);
the Python a line or cell magic runs (`%time model.fit(...)`) is read too. Nothing runs.
"""

from __future__ import annotations

import ast
import functools
import types
from typing import Any, Iterator, Mapping

def names_in(cell: str) -> set[str]:
    """Names a cell reads before it assigns them (the models it uses, not those it makes).

    `cell` is IPython's transformed code (`!cmd` and `%magic` lines already Python); the
    Python a line or cell magic runs (`%time model.fit(...)`) is read too.
    """
    try:
        tree = ast.parse(cell)
    except SyntaxError:
        return set()
    reads: set[str] = set()
    assigned: set[str] = set()
    for statement in tree.body:
        names = [n for n in ast.walk(statement) if isinstance(n, ast.Name)]
        reads |= {n.id for n in names if isinstance(n.ctx, ast.Load)} - assigned
        reads |= set().union(*(names_in(code) for code in _magic_code(statement))) - assigned
        assigned |= {n.id for n in names if isinstance(n.ctx, ast.Store)}
    return reads


def _magic_code(statement: ast.AST) -> list[str]:
    """The code strings a statement hands to `get_ipython().run_line_magic/run_cell_magic`."""
    found = []
    for node in ast.walk(statement):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("run_line_magic", "run_cell_magic"):
            found += [a.value for a in node.args[1:]
                      if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return found


def layout_owners(cell: str, namespace: Mapping[str, Any],
                  before: Mapping[str, Any] = types.MappingProxyType({})) -> list[type]:
    """The classes whose `get_layout_map` lays out the variables `cell` makes on a mesh, as
    `namespace` holds them now (asked while the cell runs, each time a variable is made).

    Each name the cell uses, dotted ones too (`keras_hub.models.GemmaBackbone`), is looked
    up in `namespace`, attribute by attribute through modules and classes (an object's
    attributes are not read on the way). A class is kept where it offers `get_layout_map`,
    or its `backbone_cls` does (a KerasHub task, `GemmaCausalLM`); an object, a model the
    cell uses, by its class and its `backbone`'s the same way. In the order the cell first
    names them, each once; nothing is imported or called but `backbone`.

    `before`: what the names the cell assigns held when it started (`assigned_before`). An
    object such a name still holds is the previous cell's (`lm` while the cell's own `lm` is
    being built): it owns nothing of this cell's variables, and is passed over.
    """
    found: dict[type, None] = {}
    for name in dotted_names_in(cell):
        thing = _looked_up(name, namespace)
        head = name.split(".")[0]
        if head in before and namespace.get(head) is before[head] and \
                not isinstance(thing, (type, types.ModuleType)):
            continue
        for owner in _owners_of(thing):
            found.setdefault(owner, None)
    return list(found)


def assigned_before(cell: str, namespace: Mapping[str, Any]) -> dict[str, Any]:
    """What the names `cell` assigns (`name = ...`, `for name in`, imports, `def`, `class`)
    hold in `namespace` before it runs (see `layout_owners`)."""
    try:
        tree = ast.parse(cell)
    except SyntaxError:
        return {}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
    return {name: namespace[name] for name in names if name in namespace}


@functools.lru_cache(maxsize=16)
def dotted_names_in(cell: str) -> tuple[str, ...]:
    """Every name and dotted name the cell (and the Python its magics run) reads, prefixes
    included (`keras_hub`, `keras_hub.models`, `keras_hub.models.GemmaBackbone`), in the
    order of the code, each once."""
    try:
        tree = ast.parse(cell)
    except SyntaxError:
        return ()
    found: dict[str, tuple[int, int]] = {}
    for node in ast.walk(tree):
        name = _dotted(node)
        if name is not None and (not isinstance(node, ast.Name) or
                                 isinstance(node.ctx, ast.Load)):
            found.setdefault(name, (node.lineno, node.col_offset))
    inner = [name for statement in tree.body for code in _magic_code(statement)
             for name in dotted_names_in(code)]
    return tuple(dict.fromkeys(sorted(found, key=found.__getitem__) + inner))


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a name or an attribute chain that starts at a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


_MISSING = object()


def _looked_up(name: str, namespace: Mapping[str, Any]) -> Any:
    """What `name` is in `namespace` (`_MISSING` where it is not there yet, or it passes
    through an object)."""
    head, *rest = name.split(".")
    thing = namespace.get(head, _MISSING)
    for attribute in rest:
        if not isinstance(thing, (type, types.ModuleType)):
            return _MISSING
        try:
            thing = getattr(thing, attribute, _MISSING)
        except Exception:  # noqa: BLE001 - a module's lazy attribute failing to load
            return _MISSING
    return thing


def _owners_of(thing: Any) -> Iterator[type]:
    """The classes with `get_layout_map` that `thing` (a class, or an object) stands for."""
    if thing is _MISSING or isinstance(thing, types.ModuleType):
        return
    classes = [thing] if isinstance(thing, type) else [type(thing)]
    if not isinstance(thing, type):
        try:
            classes.append(type(getattr(thing, "backbone", None)))
        except Exception:  # noqa: BLE001 - an object's property that fails: no owner there
            pass
    for cls in classes:
        for candidate in (cls, getattr(cls, "backbone_cls", None)):
            if isinstance(candidate, type) and \
                    callable(getattr(candidate, "get_layout_map", None)):
                yield candidate


def hand_written_loop(cell: str) -> bool:
    """Whether the cell trains with its own `tf.GradientTape` loop ("writing a training loop
    from scratch"): a tape opened outside any class body. A tape inside a model's
    `train_step` is Keras's own loop, which `fit` runs on the replicas.
    """
    try:
        tree = ast.parse(cell)
    except SyntaxError:
        return False

    def tapes(node: ast.AST, in_class: bool) -> bool:
        if isinstance(node, ast.ClassDef):
            in_class = True
        if not in_class and isinstance(node, (ast.Name, ast.Attribute)) and \
                (getattr(node, "id", None) or getattr(node, "attr", None)) == "GradientTape":
            return True
        return any(tapes(child, in_class) for child in ast.iter_child_nodes(node))

    return tapes(tree, False)
