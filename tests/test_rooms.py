"""The import order of builder/'s rooms: every import (function-level ones too) of a module names its own room
or a room below it, so that the rooms can be read, and changed, from the bottom up."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "builder"
# bottom to top; a room is a subpackage, or a module directly in builder/
ORDER = [("errors",), ("contract", "atomic"), ("models",), ("data",), ("decode",), ("export",), ("site",),
         ("train", "bench"), ("cli",), ("__main__", "__init__")]
RANK = {room: rank for rank, rooms in enumerate(ORDER) for room in rooms}
# third-party packages imported inside functions, where only some commands need them and they are slow to import
HEAVY = {"torch", "onnx", "onnxruntime", "gguf", "playwright", "matplotlib", "jinja2", "yaml", "safetensors"}
CLI = "cli"  # imports its commands' rooms inside them: `--help` and a bad argument's one line need no torch


def modules() -> dict[str, Path]:
    """builder.x.y -> its file."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("builder", *path.relative_to(PACKAGE).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 2 else parts)] = path
    return found


def room(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def imports(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every import of a module, absolute."""
    tree = ast.parse(path.read_text())
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    inner = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node in ast.walk(fn)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in inner) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            target = ".".join(x for x in (base, node.module) if x)
            if node.module is None:  # from . import x: x is a module
                found += [(f"{target}.{alias.name}", node.lineno, id(node) in inner) for alias in node.names]
            else:
                found.append((target, node.lineno, id(node) in inner))
    return found


def test_every_room_has_a_rank():
    assert {room(m) for m in modules()} <= set(RANK)


def test_imports_go_only_down():
    upward = [f"{path.relative_to(PACKAGE.parent)}:{line} ({room(m)}) imports {target} ({room(target)})"
              for m, path in modules().items() for target, line, _ in imports(m, path)
              if target.startswith("builder.") and room(target) != room(m) and RANK[room(target)] >= RANK[room(m)]]
    assert not upward, "\n".join(upward)


def test_function_level_imports_are_of_heavy_packages_or_the_clis():
    inner = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {target} inside a function"
             for m, path in modules().items() for target, line, inside in imports(m, path)
             if inside and target.split(".")[0] not in HEAVY and not (room(m) == CLI and target.startswith("builder."))]
    assert not inner, "\n".join(inner)


def test_the_contract_imports_no_torch_nor_onnx():
    for m in ("builder.contract", "builder.errors"):
        targets = {t for t, _, _ in imports(m, modules()[m])}
        assert not {t.split(".")[0] for t in targets} & HEAVY, (m, targets)
        assert {t for t in targets if t.startswith("builder.")} <= {"builder.errors"}, (m, targets)


def test_the_command_line_starts_without_torch():
    code = "import sys, builder.cli, builder.site.serve; print(sorted({'torch', 'onnx'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
