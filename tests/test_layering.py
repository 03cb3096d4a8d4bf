"""The pack's import rules as a test (docs/architecture.md, "The layers"): every module's imports — top level,
function-local, relative and absolute — are read with `ast` (nothing is imported or executed) and checked against
the layers.

`mgpu_backend/` is one package per layer, bottom to top:

    protocol  <  models  <  weights  <  engine  <  splits  <  stages  <  serving

- a module imports only from its own layer and the layers below it (`LAYER_ORDER`);
- `testing` (the tiny model makers) is imported by no runtime module but the CLI's `demo` / `make-tiny` commands
  (`serving/cli.py`); it may import any layer below `serving`;
- `nodes/` (the only ComfyUI-aware layer) imports from `mgpu_backend` only the contracts: `protocol` (its modules)
  and `serving.client` — never the engine, the splits, the weights or the models;
- `mgpu_backend` never imports `nodes`, `comfy*`, `folder_paths`, `server` or `comfy_api`;
- `protocol` and `serving.client` import from `mgpu_backend` only `protocol`, so a node never pulls in the engine
  through them;
- the controller and the CLI read checkpoints through one service, `models.headers` (the safetensors header: family,
  heads, blocks, fp8 / int8 layers, folder discovery): they import nothing else from `models/` (`HEADER_SERVICE`);
- a job (`serving/jobs`) never imports the worker that runs it (nor `fleet`, `controller`, `client`): what a job
  hands back goes through `protocol.frames` (shared-memory frames) and `protocol`;
- the pack's `kernels/` folder is imported only through `mgpu_backend/splits/exchange.py` (today by nothing), and
  `kernels/` never imports `mgpu_backend`, `nodes` or ComfyUI;
- `nodes/testing.py` (the test-only nodes) is imported only by `nodes/extension.py`, behind
  `LTX2_MGPU_TEST_NODES=1`;
- no import cycles inside `mgpu_backend`, lazy (function-local) imports included (`KNOWN_CYCLES` would list any
  left, and can only shrink; it is empty);
- at most 10 packages and modules at the top of `mgpu_backend/` (its `__init__.py`, `__main__.py` and the `py.typed`
  marker aside): the folders show the layers.

`ALLOWED` lists the exceptions still in the code, each with its reason. It can only shrink: the test fails on any
import that breaks a rule and is not listed, and on a listed import that no longer exists (remove it from the list).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("mgpu_backend", "nodes", "kernels")
KERNELS_DOOR = "mgpu_backend.splits.exchange"

LAYER_ORDER = ("protocol", "models", "weights", "engine", "splits", "stages", "serving")
TESTING = "mgpu_backend.testing"
TESTING_MAY_BE_IMPORTED_BY = {"mgpu_backend.serving.cli"}  # the demo and make-tiny commands write tiny models
CONTRACTS = ("mgpu_backend.protocol", "mgpu_backend.serving.client")
COMFYUI_MODULES = ("comfy", "comfy_api", "comfy_extras", "comfy_execution", "folder_paths", "server", "nodes")
FLEET_MODULES = ("mgpu_backend.serving.controller", "mgpu_backend.serving.client", "mgpu_backend.serving.worker",
                 "mgpu_backend.serving.fleet")
JOBS = ("mgpu_backend.serving.jobs",)
HEADER_SERVICE = "mgpu_backend.models.headers"
HEADER_CLIENTS = ("mgpu_backend.serving.controller", "mgpu_backend.serving.cli")
TEST_NODES = "nodes.testing"
MAX_TOP_ENTRIES = 10

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


def _layer(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 1 and parts[0] == "mgpu_backend" and parts[1] in LAYER_ORDER:
        return LAYER_ORDER.index(parts[1])
    return None


def _rule_broken(importer: str, imported: str) -> str | None:
    def within(name: str, prefixes) -> bool:
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    if within(imported, ("kernels",)) and importer != KERNELS_DOOR and not within(importer, ("kernels",)):
        return f"kernels/ is imported only through {KERNELS_DOOR}"
    if within(importer, ("kernels",)) and within(imported, ("mgpu_backend",) + COMFYUI_MODULES):
        return "kernels/ never imports mgpu_backend, nodes or ComfyUI"
    if within(importer, ("nodes",)) and within(imported, ("mgpu_backend",)) and not within(imported, CONTRACTS):
        return f"nodes/ imports from mgpu_backend only {', '.join(CONTRACTS)}"
    if within(imported, (TEST_NODES,)) and importer not in ("nodes.extension", TEST_NODES):
        return "nodes/testing.py is imported only by nodes/extension.py (behind LTX2_MGPU_TEST_NODES=1)"
    if within(importer, ("mgpu_backend",)) and within(imported, COMFYUI_MODULES):
        return "mgpu_backend never imports nodes or ComfyUI"
    if within(imported, (TESTING,)) and within(importer, ("mgpu_backend", "nodes")) \
            and not within(importer, (TESTING,)) and importer not in TESTING_MAY_BE_IMPORTED_BY:
        return f"runtime code never imports {TESTING} (only {', '.join(sorted(TESTING_MAY_BE_IMPORTED_BY))} does)"
    if within(importer, (TESTING,)) and within(imported, ("mgpu_backend.serving",)):
        return f"{TESTING} imports no layer from serving up"
    if within(importer, CONTRACTS) and within(imported, ("mgpu_backend",)) and imported != "mgpu_backend" \
            and not within(imported, ("mgpu_backend.protocol",)):
        return "a contract module (protocol, serving.client) imports from mgpu_backend only protocol"
    if importer in HEADER_CLIENTS and within(imported, ("mgpu_backend.models",)) and imported != HEADER_SERVICE:
        return f"the controller and the CLI import from models/ only the checkpoint-header service {HEADER_SERVICE}"
    if within(importer, JOBS) and within(imported, FLEET_MODULES):
        return "a job never imports the worker, fleet, controller or client (frames go through protocol.frames)"
    low, high = _layer(importer), _layer(imported)
    if low is not None and high is not None and high > low:
        return (f"{LAYER_ORDER[low]} imports only its own layer and those below it "
                f"({' < '.join(LAYER_ORDER)}), not {LAYER_ORDER[high]}")
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
    assert not new, "imports that break the layering of docs/architecture.md:\n" + "\n".join(new)


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
              "    from ..mgpu_backend.splits.tiling import TileCountConfig\n"
              "    import mgpu_backend.engine.sampling\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    for name in ("mgpu_backend/__init__.py", "mgpu_backend/protocol/__init__.py", "mgpu_backend/splits/__init__.py",
                 "mgpu_backend/splits/tiling.py", "mgpu_backend/engine/__init__.py",
                 "mgpu_backend/engine/sampling.py", "nodes/__init__.py", "nodes/common.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "nodes" / "x.py").write_text(source)
    found = [name for _, name in imports_of(tmp_path / "nodes" / "x.py")]
    assert sorted(found) == sorted(["mgpu_backend.protocol", "nodes.common", "folder_paths",
                                    "mgpu_backend.splits.tiling", "mgpu_backend.engine.sampling"])


def test_the_rules():
    assert _rule_broken("nodes.x", "mgpu_backend.splits.tiling")
    assert _rule_broken("nodes.x", "mgpu_backend.protocol") is None
    assert _rule_broken("nodes.x", "mgpu_backend.protocol.fleet_config") is None
    assert _rule_broken("nodes.x", "mgpu_backend.serving.client") is None
    assert _rule_broken("nodes.x", "mgpu_backend.serving.controller")
    assert _rule_broken("nodes.x", "nodes.testing")
    assert _rule_broken("nodes.extension", "nodes.testing") is None
    assert _rule_broken("mgpu_backend.protocol.stage_requests", "mgpu_backend.protocol.stage_params") is None
    assert _rule_broken("mgpu_backend.protocol.stage_requests", "mgpu_backend.engine.sampling")
    assert _rule_broken("mgpu_backend.serving.client", "mgpu_backend.protocol.frames") is None
    assert _rule_broken("mgpu_backend.serving.client", "mgpu_backend.models.loader")
    assert _rule_broken("mgpu_backend.serving.fleet", "folder_paths")
    assert _rule_broken("mgpu_backend.splits.plan", "mgpu_backend.serving.worker")
    assert _rule_broken("mgpu_backend.splits.tiled", "kernels.all2all")
    assert _rule_broken("mgpu_backend.splits.exchange", "kernels.all2all") is None
    assert _rule_broken("kernels.all2all", "mgpu_backend.protocol")
    assert _rule_broken("mgpu_backend.protocol.native_forward", "mgpu_backend.engine.sampling")
    assert _rule_broken("mgpu_backend.protocol.native_forward", "mgpu_backend.protocol.validation") is None
    assert _rule_broken("mgpu_backend.serving.jobs.stages", "mgpu_backend.serving.worker")
    assert _rule_broken("mgpu_backend.serving.jobs.generate", "mgpu_backend.protocol.frames") is None
    # the layer order, both ways
    assert _rule_broken("mgpu_backend.engine.forward", "mgpu_backend.splits.sequence")  # the engine up into splits
    assert _rule_broken("mgpu_backend.splits.sequence", "mgpu_backend.engine.forward") is None
    assert _rule_broken("mgpu_backend.models.diffusion_decoder", "mgpu_backend.splits.decode")
    assert _rule_broken("mgpu_backend.models.diffusion_decoder", "mgpu_backend.models.neighborhood") is None
    assert _rule_broken("mgpu_backend.weights.sharding", "mgpu_backend.models.loader") is None
    assert _rule_broken("mgpu_backend.models.loader", "mgpu_backend.weights.sharding")
    assert _rule_broken("mgpu_backend.splits.decode", "mgpu_backend.models.diffusion_decoder") is None
    assert _rule_broken("mgpu_backend.stages.stage", "mgpu_backend.serving.worker")
    # the checkpoint-header service: the controller and the CLI read models/ through it alone
    assert _rule_broken("mgpu_backend.serving.controller", "mgpu_backend.models.headers") is None
    assert _rule_broken("mgpu_backend.serving.cli", "mgpu_backend.models.headers") is None
    for internal in ("loader", "folders", "families", "gemma", "text_projection", "quant"):
        assert _rule_broken("mgpu_backend.serving.controller", f"mgpu_backend.models.{internal}"), internal
        assert _rule_broken("mgpu_backend.serving.cli", f"mgpu_backend.models.{internal}"), internal
    assert _rule_broken("mgpu_backend.serving.controller", "mgpu_backend.models")  # the package itself too
    assert _rule_broken("mgpu_backend.serving.worker", "mgpu_backend.models.loader") is None  # a rank loads
    # the testing fence
    assert _rule_broken("mgpu_backend.serving.worker", "mgpu_backend.testing.tiny")
    assert _rule_broken("mgpu_backend.models.loader", "mgpu_backend.testing.tiny")
    assert _rule_broken("nodes.loader", "mgpu_backend.testing.tiny")
    assert _rule_broken("mgpu_backend.serving.cli", "mgpu_backend.testing.tiny") is None
    assert _rule_broken("mgpu_backend.testing.tiny", "mgpu_backend.models.loader") is None
    assert _rule_broken("mgpu_backend.testing.tiny", "mgpu_backend.serving.fleet")


def test_a_job_importing_the_worker_fails(tmp_path, monkeypatch):
    """The frame hand-back's old shape — a job reaching back into the worker for `send_frames` — is found, whether
    the import is relative or absolute, at the top or inside the job function."""
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    for name in ("mgpu_backend/__init__.py", "mgpu_backend/serving/__init__.py", "mgpu_backend/serving/worker.py",
                 "mgpu_backend/protocol/__init__.py", "mgpu_backend/protocol/frames.py",
                 "mgpu_backend/serving/jobs/__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "mgpu_backend" / "serving" / "jobs" / "bad.py").write_text(
        "from ...protocol.frames import send_frames\n"
        "def run(state, request, ctx):\n"
        "    from ..worker import send_frames\n")
    (tmp_path / "mgpu_backend" / "serving" / "jobs" / "bad2.py").write_text("import mgpu_backend.serving.worker\n")
    found = _violations()
    assert set(found) == {("mgpu_backend.serving.jobs.bad", "mgpu_backend.serving.worker"),
                          ("mgpu_backend.serving.jobs.bad2", "mgpu_backend.serving.worker")}, found


def test_the_folders_show_the_layers():
    """At most MAX_TOP_ENTRIES packages and modules at the top of mgpu_backend/, and every layer is a package."""
    top = sorted(p.name for p in (ROOT / "mgpu_backend").iterdir()
                 if p.name not in ("__init__.py", "__main__.py", "py.typed", "__pycache__"))
    assert len(top) <= MAX_TOP_ENTRIES, top
    for layer in LAYER_ORDER + ("testing",):
        assert (ROOT / "mgpu_backend" / layer / "__init__.py").is_file(), layer
    assert set(top) == set(LAYER_ORDER) | {"testing"}, f"a top entry that is not a layer: {top}"


def test_a_controller_reading_a_model_internal_fails(tmp_path, monkeypatch):
    """The checkpoint-header rule on a tree: the controller importing the loader (lazily, inside a function) is
    found; its import of the header service is not."""
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    for name in ("mgpu_backend/__init__.py", "mgpu_backend/models/__init__.py", "mgpu_backend/models/loader.py",
                 "mgpu_backend/models/headers.py", "mgpu_backend/serving/__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "mgpu_backend" / "serving" / "controller.py").write_text(
        "from ..models.headers import checkpoint_facts\n"
        "def check_config(config):\n"
        "    from ..models.loader import SafetensorsFile\n")
    (tmp_path / "mgpu_backend" / "serving" / "cli.py").write_text("from mgpu_backend.models import headers\n")
    assert set(_violations()) == {("mgpu_backend.serving.controller", "mgpu_backend.models.loader")}
