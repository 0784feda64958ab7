"""The documentation: every relative link resolves to a file of the repository, the README stays short, and no
Markdown file points at material outside the repository or names the papers by their old file numbers."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Markdown inline links and images: [text](target) / ![alt](target), target up to the first space or ')'.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# Reference-style link definitions: [label]: target
_REF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")

# Files outside the repository (the project's private notes) and the papers' old file numbers ("seed 000" named
# Kaul et al. 2024 and also reads like an RNG seed); papers are cited by first author, year and arXiv id.
FORBIDDEN = ("../shared", "shared/reference", "DESIGN.md", "seed_orthoadam", "seed_angpt", "seed_op_soap",
             "cpu_scale_phenomena", "anchor_optimizers.md", "anchor_models.md", "anchor_torchtitan.md",
             "two_node_slurm.md", "seed 000", "seed 001", "seed 002", "Seed 000", "Seed 001", "Seed 002")


def _markdown_files(*patterns: str) -> list[Path]:
    """The repository's files matching ``patterns`` (default: Markdown), tracked or new but not ignored."""
    patterns = patterns or ("*.md",)
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
        files = [ROOT / line for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):
        files = [p for pat in patterns for p in ROOT.rglob(pat) if ".git" not in p.parts and "outputs" not in p.parts]
    return sorted(p for p in files if p.is_file())


def _documentation() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]


def links(text: str) -> list[str]:
    """The link targets of a Markdown text, outside fenced code blocks and code spans."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", text))
    return _LINK.findall(text) + _REF.findall(text)


def broken_links(md: Path, root: Path = ROOT) -> list[str]:
    bad = []
    for target in links(md.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # http(s):, mailto:, ... and anchors within the page
        path = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (md.parent / path).resolve()
        try:
            rel = resolved.relative_to(root).as_posix()
        except ValueError:
            bad.append(f"{target} (outside the repository)")
            continue
        if not resolved.exists():
            bad.append(target)
    return bad


def test_link_parser():
    text = ("see [a](docs/a.md#x), ![p](img/p.png \"title\") and [web](https://example.org)\n"
            "`[not](a_link.md)`\n```\n[nor](this.md)\n```\n[ref]: docs/b.md\n")
    assert links(text) == ["docs/a.md#x", "img/p.png", "https://example.org", "docs/b.md"]


@pytest.mark.parametrize("md", _documentation(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(md):
    assert md.is_file()
    assert broken_links(md) == [], f"{md.relative_to(ROOT)} links to files that are not in the repository"


def test_broken_link_is_caught(tmp_path):
    root = (tmp_path / "repo").resolve()
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "launching.md").write_text("# launching\n")
    page = root / "docs" / "page.md"
    page.write_text("[gone](no_such_file.md) [ok](launching.md#exit-codes) [up](../../outside.md)\n")
    assert broken_links(page, root) == ["no_such_file.md", "../../outside.md (outside the repository)"]


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= 250, f"README.md has {n} lines; move detail into a page under docs/"


def test_docs_topic_pages_exist():
    for topic in ("configuration", "data", "parallelism", "launching", "checkpoints", "models", "attention",
                  "observatory", "quantisation", "hf", "tile_optimizers", "muon", "sweeps", "reproductions",
                  "testing"):
        assert (ROOT / "docs" / f"{topic}.md").is_file(), topic


def test_no_pointer_outside_the_repository():
    """Markdown, code, configs and scripts (this file names the words, so it is left out)."""
    offenders = []
    files = _markdown_files("*.md", "*.py", "*.toml", "*.sh", "*.slurm", ".ci/run")
    for md in (f for f in files if f.name != Path(__file__).name):
        text = " ".join(md.read_text(encoding="utf-8").split())  # a word broken across lines counts too
        for word in FORBIDDEN:
            if word in text:
                offenders.append(f"{md.relative_to(ROOT)}: {word!r}")
    assert offenders == []
