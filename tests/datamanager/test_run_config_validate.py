"""One check of a run's settings for every way in (the run form, the API, sweeps and
`manage.py start_run`): every problem at once, each at its setting, in the same words."""

from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command

from datamanager.config import ConfigError, ConfigInvalid, RunConfig, config_override
from datamanager.models import Run, Task
from datamanager.services.runs import run_config_validate

BAD = {
    "trainer": {"lr": -1, "micro_batch": "eight", "learning_rate": 1e-4},
    "env": {"miniwob_slots": 100},
    "rollout": "fast",
    "evaluation": {"train_instances": True},
}
PROBLEMS = {
    "trainer.learning_rate": "unknown setting (known: ",
    "trainer.micro_batch": "must be an integer, got 'eight'",
    "trainer.lr": "must be > 0",
    "env.miniwob_slots": "must be between 0 and 64",
    "rollout": "must be an object, got str",
    "evaluation.train_instances": "the run has no fixed training instances",
}


def test_every_problem_comes_back_at_once_with_its_setting():
    with pytest.raises(ConfigInvalid) as caught:
        RunConfig.from_dict(BAD)
    found = {p.path: p.message for p in caught.value.problems}
    assert set(found) == set(PROBLEMS)
    assert all(found[path].startswith(PROBLEMS[path]) for path in PROBLEMS)
    # Callers that show one problem show the first; the message lists them all.
    assert (
        isinstance(caught.value, ConfigError) and caught.value.path == caught.value.problems[0].path
    )
    assert str(caught.value).count(";") == len(PROBLEMS) - 1


def test_a_value_that_is_not_finite_is_refused():
    with pytest.raises(ConfigInvalid, match=r"trainer.lr: must be a finite number, got nan"):
        RunConfig.from_dict({"trainer": {"lr": float("nan")}})


def test_an_override_sets_one_dotted_setting_and_leaves_the_rest():
    base = {"trainer": {"lr": 1e-5, "kl_coef": 0.2}}
    changed = config_override(base, "trainer.lr", 5e-5)
    assert changed == {"trainer": {"lr": 5e-5, "kl_coef": 0.2}} and base["trainer"]["lr"] == 1e-5
    assert config_override({}, "seed", 3) == {"seed": 3}


@pytest.mark.django_db
def test_the_form_shows_each_problem_at_its_field(ada_client):
    from tests.security.test_roles import form

    page = ada_client.post("/runs/new/", form(**{"env.miniwob_slots": "100", "trainer.lr": "-1",
                                                 "tasks.names": "no-such-task"}))  # fmt: skip
    assert page.status_code == 400
    errors = page.context["form"].errors
    assert errors["env.miniwob_slots"] == ["must be between 0 and 64"]
    assert errors["trainer.lr"][0].startswith("must be > 0")
    assert not Run.objects.exists()


@pytest.mark.django_db
def test_rules_beyond_the_config_come_with_its_problems_for_a_user_not_the_shell(researcher):
    Task.objects.create(name="click-button", env_kind="miniwob")
    data = {"policy": "/tmp/weights", "env": {"desktop_slots": 1}, "tasks": {"names": ["nope"]}}
    with pytest.raises(ConfigInvalid) as caught:
        run_config_validate(data=data, user=researcher)
    assert [p.path for p in caught.value.problems] == ["tasks.names", "policy", "env.desktop_slots"]
    with pytest.raises(ConfigInvalid) as shell:
        run_config_validate(data=data, user=None)  # the command line: its user has a shell
    # The command line may name any checkpoint the inference workers can load.
    assert [p.path for p in shell.value.problems] == ["tasks.names", "policy"]
    assert "/tmp/weights is outside the checkpoint roots" in shell.value.problems[1].message


@pytest.mark.django_db
def test_start_run_lists_every_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  lr: -1\nenv:\n  miniwob_slots: 100\n")
    with pytest.raises(CommandError) as caught:
        call_command("start_run", str(bad))
    lines = str(caught.value).splitlines()
    assert lines[0] == f"{bad}: 2 problems:"
    assert lines[1] == "  env.miniwob_slots: must be between 0 and 64"
    assert lines[2].startswith("  trainer.lr: must be > 0")
    assert not Run.objects.exists()


@pytest.mark.django_db
def test_a_checkpoint_outside_the_roots_is_refused_at_create_with_the_roots(tmp_path, settings):
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "my-model"
    outside.mkdir()
    settings.DARTBOARD_CHECKPOINT_ROOTS = [str(root)]
    with pytest.raises(ConfigInvalid) as refused:
        run_config_validate(data={"policy": str(outside)}, user=None)
    problem = refused.value.problems[0]
    assert problem.path == "policy" and "outside the checkpoint roots" in problem.message
    assert f"({root})" in problem.message  # the roots named
    # A link from inside a root that leads out of it is outside too.
    (root / "link").symlink_to(outside)
    with pytest.raises(ConfigInvalid, match="outside the checkpoint roots"):
        run_config_validate(data={"policy": str(root / "link")}, user=None)
    settings.DARTBOARD_CHECKPOINT_ROOTS = [str(root), str(tmp_path)]
    assert run_config_validate(data={"policy": str(outside)}, user=None).policy == str(outside)
