"""The user's manual stays true (issue 28): every shell command in README.md and docs/*.md is run here or marked with
what it needs; the commands of the pack's own CLI parse with its real parser; the scripts, test files and results
files the pages name exist (with the options used); the links between the pages resolve; the troubleshooting page's
messages are still the code's.

A ```bash block is either
- unmarked: each of its commands must be in `RUN`, and `test_the_commands_it_runs_work` runs them;
- marked in an HTML comment on the line before it: `<!-- needs: gpu, model-files, comfyui, network, long-cpu -->`
  (what this suite does not have or should not spend), `<!-- ci: .ci/run runs this -->` (the README's test command,
  checked to be what `.ci/run` extracts) or `<!-- tested-by: tests/FILE.py::TEST -->` (another test runs it).
"""
from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mgpu_backend.serving.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NEEDS = {"gpu", "model-files", "comfyui", "network", "long-cpu"}
MARKER = re.compile(r"^<!--\s*(needs|ci|tested-by):\s*(.*?)\s*-->$")
README_MAX_LINES = 250

# The unmarked commands, as written in the pages, and what each must print (a substring of stdout). They run with
# this interpreter, from the repository, against a private runtime directory (no controller of the user is touched).
RUN = {
    "python -m mgpu_backend --version": "ltx2-multigpu ",
    "python -m mgpu_backend generate --help": "--devices",
    "python -m mgpu_backend status": "no controller is running",
    "python -m mgpu_backend stop": "no controller is running",
}

# results files a page names as where a measurement *will* go (not measured yet: the page says so)
NOT_MEASURED_YET = {"e2e_modes_h200.txt", "e2e_ltx25_modes_h200.txt"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    text: str
    marker: tuple[str, str] | None  # (kind, value) of the comment right before the block

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def bash_blocks(page: Path) -> list[Block]:
    lines = page.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            start, body = i, []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            m = MARKER.match(before)
            out.append(Block(page, start + 1, "\n".join(body), (m[1], m[2]) if m else None))
        i += 1
    return out


BLOCKS = [b for page in PAGES for b in bash_blocks(page)]


def commands(text: str) -> list[str]:
    """The block's commands, one per logical line: continuations joined, comments and blank lines dropped."""
    out = []
    for line in re.sub(r"\\\n\s*", " ", text).split("\n"):
        words = shlex.split(line, comments=True)
        if not words:
            continue
        bare = re.sub(r"\s+#\s.*$", "", line)  # without a trailing comment, when that is what `#` starts
        if bare != line and shlex.split(bare) == words:
            line = bare
        out.append(line.strip())
    return out


def inline_spans(page: Path) -> list[str]:
    """`code` spans outside fenced blocks, whitespace collapsed (a span may wrap over lines)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", text)]


def test_the_readme_is_short_and_the_docs_are_there():
    assert len((REPO / "README.md").read_text().split("\n")) <= README_MAX_LINES
    names = {p.name for p in PAGES}
    for name in ("README.md", "install-and-hardware.md", "nodes.md", "use-your-own-workflow.md", "cli.md",
                 "performance.md", "troubleshooting.md", "architecture.md", "sharded-weights.md", "how-it-works.md",
                 "testing.md", "publishing.md"):
        assert name in names, name
    index = (REPO / "docs" / "README.md").read_text()
    for page in PAGES[1:]:
        if page.name != "README.md":
            assert f"]({page.name})" in index, f"docs/README.md does not link {page.name}"


def test_every_bash_block_is_run_or_marked():
    assert BLOCKS, "no ```bash block found"
    for block in BLOCKS:
        if block.marker is None:
            unknown = [c for c in commands(block.text) if c not in RUN]
            assert not unknown, (f"{block.where()}: {unknown} is neither run by this test (RUN) nor marked "
                                 f"<!-- needs: … --> before its block")
            continue
        kind, value = block.marker
        if kind == "needs":
            needs = {v.strip() for v in value.split(",")}
            assert needs and needs <= NEEDS, f"{block.where()}: needs {needs - NEEDS}; known: {sorted(NEEDS)}"
        elif kind == "ci":
            assert value == ".ci/run runs this", block.where()
            assert block.text == _ci_command(), f"{block.where()} is marked as CI's command but .ci/run runs another"
        else:  # tested-by
            file, _, name = value.partition("::")
            source = (REPO / file).read_text()
            assert re.search(rf"^def {re.escape(name)}\(", source, re.M), f"{block.where()}: no test {value}"


def _ci_command() -> str:
    """The line `.ci/run` extracts from README.md, with its own awk program."""
    script = (REPO / ".ci" / "run").read_text()
    program = re.search(r"awk '([^']+)' README\.md", script)[1]
    out = subprocess.run(["awk", program, "README.md"], cwd=REPO, capture_output=True, text=True, check=True)
    return out.stdout.rstrip("\n")


def test_the_ci_command_is_the_readmes_second_quick_start_block():
    quick = [b for b in BLOCKS if b.page.name == "README.md" and b.page.parent == REPO][:2]
    assert quick[1].marker == ("ci", ".ci/run runs this")
    assert quick[1].text == _ci_command() and "python -m pytest" in quick[1].text


def test_the_commands_it_runs_work(tmp_path):
    found = {c for b in BLOCKS if b.marker is None for c in commands(b.text)}
    assert set(RUN) <= found, f"RUN lists commands no page has any more: {set(RUN) - found}"
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "LTX2_MGPU_RUNTIME_DIR": str(runtime),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for command, expected in RUN.items():
        argv = shlex.split(command)
        assert argv[0] == "python"
        done = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, (command, done.stderr[-2000:])
        assert expected in done.stdout, (command, done.stdout[-2000:])


def _cli_options() -> dict[str | None, set[str]]:
    """The option strings of the CLI's top level (key None) and of each subcommand."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    out = {None: set(parser._option_string_actions)}
    out.update({name: set(p._option_string_actions) for name, p in sub.choices.items()})
    return out


def test_every_cli_command_in_a_block_parses():
    """Whole commands in blocks (marked or not) parse with the CLI's own parser, without running."""
    seen = 0
    for block in BLOCKS:
        for command in commands(block.text):
            if not command.startswith("python -m mgpu_backend"):
                continue
            argv = shlex.split(command)[3:]
            seen += 1
            try:
                build_parser().parse_args(argv)
            except SystemExit as exc:  # --help / --version exit 0 after printing
                assert exc.code == 0, f"{block.where()}: {command!r} does not parse (exit {exc.code})"
    assert seen >= 5


def test_every_cli_fragment_in_the_text_names_real_options():
    """`python -m mgpu_backend SUB …` spans in the text (usage forms, fragments with `…`): the subcommand exists and
    every `--option` in the span is one of its options."""
    options = _cli_options()
    seen = 0
    for page in PAGES:
        for span in inline_spans(page):
            if not span.startswith("python -m mgpu_backend"):
                continue
            words = [w for w in span.split()[3:] if w != "…"]
            sub = words[0] if words and not words[0].startswith("-") else None
            assert sub in options, f"{page.name}: {span!r}: no subcommand {sub!r}"
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", span):
                assert flag in options[sub] or flag in options[None], f"{page.name}: {span!r}: no option {flag}"
            seen += 1
    assert seen >= 5


def _argparse_options(script: Path) -> set[str]:
    """The option strings a script's `add_argument` calls declare (read, not imported: bench scripts need a GPU)."""
    found = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            found |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return found


def test_named_scripts_tests_and_results_exist():
    """Every `bench/…py`, `tests/…py` and results file a page names exists, and a bench script's options in a
    command are ones it declares."""
    results = {p.name for p in (REPO / "bench" / "results").iterdir()}
    for page in PAGES:
        text = page.read_text()
        for path in set(re.findall(r"(?<![\w/.])((?:bench|tests)/[\w/.-]+\.py)", text)):
            assert (REPO / path).is_file(), f"{page.name} names {path}, which does not exist"
        for name in set(re.findall(r"\b([\w-]+_(?:h200|2xh200|cpu)(?:_[\w]+)?\.(?:txt|json|md))\b", text)):
            assert name in results or name in NOT_MEASURED_YET, f"{page.name} names bench/results/{name}: missing"
        for span in inline_spans(page) + [c for b in bash_blocks(page) for c in commands(b.text)]:
            m = re.search(r"python (bench/\w+\.py)(.*)", span)
            if m:
                declared = _argparse_options(REPO / m[1])
                for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m[2]):
                    assert flag in declared, f"{page.name}: {span!r}: {m[1]} has no option {flag}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_links_between_the_pages_resolve():
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.name}: link to {target}: no such file"
            if anchor:
                assert anchor in _anchors(dest), f"{page.name}: link to {target}: no such heading in {dest.name}"


def test_no_shell_command_hides_in_an_indented_block():
    """Commands belong in ```bash blocks (so the checks above see them), not in 4-space indented code."""
    pattern = re.compile(r"^ {4}(cd|curl|python3?|pip|git|pytest|bash|COMFYUI_\w+=|PYTHONPATH=)\b", re.M)
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        found = pattern.findall(text)
        assert not found, f"{page.name}: indented shell commands {found}: put them in a ```bash block"


def test_troubleshooting_messages_are_the_codes():
    """Each `message` in a heading of docs/troubleshooting.md (pieces between `…`) is still in the pack's code."""
    source = "\n".join(p.read_text() for d in ("mgpu_backend", "nodes") for p in (REPO / d).rglob("*.py"))
    headings = re.findall(r"^### (.+)$", (REPO / "docs" / "troubleshooting.md").read_text(), re.M)
    checked = 0
    for heading in headings:
        for span in re.findall(r"`([^`]+)`", heading):
            for piece in (p.strip() for p in span.split("…")):
                if piece:
                    assert piece in source, f"troubleshooting.md quotes {piece!r}, which the code no longer says"
                    checked += 1
    assert checked >= 20


def test_the_comfyui_install_block_runs_as_written(tmp_path):
    """docs/install-and-hardware.md's ComfyUI install block, run as written, in order, by bash -e from the folder that
    holds a `ComfyUI` folder whose `venv` is this interpreter's environment (which has the pack's requirements):
    the clone lands in `ComfyUI/custom_nodes/ltx2-multigpu` and pip, run from where the block's `cd` left it, finds
    the requirements file (before issue 36 it ran `ComfyUI/venv/bin/pip` from inside `ComfyUI/custom_nodes`: no such
    file). Only `<URL of this repository>` is replaced (by this checkout); pip runs with `PIP_DRY_RUN=1` and
    `PIP_NO_INDEX=1` in its environment, so it resolves the requirements against the installed packages and changes
    nothing."""
    page = REPO / "docs" / "install-and-hardware.md"
    block = next(b for b in bash_blocks(page)
                 if b.marker == ("tested-by", "tests/test_docs_commands.py::test_the_comfyui_install_block_runs_as_written"))
    comfy = tmp_path / "ComfyUI"
    (comfy / "custom_nodes").mkdir(parents=True)
    (comfy / "venv").symlink_to(sys.prefix, target_is_directory=True)
    if not (comfy / "venv" / "bin" / "python").exists():
        pytest.skip(f"this interpreter's environment ({sys.prefix}) has no bin/python")
    script = block.text.replace("<URL of this repository>", shlex.quote(str(REPO)))
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")},
           "PIP_DRY_RUN": "1", "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{block.where()} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert (comfy / "custom_nodes" / "ltx2-multigpu" / "requirements.txt").is_file()
    assert (comfy / "custom_nodes" / "ltx2-multigpu" / "nodes" / "__init__.py").is_file()
    assert "Would install" not in proc.stdout, proc.stdout  # every requirement resolved, none to fetch
