"""Reading a cell's code: the names it uses, and whether it trains with its own loop.

The code is IPython's transformed cell (`!cmd` and `%magic` lines already Python calls);
the Python a line or cell magic runs (`%time model.fit(...)`) is read too. Nothing runs.
"""

from __future__ import annotations

import ast

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
