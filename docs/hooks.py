"""mkdocs hooks (mkdocs.yml `hooks:`; not a page of the site).

docs/index.md takes the README's getting-started section (`--8<-- "README.md:NAME"` names the
README's `[start:NAME]` ... `[end:NAME]` markers). The README links pages as the repository
shows them (`docs/tests.md`); on the site they sit beside index.md, so those links lose their
`docs/`, and mkdocs checks them like any other."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parent.parent / "README.md"
INCLUDE = re.compile(r'^--8<-- "README\.md:([a-z-]+)"$', re.M)


def readme_section(name: str) -> str:
    text = README.read_text()
    start, end = f"<!-- --8<-- [start:{name}] -->\n", f"<!-- --8<-- [end:{name}] -->"
    if start not in text or end not in text:
        raise ValueError(f"README.md has no section {name!r} ({start.strip()} ... {end})")
    return text[text.index(start) + len(start) : text.index(end)]


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    included = INCLUDE.sub(lambda m: readme_section(m.group(1)), markdown)
    if included == markdown:
        return markdown
    return re.sub(r"\]\(docs/", "](", included)
