"""How many of a directory's OSWorld task files import, and how many of those can run on
given slots with this host's file cache, per domain (no database access here).

The domain is a task file's folder (OSWorld's `evaluation_examples/examples/<domain>/`); a
list file (OSWorld's `test_all.json`: {domain: [task ids]}) restricts the count to its
tasks. `manage.py osworld_coverage` prints the table.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from datamanager.task_import import InvalidTaskRecord, read_task_file
from envmanager.osworld_file_cache import FileCache, task_urls
from envmanager.osworld_needs import lacking


@dataclass
class DomainCoverage:
    tasks: int = 0
    imported: int = 0
    offered: int = 0  # imported, and the slots offer all it needs (its files aside)
    runnable: int = 0  # offered, and the file cache has its files


@dataclass
class Coverage:
    domains: dict[str, DomainCoverage] = field(default_factory=dict)
    refusals: Counter[str] = field(default_factory=Counter)  # the reason -> tasks
    lacking: Counter[str] = field(default_factory=Counter)  # a need no slot offers -> tasks
    missing_files: int = 0  # tasks whose files the cache lacks

    def total(self) -> DomainCoverage:
        rows = self.domains.values()
        return DomainCoverage(
            sum(r.tasks for r in rows),
            sum(r.imported for r in rows),
            sum(r.offered for r in rows),
            sum(r.runnable for r in rows),
        )


def listed_files(root: Path, list_file: Path | None) -> list[Path]:
    """The task files under `root`: those `list_file` names ({domain: [ids]}), or all."""
    if list_file is None:
        return sorted(root.rglob("*.json"))
    listing = json.loads(list_file.read_text())
    return [root / domain / f"{task_id}.json" for domain, ids in listing.items() for task_id in ids]


def osworld_coverage(files: list[Path], *, offers: list[str], cache: FileCache) -> Coverage:
    """Import each file as the importer does (nothing is written) and place what imports."""
    coverage = Coverage()
    for path in files:
        row = coverage.domains.setdefault(path.parent.name, DomainCoverage())
        row.tasks += 1
        try:
            records = read_task_file(path)
        except InvalidTaskRecord as exc:
            coverage.refusals[str(exc).removeprefix(f"{path}: ")] += 1
            continue
        row.imported += 1
        record = records[0]
        lacks = lacking(record.env_config.get("needs", []), offers)
        missing = cache.missing(task_urls(record.env_config.get("osworld", {})))
        coverage.lacking.update(lacks)
        coverage.missing_files += bool(missing)
        row.offered += not lacks
        row.runnable += not lacks and not missing
    return coverage
