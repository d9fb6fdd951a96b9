"""A base model an admin brings, through the artifact store: published once from wherever it
is (`manage.py publish_policy DIR`), given to a run by reference, fetched and verified by each
host that needs it (the trainer, the env workers reading its image geometry and tokenizer) and synced to
the inference workers by reference. Real moto S3 server."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from datamanager.policies import (
    PolicyNotFound,
    policy_geometry,
    policy_path,
    policy_prompt_counter,
)
from datamanager.selectors.runs import run_current_policy
from tests.datamanager.factories import make_running_run, make_tasks

pytestmark = pytest.mark.django_db


def _publish(directory) -> str:
    out = io.StringIO()
    call_command("publish_policy", str(directory), stdout=out)
    return out.getvalue().strip()


def test_a_published_base_policy_is_fetched_on_each_host_and_synced_by_reference(
    s3_artifacts, tiny_policy_dir, tmp_path, settings
):
    settings.DARTBOARD_ARTIFACTS = s3_artifacts
    settings.DARTBOARD_ARTIFACT_CACHE = tmp_path / "host-b-cache"  # a host that never saw it
    ref = _publish(tiny_policy_dir)
    assert ref.startswith(f"artifact:policies/{tiny_policy_dir.name}-")
    assert _publish(tiny_policy_dir) == ref  # named by content: publishing again changes nothing

    # An env worker reads the policy's image geometry: its processor config, not the weights.
    assert policy_geometry(ref) == policy_geometry(str(tiny_policy_dir))
    fetched = {p.name for p in (tmp_path / "host-b-cache").rglob("*") if p.is_file()}
    assert fetched == {"preprocessor_config.json", "MANIFEST.json"}
    # And its prompt counter: the tokenizer and chat template too, still not the weights.
    counter = policy_prompt_counter(ref)
    local_counter = policy_prompt_counter(str(tiny_policy_dir))
    text = "Thought: click 1234 in 管理\nAction: wait()"
    assert counter.text(role="assistant", text=text) == local_counter.text(
        role="assistant", text=text
    )
    assert counter.tokenizer is not None and counter.framing == local_counter.framing
    fetched = {p.name for p in (tmp_path / "host-b-cache").rglob("*") if p.is_file()}
    assert "model.safetensors" not in fetched and "tokenizer.json" in fetched
    # The trainer loads the whole model.
    local = policy_path(ref)
    assert local.parent == tmp_path / "host-b-cache"
    assert (local / "model.safetensors").read_bytes() == (
        tiny_policy_dir / "model.safetensors"
    ).read_bytes()

    make_tasks(1)
    run = make_running_run({"policy": ref})
    assert run_current_policy(run=run) == (0, ref)  # inference hosts fetch it themselves


def test_an_unknown_reference_or_a_directory_without_a_model_is_refused(
    s3_artifacts, tmp_path, settings
):
    settings.DARTBOARD_ARTIFACTS = s3_artifacts
    settings.DARTBOARD_ARTIFACT_CACHE = tmp_path / "cache"
    missing = "artifact:policies/nowhere@" + "0" * 64
    with pytest.raises(
        PolicyNotFound, match=r"policy 'artifact:policies/nowhere@0+': .*cannot read"
    ):
        policy_path(missing)
    with pytest.raises(CommandError, match="not a Hugging Face checkpoint"):
        _publish(tmp_path)
