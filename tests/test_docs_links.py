"""The design facts stay in the repository (issue 34): no file cites a document outside it, and every reference to a
page of `docs/` — from code, tests, bench scripts or the pages themselves — names a page and a heading that exist.

- No file of the repository (code, tests, bench, docs, README, CHANGELOG) cites the former design brief or its
  companions (`FORBIDDEN`) or a path outside the repository (`../shared`, `/work/`). Recorded output under
  `bench/results/` — its `.txt` / `.json` files and the fenced blocks of its `.md` files — may show the absolute paths
  of the machine a run was recorded on (a log line is not a citation); nothing else may.
- Every `docs/<page>.md` or `docs/<page>.md#anchor` written anywhere, and every Markdown link of a
  `docs/design/` page, resolves: the file exists and the anchor is one of its headings (GitHub's slug).
- Every page of `docs/design/` is listed in its index, the index is linked from `docs/README.md`, and the modules,
  `bench/` and `tests/` files and `bench/results/` files a design page names exist.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DESIGN = REPO / "docs" / "design"

# Citations of documents that are not in the repository (the patterns are built so this file does not match them).
FORBIDDEN = {
    "the former design brief": re.compile("DESIGN" + r"(?:\.md|\s*§|\s+section\b)"),
    "the native MODEL feasibility notes": re.compile("NATIVE" + r"-MODEL\.md"),
    "the development harness outside the repository": re.compile("comfyui" + r"-harness"),
    "the seed documents": re.compile(r"\bseeds?/0\d\d_|" + "`000" + r"_…`"),
    "a path outside the repository": re.compile(r"\.\./" + "shared" + r"\b|(?<![\w.])/" + "work" + r"/"),
}
OUTSIDE_PATH = "a path outside the repository"

TEXT_SUFFIXES = {".py", ".md", ".txt", ".json", ".toml", ".cfg", ".ini", ".yaml", ".yml", ".sh", ".js", ".html",
                 ".css", ".svg"}
TEXT_NAMES = {".gitignore", "LICENSE", "run"}
DOC_REF = re.compile(r"(?<![\w/.-])docs/((?:[\w-]+/)*[\w.-]+\.md)(#[\w-]+)?")
# the pack's folders and layer packages: a path under another folder is a public source's (diffusers, ComfyUI)
OUR_FOLDERS = ("mgpu_backend", "nodes", "kernels", "protocol", "models", "weights", "engine", "splits", "stages",
               "serving", "testing")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


def repo_files() -> list[Path]:
    """The files git knows and the untracked ones it does not ignore (what a commit would carry); without git, every
    file outside dot-folders and caches."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout
        paths = [REPO / name for name in out.splitlines() if name]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in REPO.rglob("*")
                 if not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(REPO).parts)]
    return sorted(p for p in paths if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES))


def _text(path: Path) -> str | None:
    try:
        return path.read_text()
    except UnicodeDecodeError:
        return None


def _recorded_output(path: Path, text: str) -> str:
    """The part of a results file that is a run's recorded output, blanked out (line numbers kept)."""
    rel = path.relative_to(REPO).as_posix()
    if not rel.startswith("bench/results/"):
        return text
    if path.suffix in (".txt", ".json"):
        return ""
    return re.sub(r"```.*?```", lambda m: "\n" * m[0].count("\n"), text, flags=re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, Markdown marks and punctuation dropped, spaces to hyphens (the same
    rule as `tests/test_docs_commands.py`)."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def _check_target(where: str, dest: Path, anchor: str, problems: list[str]) -> None:
    if not dest.is_file():
        problems.append(f"{where}: {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}: no such page")
    elif anchor and anchor not in anchors(dest):
        problems.append(f"{where}: no heading #{anchor} in {dest.relative_to(REPO)}")


def test_no_file_cites_a_document_outside_the_repository():
    problems = []
    for path in repo_files():
        if path == Path(__file__).resolve():
            continue
        text = _text(path)
        if text is None:
            continue
        recorded = _recorded_output(path, text)
        for what, pattern in FORBIDDEN.items():
            for m in pattern.finditer(recorded if what == OUTSIDE_PATH else text):
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{path.relative_to(REPO)}:{line}: cites {what} ({m[0]!r})")
    assert not problems, "citations outside the repository:\n" + "\n".join(problems)


def test_every_docs_reference_names_a_page_and_heading_that_exist():
    problems, seen = [], 0
    for path in repo_files():
        text = _text(path)
        if text is None or path.relative_to(REPO).as_posix().startswith("bench/results/"):
            continue
        for m in DOC_REF.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            _check_target(f"{path.relative_to(REPO)}:{line}", REPO / "docs" / m[1], (m[2] or "#")[1:], problems)
            seen += 1
    assert not problems, "broken docs/ references:\n" + "\n".join(problems)
    assert seen >= 50  # the code cites the design pages (issue 34): a scan that finds nothing is broken


def test_the_design_pages_links_resolve():
    problems = []
    for page in sorted(DESIGN.glob("*.md")):
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in MD_LINK.findall(text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            _check_target(f"docs/design/{page.name}: link {target}", dest, anchor, problems)
    assert not problems, "\n".join(problems)


def test_the_design_index_lists_every_page_and_the_docs_index_links_it():
    pages = {p.name for p in DESIGN.glob("*.md")} - {"README.md"}
    assert len(pages) >= 8, pages
    index = (DESIGN / "README.md").read_text()
    listed = set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    assert listed == pages, f"not in docs/design/README.md: {sorted(pages - listed)}; listed but absent: " \
                            f"{sorted(listed - pages)}"
    assert "](design/README.md)" in (REPO / "docs" / "README.md").read_text()


def test_the_files_a_design_page_names_exist():
    results = {p.name for p in (REPO / "bench" / "results").iterdir()}
    for page in sorted(DESIGN.glob("*.md")):
        text = page.read_text()
        for path in set(re.findall(r"(?<![\w/.])((?:bench|tests)/[\w/.-]+\.(?:py|md|txt|json))", text)):
            assert (REPO / path).is_file(), f"docs/design/{page.name} names {path}, which does not exist"
        for name in set(re.findall(r"\b([\w-]+_(?:h200|2xh200|cpu)(?:_[\w]+)?\.(?:txt|json|md))\b", text)):
            assert name in results, f"docs/design/{page.name} names bench/results/{name}: missing"
        # module paths, from the repository root or (the short form the pages use) from mgpu_backend/
        for path in set(re.findall(r"`((?:%s)/[\w/]*\w+\.py)" % "|".join(OUR_FOLDERS), text)):
            assert (REPO / path).is_file() or (REPO / "mgpu_backend" / path).is_file(), \
                f"docs/design/{page.name} names {path}, which does not exist"


def test_the_checks_catch_what_they_are_for():
    """The patterns and the slug rule on known inputs (a check that cannot fail is a defect)."""
    brief = "DESIGN"
    assert FORBIDDEN["the former design brief"].search(f"see {brief}.md §4")
    assert FORBIDDEN["the former design brief"].search(f"({brief} §9: 12.8 GB")
    assert FORBIDDEN["the former design brief"].search(f"({brief} section 5: audio")
    assert not FORBIDDEN["the former design brief"].search("by design, section 5")
    assert FORBIDDEN[OUTSIDE_PATH].search("bash ../" + "shared/tools/x.sh")
    assert FORBIDDEN[OUTSIDE_PATH].search("/" + "work/main/mgpu_backend/x.py")
    assert not FORBIDDEN[OUTSIDE_PATH].search("docs/design/models.md and the network/work/ folder")
    assert slug("The substrate: diffusers") == "the-substrate-diffusers"
    assert slug("LTX-2.5") == "ltx-25"
    assert slug("What crosses a process: `protocol/`") == "what-crosses-a-process-protocol"
    m = DOC_REF.search("(docs/design/models.md#shapes; exactly")
    assert m and m[1] == "design/models.md" and m[2] == "#shapes"
    problems = []
    _check_target("x", DESIGN / "models.md", "no-such-heading", problems)
    _check_target("x", DESIGN / "no-such-page.md", "", problems)
    assert len(problems) == 2, problems
