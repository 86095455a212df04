"""Design notes the code refers to live in the repository (docs/), not beside it."""

from __future__ import annotations

import re

from tests.support.paths import REPO_ROOT

SOURCES = [p for folder in ("hsstore", "pipelines", "benchmarks", "recipes") for p in (REPO_ROOT / folder).rglob("*") if p.suffix in (".py", ".yaml")]


def test_every_doc_the_code_names_exists() -> None:
    assert len(SOURCES) > 50
    missing = []
    for path in SOURCES:
        text = path.read_text()
        for ref in re.findall(r"\bdocs/[\w./-]+\.md\b", text):
            if not (REPO_ROOT / ref).exists():
                missing.append(f"{path.relative_to(REPO_ROOT)}: {ref}")
        if re.search(r"(?<![\w/])DESIGN\.md", text):
            missing.append(f"{path.relative_to(REPO_ROOT)}: DESIGN.md (not in the repository; use docs/design.md)")
    assert missing == []


def test_reference_recipes_need_nothing_outside_the_repository() -> None:
    """The README's commands run on a fresh clone: the reference recipes name bundled files only."""
    import yaml

    recipes = sorted((REPO_ROOT / "recipes" / "reference").glob("*.yaml"))
    assert recipes
    for path in recipes:
        assert all("../" not in line.split("#", 1)[0] for line in path.read_text().splitlines()), path
        recipe = yaml.safe_load(path.read_text())
        named = [*(recipe.get("data") or []), recipe.get("prompts"), recipe.get("target")]
        for name in filter(None, named):
            assert (REPO_ROOT / name).exists(), f"{path.name}: {name}"
