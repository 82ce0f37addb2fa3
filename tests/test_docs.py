"""The documents a newcomer reads: their links lead somewhere, and the settings page is the code's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvxferd.ops import config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_and_headings_that_exist(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        assert dest.exists(), f"{doc.name}: link to {target} leads nowhere"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{doc.name}: {target}: no such heading in {dest.name}"


def test_configuration_page_lists_every_setting_with_its_default():
    """docs/CONFIGURATION.md has a row per Config field, with the field's default, and no other setting."""
    text = (ROOT / "docs/CONFIGURATION.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \| `([^`]*)`", text, flags=re.M))
    defaults = {f"{section}.{key}": value for section, values in config.Config().to_dict().items()
                for key, value in values.items()}
    assert set(rows) == set(defaults), (sorted(set(defaults) - set(rows)), sorted(set(rows) - set(defaults)))
    for key, default in defaults.items():
        shown = rows[key]
        if isinstance(default, bool):
            assert shown == str(default).lower(), key
        elif isinstance(default, (int, float)):
            assert float(shown) == float(default), key
        else:  # strings and lists, as TOML writes them
            assert shown == (f'"{default}"' if isinstance(default, str) else
                             "[" + ", ".join(f'"{v}"' for v in default) + "]"), key
