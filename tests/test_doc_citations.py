"""A pointer to a section names one that exists: `README "X"` and `docs/F.md, "X"` in the
examples, docs and code resolve to a heading of that file (or a bold run-in heading such as
``**Whose checkpoints.**``). issue #35: examples/dev-run.yaml cited a README heading that did
not exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CITATION = re.compile(r'(README|docs/[a-z0-9-]+\.md),? "([^"\n]+)"')
SEARCHED = ("examples", "docs", "api", "operator", "trainer", "rollout", "storage", "sandboxes")


def sections(markdown: Path) -> set[str]:
    text = markdown.read_text()
    headings = {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", text, re.M)}
    run_in = {m.group(1).strip() for m in re.finditer(r"\*\*([^*\n]+?)\.?\*\*", text)}
    return headings | run_in


def citations() -> list[tuple[str, str, str]]:
    found = []
    files = [ROOT / "README.md"]
    for folder in SEARCHED:
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".md", ".yaml", ".py")]
    for path in files:
        for match in CITATION.finditer(path.read_text(errors="replace")):
            target = "README.md" if match.group(1) == "README" else match.group(1)
            found.append((str(path.relative_to(ROOT)), target, match.group(2)))
    return found


@pytest.mark.parametrize(("source", "target", "section"), citations())
def test_a_cited_section_exists(source: str, target: str, section: str) -> None:
    known = sections(ROOT / target)
    assert any(s == section or s.startswith(section) for s in known), (
        f"{source} cites {target}, {section!r}, which has no such heading"
    )
