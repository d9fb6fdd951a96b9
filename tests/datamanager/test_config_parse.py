"""A run's settings are parsed once where the run is loaded and passed down: few places
parse a RunConfig, and a loaded run parses its row once, again only when its config changed."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from datamanager.config import RunConfig
from datamanager.models import Run

ROOT = Path(__file__).resolve().parents[2]
# The production packages: the import-linter's root packages (bench/ scripts and tests are not).
PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
    "root_packages"
]
# The places that may parse one: a stored run (`Run.cfg`), a run's settings as they come in
# (`run_config_validate`), the presets `make run` creates (`main_run_config`).
MOST_PARSE_SITES = 3


def parse_sites() -> list[str]:
    """Every `RunConfig.from_dict(...)` call in the production packages, as path:line."""
    sites = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_dict"
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "RunConfig"
                ):
                    sites.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return sites


def test_a_run_config_is_parsed_in_at_most_three_places() -> None:
    sites = parse_sites()
    assert any(s.startswith("datamanager/models/runs.py:") for s in sites), sites
    assert len(sites) <= MOST_PARSE_SITES, (
        f"RunConfig.from_dict is called in {len(sites)} places: {sites}. Parse where the run "
        "is loaded (`run.cfg`) and pass the RunConfig down"
    )


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The configs RunConfig.from_dict is asked to parse from here on."""
    seen: list[dict] = []
    original = RunConfig.from_dict.__func__  # type: ignore[attr-defined]

    def counting(cls: type[RunConfig], data: dict | None) -> RunConfig:
        seen.append(data or {})
        return original(cls, data)

    monkeypatch.setattr(RunConfig, "from_dict", classmethod(counting))
    return seen


def test_a_loaded_run_parses_its_settings_once(parses: list[dict]) -> None:
    run = Run(name="once", config=RunConfig.from_dict({"trainer": {"lr": 3e-4}}).to_dict())
    parses.clear()
    first = run.cfg
    assert run.cfg is first and run.cfg.trainer is first.trainer
    assert first.trainer.lr == 3e-4 and len(parses) == 1


def test_a_changed_config_is_parsed_again(parses: list[dict]) -> None:
    run = Run(name="changes", config={"trainer": {"lr": 3e-4}})
    assert run.cfg.trainer.lr == 3e-4
    run.config = {"trainer": {"lr": 1e-4}}  # reassigned
    assert run.cfg.trainer.lr == 1e-4
    run.config["trainer"]["lr"] = 2e-4  # changed in place
    assert run.cfg.trainer.lr == 2e-4
    assert run.cfg is run.cfg and len(parses) == 3


@pytest.mark.django_db
def test_refresh_from_db_gives_the_stored_settings(parses: list[dict]) -> None:
    run = Run.objects.create(name="stored", config=RunConfig().to_dict())
    assert run.cfg.trainer.lr == RunConfig().trainer.lr
    Run.objects.filter(pk=run.pk).update(config={**run.config, "trainer": {"lr": 5e-5}})
    run.refresh_from_db()
    assert run.cfg.trainer.lr == 5e-5
    run.refresh_from_db()  # the same settings again: nothing to parse
    assert run.cfg is run.cfg and run.cfg.trainer.lr == 5e-5
    assert len(parses) == 2
