"""What a stranger's machine sees of the package: the wheel's top-level names, the fleet's import path, the CLI's
conventions, the version in one place and the ComfyUI registry's metadata."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import mgpu_backend
from mgpu_backend.serving import client as C

REPO = Path(__file__).resolve().parent.parent
NOT_OURS = ("kernels", "nodes", "tests", "workflows", "bench")  # never importable as top-level names from the pack


def _run(*cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


@pytest.mark.slow
def test_the_wheel_installs_only_mgpu_backend(tmp_path):
    """Builds the wheel from a copy of the tree, installs it (no dependencies) into a fresh venv and lists what
    appeared in its site-packages: `mgpu_backend` and its dist-info, nothing named `kernels` (Hugging Face's kernel
    loader, which diffusers imports, has that name)."""
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "build", "dist", "out",
                                                             "*.egg-info", ".pytest_cache"))
    wheels = tmp_path / "wheels"
    built = _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(src))
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("ltx2_multigpu-*.whl")
    venv = tmp_path / "venv"
    assert _run(sys.executable, "-m", "venv", "--without-pip", str(venv)).returncode == 0
    py = venv / "bin" / "python"
    site = Path(_run(str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip())
    before = set(os.listdir(site))
    # the venv has no pip of its own: this interpreter's pip installs into it
    done = _run(sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
                str(wheel))
    assert done.returncode == 0, done.stderr[-3000:]
    added = {name for name in set(os.listdir(site)) - before if not name.endswith(".dist-info")}
    assert added == {"mgpu_backend"}
    assert (site / "mgpu_backend" / "py.typed").is_file()
    for name in NOT_OURS:
        assert not (site / name).exists()


def test_the_fleet_import_path_holds_only_mgpu_backend(tmp_path, monkeypatch):
    """The controller and its workers import from a private directory that links `mgpu_backend` alone, even when
    the caller's PYTHONPATH names the pack folder: the pack's `kernels`, `nodes`, `tests` are not importable there
    (PyPI's `kernels`, a dependency of transformers, may be)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), "/somewhere/else"]))
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    env = C.controller_env(runtime)
    entries = env["PYTHONPATH"].split(os.pathsep)
    assert entries[0] == str(runtime / "pythonpath") and entries[1:] == ["/somewhere/else"]
    assert sorted(os.listdir(entries[0])) == ["mgpu_backend"]
    # a name found outside the pack is another distribution's (transformers needs PyPI's `kernels`): not ours
    probe = ("import importlib.util as u, mgpu_backend, os, sys; "
             f"ours = lambda n, s: any((os.path.realpath(p) + os.sep).startswith(os.path.join({str(REPO.resolve())!r}, n, '')) "
             "for p in ([s.origin] if s.origin else []) + list(s.submodule_search_locations or [])); "
             f"print([n for n in {NOT_OURS!r} if (s := u.find_spec(n)) is not None and ours(n, s)]); "
             "print(mgpu_backend.__file__)")
    out = _run(sys.executable, "-c", probe, env=env, cwd=str(runtime))
    assert out.returncode == 0, out.stderr
    shadowing, origin = out.stdout.split("\n")[:2]
    assert shadowing == "[]"
    assert Path(origin).resolve() == (REPO / "mgpu_backend" / "__init__.py").resolve()
    C.controller_env(runtime)  # a second start reuses the link (atomic replace; no error when it exists)
    assert sorted(os.listdir(entries[0])) == ["mgpu_backend"]


def test_the_repository_kernels_folder_is_not_a_package():
    assert (REPO / "kernels").is_dir() and not (REPO / "kernels" / "__init__.py").exists()


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_one_version_everywhere():
    """The version is written once, `mgpu_backend.__version__`; the package metadata (setuptools), the registry
    (`[tool.comfy.version]`, read as comfy-cli reads it), the CLI and the CHANGELOG's newest release agree with it."""
    data = _pyproject()
    project = data["project"]
    assert "version" not in project and project["dynamic"] == ["version"]
    assert data["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "mgpu_backend.__version__"}
    version_file = REPO / data["tool"]["comfy"]["version"]["path"]
    assert version_file.resolve() == Path(mgpu_backend.__file__).resolve()
    written = re.findall(r'^__version__ = "([^"]+)"$', version_file.read_text(), re.M)
    assert written == [mgpu_backend.__version__]
    assert re.fullmatch(r"\d+\.\d+\.\d+", mgpu_backend.__version__)  # the registry's X.Y.Z
    from setuptools.config.pyprojecttoml import read_configuration
    assert read_configuration(REPO / "pyproject.toml")["project"]["version"] == mgpu_backend.__version__
    out = _run(sys.executable, "-m", "mgpu_backend", "--version", cwd=str(REPO))
    assert out.returncode == 0 and out.stdout.strip() == f"ltx2-multigpu {mgpu_backend.__version__}"
    released = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert released and released[0] == mgpu_backend.__version__, "CHANGELOG's newest release is not __version__"


# what the registry's comfy-cli accepts (comfy_cli/registry/config_parser.py, comfy-cli 1.23.0): anything else under
# "Environment ::" makes it drop every accelerator, under "Operating System ::" every OS
REGISTRY_ACCELERATORS = {"GPU :: NVIDIA CUDA", "GPU :: AMD ROCm", "GPU :: Intel Arc", "NPU :: Huawei Ascend",
                         "GPU :: Apple Metal"}
REGISTRY_OS_PREFIXES = ("Microsoft", "POSIX", "MacOS", "OS Independent")


def test_registry_metadata_is_complete():
    """`[tool.comfy]` and `[project]` hold what the ComfyUI registry shows; the repository URL and the icon's URL are
    set at publishing (docs/publishing.md says so), and the icon they will point at is in the repository."""
    data = _pyproject()
    project, comfy = data["project"], data["tool"]["comfy"]
    assert re.fullmatch(r"[A-Za-z][A-Za-z0-9]*(?:[-_.][A-Za-z0-9]+)*", project["name"]) and len(project["name"]) < 100
    assert "comfyui" not in project["name"].lower()
    assert project["description"] and project["license"] == {"text": "Apache-2.0"} and project["requires-python"]
    assert comfy["PublisherId"] and comfy["DisplayName"] == "LTX-2 Multi-GPU"
    assert re.fullmatch(r">=\d+\.\d+\.\d+", comfy["requires-comfyui"])
    classifiers = project["classifiers"]
    accelerators = [c.removeprefix("Environment :: ") for c in classifiers if c.startswith("Environment ::")]
    systems = [c.removeprefix("Operating System :: ") for c in classifiers if c.startswith("Operating System :: ")]
    assert "GPU :: NVIDIA CUDA" in accelerators and set(accelerators) <= REGISTRY_ACCELERATORS
    assert "POSIX :: Linux" in systems and all(s.startswith(REGISTRY_OS_PREFIXES) for s in systems)
    tags = [c for c in classifiers if c.startswith(("Topic ::", "Intended Audience ::"))]
    assert tags and {"comfyui", "ltx-2", "multi-gpu"} <= set(project["keywords"])
    publishing = (REPO / "docs" / "publishing.md").read_text()
    svg = (REPO / "docs" / "icon.svg").read_text()
    width, height = (int(re.search(rf'<svg[^>]* {k}="(\d+)"', svg)[1]) for k in ("width", "height"))
    assert width <= 800 and height <= 400  # the registry's largest icon
    if comfy["Icon"]:
        assert comfy["Icon"].startswith("https://") and comfy["Icon"].endswith("docs/icon.svg")
    else:
        assert "`[tool.comfy] Icon`: **set at publishing**" in publishing
    urls = project.get("urls", {})
    if urls:
        assert urls["Repository"].startswith("https://")
    else:
        assert "`[project.urls]`: **set at publishing**" in publishing and "Repository" in publishing


@pytest.mark.skipif(not os.environ.get("COMFY_CLI"), reason="set COMFY_CLI to a comfy-cli executable (installed in a "
                    "separate venv: docs/publishing.md) to run the registry's own check")
def test_the_registrys_own_check_passes(tmp_path):
    """`comfy node validate` (the registry's check: pyproject.toml read as the registry reads it, its security lint)
    on a copy of the tree, so its files never land in the checkout."""
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "build", "dist", "out",
                                                             "*.egg-info", ".pytest_cache"))
    out = _run(os.environ["COMFY_CLI"], "--skip-prompt", "--no-enable-telemetry", "node", "validate", cwd=str(src))
    text = out.stdout + out.stderr  # comfy-cli prints its verdict on stderr
    assert out.returncode == 0, text
    assert "All validation checks passed successfully" in text
    assert "Warning" not in text and "Security warnings" not in text


def test_a_bad_choice_is_one_line_naming_the_choices():
    out = _run(sys.executable, "-m", "mgpu_backend", "demo", "--pipeline", "foo", cwd=str(REPO))
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "--pipeline" in lines[0] and "'two-stage'" in lines[0] and "'distilled'" in lines[0]


def test_help_shows_the_defaults():
    out = _run(sys.executable, "-m", "mgpu_backend", "generate", "--help", cwd=str(REPO))
    text = " ".join(out.stdout.split("options:", 1)[1].split())
    for option, default in (("--seed SEED", "(default: 0)"), ("--output OUTPUT", "(default: clip.mp4)"),
                            ("--fps FPS", "(default: 24.0)"), ("--tile-overlap TILE_OVERLAP", "(default: 5)")):
        start = text.index(option)
        assert default in text[start:start + 200], option


def test_a_bare_pytest_collects_the_modules_that_import_the_pack():
    """docs/testing.md runs tests with a bare `pytest` (the entry point; `python -m pytest` also puts the current
    folder on sys.path, the entry point does not). From the repository root, with no PYTHONPATH, the entry point
    beside this interpreter collects the modules that import `nodes/` (the pack's ComfyUI layer, which no install
    puts on the path) without an error: pyproject's `pythonpath = ["."]` (before issue 36: "No module named
    'nodes'")."""
    entry = Path(sys.executable).parent / "pytest"
    if not entry.exists():
        pytest.skip(f"no pytest entry point beside {sys.executable}")
    modules = ["tests/test_nodes_native.py", "tests/test_native_model_nodes.py", "tests/test_sp_sampler_inputs.py",
               "tests/test_golden.py"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = _run(str(entry), "--collect-only", "-q", "-p", "no:cacheprovider", *modules, cwd=REPO, env=env)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert "error" not in proc.stdout.lower() and "No module named" not in proc.stdout, tail
    assert re.search(r"^\d+ tests? collected", proc.stdout.strip().splitlines()[-1]), tail
    assert {line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line} == set(modules), tail
