"""The README stays a five-minute read and the docs pages stay reachable: every page is in the
site's nav, and every relative link in README.md and docs/*.md reaches a file (and a heading, where
it names one). CI builds the site itself (`mkdocs build --strict` in .ci/run); these checks need
no mkdocs and run in the fast suite."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 250
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# Where the code and the scripts point a reader: a docs page by path, or a README section by name.
POINTERS = ("hpc", "hpc_dev", "tests", "scripts", "sbatch", "configs", ".ci")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def nav_pages(nav) -> list[str]:
    """The page paths of mkdocs.yml's nav, at any depth."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in nav_pages(value)]
    return []


def heading_text(line: str) -> str:
    text = line.lstrip("#").strip()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link: its text
    return re.sub(r"[`*_]", "", text)


def slug_mkdocs(text: str) -> str:
    """Python-Markdown's toc slugify, which mkdocs uses for heading ids."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def slug_github(text: str) -> str:
    """GitHub's heading anchors, where README.md and the docs are also read."""
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The heading anchors both renderers give the file (an anchor must work on both)."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    titles = [heading_text(line) for line in text.splitlines() if re.match(r"#{1,6} ", line)]
    return {slug_mkdocs(t) for t in titles} & {slug_github(t) for t in titles}


def links(path: Path) -> list[str]:
    """The link targets in a markdown file, outside code."""
    text = CODE_SPAN.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))
    return [m["target"] for m in LINK.finditer(text)]


def test_the_readme_is_a_five_minute_read():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: move a topic to a page under docs/ "
        "(and into mkdocs.yml's nav)")


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["docs_dir"] == "docs"
    nav = nav_pages(config["nav"])
    on_disk = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(set(on_disk) - set(nav)) == [], "pages under docs/ that mkdocs.yml's nav leaves out"
    assert sorted(set(nav) - set(on_disk)) == [], "nav entries with no page under docs/"
    assert len(nav) == len(set(nav)), f"a page listed twice in the nav: {nav}"


def test_every_relative_link_reaches_a_file_and_its_heading():
    broken = []
    for page in pages():
        for target in links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check here
                continue
            name = page.relative_to(ROOT).as_posix()
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            if not dest.exists():
                broken.append(f"{name}: {target}: no such file")
                continue
            if page.parent == DOCS and not dest.is_relative_to(DOCS):
                broken.append(f"{name}: {target}: outside docs/, which the site does not serve")
            if anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                broken.append(f"{name}: {target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert broken == [], "\n".join(broken)


def test_the_readme_links_every_docs_page():
    """'Where to read more': a newcomer finds every page from the README."""
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md") if t.startswith("docs/")}
    pages_ = {p.resolve() for p in DOCS.glob("*.md") if p.name != "index.md"}
    assert sorted(p.name for p in pages_ - linked) == [], "docs pages the README never links"


def test_what_the_code_points_a_reader_to_exists():
    """`docs/NAME.md` named in code, tests, scripts and configs is a page; a `README, "SECTION"` or
    `the README's SECTION section` names a heading the README has."""
    readme_headings = [heading_text(line) for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
                       if re.match(r"#{1,6} ", line)]
    missing = []
    for top in POINTERS:
        for path in sorted((ROOT / top).rglob("*")):
            if (not path.is_file() or path == Path(__file__).resolve() or "__pycache__" in path.parts
                    or path.suffix in {".pyc", ".safetensors", ".parquet"}):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            name = path.relative_to(ROOT).as_posix()
            for page in re.findall(r"\bdocs/[\w-]+\.md\b", text):
                if not (ROOT / page).exists():
                    missing.append(f"{name}: {page}")
            sections = re.findall(r"README, \"([^\"]+)\"", text) + re.findall(r"README's ([A-Z][\w ]*?) section", text)
            for section in sections:
                if not any(h.startswith(section) for h in readme_headings):
                    missing.append(f"{name}: README section {section!r}")
    assert missing == [], "\n".join(missing)
