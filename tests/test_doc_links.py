"""Every relative link of the project's Markdown files leads somewhere: the file or folder it
names exists beside the page, and an anchor into a Markdown page names one of its headings (as
GitHub derives a heading's anchor). Links inside code blocks and to web addresses are not
checked. And every repository path the pages a reader is sent to name in inline code
(`robust_attn/...`, `zoo/...`, ...) exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {".git", ".venv", "runs", "node_modules", "build", "dist"}
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.md") if not SKIP & set(p.relative_to(ROOT).parts))


def _without_blocks(text: str) -> str:
    return re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)


def _prose(text: str) -> str:
    """The page without its fenced code blocks and inline code."""
    return re.sub(r"`[^`\n]*`", "", _without_blocks(text))


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: its text (a link's text, code without its backticks) in
    lower case, punctuation but hyphens and underscores dropped, spaces to hyphens."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", _without_blocks(page.read_text()), flags=re.M)
    seen: dict[str, int] = {}
    found = set()
    for h in headings:
        a = anchor(h)
        found.add(a if a not in seen else f"{a}-{seen[a]}")
        seen[a] = seen.get(a, 0) + 1
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for match in LINK.finditer(_prose(page.read_text())):
        target = match.group(1) or match.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target, flags=re.I):   # https:, mailto:, ...
            continue
        path, _, fragment = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target} (no {where.relative_to(ROOT) if where.is_relative_to(ROOT) else where})")
        elif fragment and where.suffix == ".md" and fragment not in _anchors(where):
            broken.append(f"{target} (no heading of {where.name} has the anchor #{fragment})")
    return broken


def test_every_relative_link_of_the_documentation_resolves():
    pages = _pages()
    assert ROOT / "README.md" in pages and len(pages) > 10
    broken = {str(p.relative_to(ROOT)): b for p in pages if (b := broken_links(p))}
    assert not broken, "\n".join(f"{page}: {link}" for page, links in broken.items() for link in links)


def test_the_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "there.md").write_text("# A heading, with punctuation\n\n## Twice\n\n## Twice\n\n"
                                       "## Efficiency (`efficiency_cpu.json`)\n\n## The near_miss module\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#a-heading-with-punctuation) [ok](there.md#twice-1) "
                    "[ok](there.md#efficiency-efficiency_cpujson) [ok](there.md#the-near_miss-module) "
                    "[ok](https://example.org/x) ![ok](there.md)\n[bad](missing.md) [bad](there.md#nowhere)\n"
                    "```\n[in code](nowhere.md)\n```\n`[inline](nowhere.md)`\n")
    assert [b.split(" ")[0] for b in broken_links(page)] == ["missing.md", "there.md#nowhere"]


# a repository path in inline code: `robust_attn/attacks/square.py`, `zoo/manifest.json`, `zoo/studies/`,
# or a module by its place in the package, `utils/radius.py` (not runs/ or data/: those are also the
# folders a user's runs and data go to)
PACKAGE = ("attacks", "commands", "importers", "layers", "models", "protocols", "reports", "shifts", "sources",
           "study", "train", "utils")
PATH = re.compile(r"`((?:" + "|".join(("robust_attn", "zoo", "benchmarks", "tests", "docs") + PACKAGE)
                  + r")/[\w./-]*?)/?(?::[\w.]+)?`")


def missing_paths(page: Path, root: Path = ROOT) -> list[str]:
    """The paths in the page's inline code (outside code blocks) that exist neither from the
    repository root nor, for a page naming a module by its place in the package, under robust_attn/."""
    return [m.group(1) for m in PATH.finditer(_without_blocks(page.read_text()))
            if not (root / m.group(1)).exists() and not (root / "robust_attn" / m.group(1)).exists()]


def test_every_repository_path_the_documentation_names_exists():
    pages = [ROOT / "README.md", ROOT / "zoo" / "README.md", ROOT / "benchmarks" / "README.md",
             ROOT / "reports" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = sum(len(PATH.findall(_without_blocks(p.read_text()))) for p in pages)
    assert named > 150
    missing = {str(p.relative_to(ROOT)): m for p in pages if (m := missing_paths(p))}
    assert not missing, "\n".join(f"{page}: {path}" for page, paths in missing.items() for path in paths)


def test_the_path_checker_finds_a_module_that_moved(tmp_path):
    (tmp_path / "robust_attn" / "utils").mkdir(parents=True)
    (tmp_path / "robust_attn" / "utils" / "radius.py").write_text("")
    page = tmp_path / "page.md"
    page.write_text("`robust_attn/utils/radius.py` `utils/radius.py`... no: `robust_attn/commands/eps.py`, "
                    "`commands/eps.py`, `robust_attn/utils/` `robust_attn/utils/radius.py:parse_radius` "
                    "`runs/my-run`\n```\n`zoo/not/here`\n```\n")
    assert missing_paths(page, tmp_path) == ["robust_attn/commands/eps.py", "commands/eps.py"]
