"""DESIGN.md's import rules as a test (issue 17, Build 5): every module's imports — top level, function-local,
relative and absolute — are read with `ast` (nothing is imported or executed) and checked against the layers:

- `nodes/` (the only ComfyUI-aware layer) imports from `mgpu_backend` only the request / contract modules:
  `client`, `protocol` (its modules), `forward` (the native MODEL's request contract), `stage_params` (guidance, sigma
  schedules, tile counts) and `resources` (the host's limits and links, standard library only) — never `sampling`,
  `parallel`, `lora`, `models` or any other engine module;
- `mgpu_backend` never imports `nodes`, `comfy*`, `folder_paths`, `server` or `comfy_api`;
- `mgpu_backend/models` and `mgpu_backend/parallel` never import `controller`, `client`, `worker` or `fleet`;
- a job (`mgpu_backend/jobs`) never imports the worker that runs it (nor `fleet`, `controller`, `client`): what a job
  hands back goes through `frames` (shared-memory frames) and `protocol`;
- the pack's `kernels/` folder is imported only through `mgpu_backend/parallel/exchange.py` (today by nothing), and
  `kernels/` never imports `mgpu_backend`, `nodes` or ComfyUI;
- those contract modules import from `mgpu_backend` only each other, `validation`, `frames` (the client's half of
  the frame hand-back) and `resources` (the host's limits, standard library only: the client refuses a fleet size
  before a controller starts), so a node never pulls in the engine through them;
- kernels vs `parallel/` vs `models/` (issue 25): `mgpu_backend/ops` (compute kernels in plain PyTorch, e.g.
  neighborhood attention) imports nothing of the pack; `models/` never imports `parallel/` (the model layer sits
  below the parallel layer, which may use it);
- no import cycles inside `mgpu_backend`, lazy (function-local) imports included (`KNOWN_CYCLES` would list any
  left, and can only shrink; it is empty).

`ALLOWED` lists the exceptions still in the code, each with its reason. It can only shrink: the test fails on any
import that breaks a rule and is not listed, and on a listed import that no longer exists (remove it from the list).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("mgpu_backend", "nodes", "kernels")
KERNELS_DOOR = "mgpu_backend.parallel.exchange"

NODES_MAY_IMPORT = {"mgpu_backend.client", "mgpu_backend.protocol", "mgpu_backend.forward",
                    "mgpu_backend.stage_params", "mgpu_backend.resources"}
COMFYUI_MODULES = ("comfy", "comfy_api", "comfy_extras", "comfy_execution", "folder_paths", "server", "nodes")
BELOW_THE_FLEET = ("mgpu_backend.models", "mgpu_backend.parallel")
FLEET_MODULES = ("mgpu_backend.controller", "mgpu_backend.client", "mgpu_backend.worker", "mgpu_backend.fleet")
CONTRACT_MAY_IMPORT = NODES_MAY_IMPORT | {"mgpu_backend.validation", "mgpu_backend.frames", "mgpu_backend.resources"}
JOBS = ("mgpu_backend.jobs",)
OPS = ("mgpu_backend.ops",)
MODELS = ("mgpu_backend.models",)
PARALLEL = ("mgpu_backend.parallel",)

# (importing module, imported module) pairs that break a rule today. Only ever remove entries.
ALLOWED = {
    # Test Conditioning (MGPU), a testing node, runs Gemma and the text projection in ComfyUI's process by design
    # (it makes reference conditionings without a fleet).
    ("nodes.testing", "mgpu_backend.models.gemma"),
    ("nodes.testing", "mgpu_backend.models.loader"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`, wherever it stands in the file. Relative imports are
    resolved against the pack's root (ComfyUI imports the pack under a mangled name, so `..mgpu_backend` from
    `nodes/x.py` is `mgpu_backend`); `from package import name` counts as importing `package.name` when that is a
    module of the pack."""
    module = _module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}" if target else alias.name
                out.append((node.lineno, full if _is_module(full) else target))
    return out


def _rule_broken(importer: str, imported: str) -> str | None:
    def within(name: str, prefixes) -> bool:
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    if within(imported, ("kernels",)) and importer != KERNELS_DOOR and not within(importer, ("kernels",)):
        return f"kernels/ is imported only through {KERNELS_DOOR}"
    if within(importer, ("kernels",)) and within(imported, ("mgpu_backend",) + COMFYUI_MODULES):
        return "kernels/ never imports mgpu_backend, nodes or ComfyUI"
    if within(importer, ("nodes",)) and within(imported, ("mgpu_backend",)) and not within(imported, NODES_MAY_IMPORT):
        return f"nodes/ imports from mgpu_backend only {', '.join(sorted(NODES_MAY_IMPORT))}"
    if within(importer, ("mgpu_backend",)) and within(imported, COMFYUI_MODULES):
        return "mgpu_backend never imports nodes or ComfyUI"
    if within(importer, CONTRACT_MAY_IMPORT) and within(imported, ("mgpu_backend",)) and imported != "mgpu_backend" \
            and not within(imported, CONTRACT_MAY_IMPORT):
        return f"a contract module imports from mgpu_backend only {', '.join(sorted(CONTRACT_MAY_IMPORT))}"
    if within(importer, BELOW_THE_FLEET) and within(imported, FLEET_MODULES):
        return "models/ and parallel/ never import the controller, client, worker or fleet"
    if within(importer, JOBS) and within(imported, FLEET_MODULES):
        return "a job never imports the worker, fleet, controller or client (frames go through mgpu_backend.frames)"
    if within(importer, OPS) and within(imported, ("mgpu_backend",)) and not within(imported, OPS) \
            and imported != "mgpu_backend":
        return "mgpu_backend/ops (kernels) imports nothing of the pack"
    if within(importer, MODELS) and within(imported, PARALLEL):
        return "models/ never imports parallel/ (a kernel both use lives in mgpu_backend/ops)"
    return None


def _violations() -> dict[tuple[str, str], str]:
    found = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            importer = _module_name(path)
            for line, imported in imports_of(path):
                rule = _rule_broken(importer, imported)
                if rule:
                    found.setdefault((importer, imported), f"{path.relative_to(ROOT)}:{line}: {imported} ({rule})")
    return found


def test_import_rules_hold():
    violations = _violations()
    new = [text for pair, text in sorted(violations.items()) if pair not in ALLOWED]
    assert not new, "imports that break DESIGN.md's layering:\n" + "\n".join(new)


def test_allow_list_only_shrinks():
    gone = sorted(ALLOWED - set(_violations()))
    assert not gone, f"these allowed imports are gone: remove them from ALLOWED in {Path(__file__).name}: {gone}"


# strongly connected groups of modules importing each other (lazily or not) still in the code: only ever remove
KNOWN_CYCLES: set[frozenset[str]] = set()


def import_graph() -> dict[str, set[str]]:
    """module -> the pack's modules it imports (every import, function-local ones included)."""
    graph = {}
    for path in sorted((ROOT / "mgpu_backend").rglob("*.py")):
        importer = _module_name(path)
        deps = set()
        for _, imported in imports_of(path):
            while imported and not _is_module(imported):
                imported = imported.rpartition(".")[0]
            if imported.startswith("mgpu_backend") and imported not in (importer, "mgpu_backend"):
                deps.add(imported)
        graph[importer] = deps
    return graph


def import_cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                found.add(frozenset(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    new = sorted(sorted(c) for c in cycles - KNOWN_CYCLES)
    assert not new, f"modules importing each other (lazily or not): {new}"
    gone = sorted(sorted(c) for c in KNOWN_CYCLES - cycles)
    assert not gone, f"these cycles are gone: remove them from KNOWN_CYCLES in {Path(__file__).name}: {gone}"


def test_the_cycle_finder():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}
    assert import_cycles({"a": {"b"}, "b": set()}) == set()


def test_the_reader_sees_every_kind_of_import(tmp_path, monkeypatch):
    """The parser itself: function-local, relative (one and two levels), `from package import module` and absolute
    imports are all found and resolved."""
    source = ("from ..mgpu_backend import protocol as P\n"
              "from .common import guard\n"
              "import folder_paths\n"
              "def f():\n"
              "    from ..mgpu_backend.parallel.tiling import TileCountConfig\n"
              "    import mgpu_backend.sampling\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    for name in ("mgpu_backend/__init__.py", "mgpu_backend/protocol.py", "mgpu_backend/parallel/__init__.py",
                 "mgpu_backend/parallel/tiling.py", "nodes/__init__.py", "nodes/common.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "nodes" / "x.py").write_text(source)
    found = [name for _, name in imports_of(tmp_path / "nodes" / "x.py")]
    assert sorted(found) == sorted(["mgpu_backend.protocol", "nodes.common", "folder_paths",
                                    "mgpu_backend.parallel.tiling", "mgpu_backend.sampling"])
    assert _rule_broken("nodes.x", "mgpu_backend.parallel.tiling")
    assert _rule_broken("nodes.x", "mgpu_backend.protocol") is None
    assert _rule_broken("nodes.x", "mgpu_backend.protocol.fleet_config") is None
    assert _rule_broken("mgpu_backend.protocol.stage_requests", "mgpu_backend.stage_params") is None
    assert _rule_broken("mgpu_backend.protocol.stage_requests", "mgpu_backend.sampling")
    assert _rule_broken("mgpu_backend.fleet", "folder_paths")
    assert _rule_broken("mgpu_backend.parallel.plan", "mgpu_backend.worker")
    assert _rule_broken("mgpu_backend.parallel.tiled", "kernels.all2all")
    assert _rule_broken("mgpu_backend.parallel.exchange", "kernels.all2all") is None
    assert _rule_broken("kernels.all2all", "mgpu_backend.protocol")
    assert _rule_broken("mgpu_backend.forward", "mgpu_backend.sampling")
    assert _rule_broken("mgpu_backend.forward", "mgpu_backend.validation") is None
    assert _rule_broken("mgpu_backend.jobs.stages", "mgpu_backend.worker")
    assert _rule_broken("mgpu_backend.jobs.generate", "mgpu_backend.frames") is None
    assert _rule_broken("mgpu_backend.models.diffusion_decoder", "mgpu_backend.parallel.neighborhood")
    assert _rule_broken("mgpu_backend.models.diffusion_decoder", "mgpu_backend.ops.neighborhood") is None
    assert _rule_broken("mgpu_backend.ops.neighborhood", "mgpu_backend.models.loader")
    assert _rule_broken("mgpu_backend.parallel.decode", "mgpu_backend.models.diffusion_decoder") is None


def test_a_job_importing_the_worker_fails(tmp_path, monkeypatch):
    """The frame hand-back's old shape — a job reaching back into the worker for `send_frames` — is found, whether
    the import is relative or absolute, at the top or inside the job function."""
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    for name in ("mgpu_backend/__init__.py", "mgpu_backend/worker.py", "mgpu_backend/frames.py",
                 "mgpu_backend/jobs/__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "mgpu_backend" / "jobs" / "bad.py").write_text(
        "from ..frames import send_frames\n"
        "def run(state, request, ctx):\n"
        "    from ..worker import send_frames\n")
    (tmp_path / "mgpu_backend" / "jobs" / "bad2.py").write_text("import mgpu_backend.worker\n")
    found = _violations()
    assert set(found) == {("mgpu_backend.jobs.bad", "mgpu_backend.worker"),
                          ("mgpu_backend.jobs.bad2", "mgpu_backend.worker")}, found
