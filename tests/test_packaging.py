"""What a stranger's machine sees of the package: the wheel's top-level names, the fleet's import path, the CLI's
conventions, and the version in one place."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import mgpu_backend
from mgpu_backend import client as C

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
    the caller's PYTHONPATH names the pack folder: `kernels`, `nodes`, `tests` are not importable there."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), "/somewhere/else"]))
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    env = C.controller_env(runtime)
    entries = env["PYTHONPATH"].split(os.pathsep)
    assert entries[0] == str(runtime / "pythonpath") and entries[1:] == ["/somewhere/else"]
    assert sorted(os.listdir(entries[0])) == ["mgpu_backend"]
    probe = ("import importlib.util as u, mgpu_backend, sys; "
             f"print([n for n in {NOT_OURS!r} if u.find_spec(n) is not None]); print(mgpu_backend.__file__)")
    out = _run(sys.executable, "-c", probe, env=env, cwd=str(runtime))
    assert out.returncode == 0, out.stderr
    shadowing, origin = out.stdout.split("\n")[:2]
    assert shadowing == "[]"
    assert Path(origin).resolve() == (REPO / "mgpu_backend" / "__init__.py").resolve()
    C.controller_env(runtime)  # a second start reuses the link (atomic replace; no error when it exists)
    assert sorted(os.listdir(entries[0])) == ["mgpu_backend"]


def test_the_repository_kernels_folder_is_not_a_package():
    assert (REPO / "kernels").is_dir() and not (REPO / "kernels" / "__init__.py").exists()


def test_one_version_everywhere():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["version"] == mgpu_backend.__version__
    out = _run(sys.executable, "-m", "mgpu_backend", "--version", cwd=str(REPO))
    assert out.returncode == 0 and out.stdout.strip() == f"ltx2-multigpu {mgpu_backend.__version__}"


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
