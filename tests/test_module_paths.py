"""Every import of the engine in the repository's Python files names a module that exists after issue 34's move to
one package per layer — also in files the CPU suite never imports, such as `tests/native_model_driver.py` (run
with ComfyUI's Python by tests/test_native_model_comfyui.py, which imports `ltx2_multigpu.mgpu_backend.…`: the pack
as ComfyUI loads it). Static (ast), no import: the old `mgpu_backend.forward` / `mgpu_backend.client` there went
unnoticed until a live ComfyUI ran it."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "mgpu_backend"
PREFIXES = ("ltx2_multigpu.mgpu_backend", "mgpu_backend")


def _python_files():
    for folder in ("tests", "bench", "nodes", "kernels"):
        yield from (ROOT / folder).rglob("*.py")
    yield from ROOT.glob("*.py")


def _module_path(dotted: str) -> Path | None:
    parts = dotted.split(".")
    base = PKG.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _engine_module(node: ast.ImportFrom) -> str | None:
    """The module under mgpu_backend an ImportFrom names ('' for the package itself), else None."""
    module = node.module or ""
    if node.level:  # inside the pack: nodes/x.py's `..mgpu_backend.y`
        module = module if module.startswith("mgpu_backend") else ""
        prefixes = ("mgpu_backend",)
    else:
        prefixes = PREFIXES
    for prefix in prefixes:
        if module == prefix:
            return ""
        if module.startswith(prefix + "."):
            return module[len(prefix) + 1:]
    return None


def test_every_engine_import_names_an_existing_module():
    bad = []
    for path in _python_files():
        if ".venv" in path.parts:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                sub = _engine_module(node)
                if sub is None:
                    continue
                target = _module_path(sub) if sub else PKG / "__init__.py"
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                if target is None:
                    bad.append(f"{where}: no module mgpu_backend.{sub}")
                    continue
                if target.name != "__init__.py":
                    continue
                text = target.read_text()
                for alias in node.names:  # from a package: a submodule, or a name its __init__ defines
                    if alias.name != "*" and _module_path(".".join(p for p in (sub, alias.name) if p)) is None \
                            and alias.name not in text:
                        bad.append(f"{where}: mgpu_backend{'.' + sub if sub else ''} has no {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    for prefix in PREFIXES:
                        if alias.name.startswith(prefix + ".") and _module_path(alias.name[len(prefix) + 1:]) is None:
                            bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: no module {alias.name}")
    assert not bad, "imports of module paths that no longer exist (tests/old_layout.py has the moves):\n" + \
        "\n".join(bad)
