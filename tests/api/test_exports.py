"""Dataset exports through the API on a live server: started from the list's filters, written
by the worker's job, downloaded with the same token; bad formats and filters refused."""

from __future__ import annotations

import io
import zipfile

import pytest

from datamanager.models import DatasetExport
from datamanager.services.datasets import dataset_export_run
from tests.api.conftest import problem_of
from tests.dartboard.run_helpers import make_run
from tests.dartboard.test_curation_views import finished


@pytest.fixture
def run_with_episodes(transactional_db):
    run = make_run(policy="oracle")
    won = [finished(run, success=True) for _ in range(2)]
    finished(run, steps=3, success=False)
    return run, won


def test_a_viewer_exports_the_filtered_trajectories_and_downloads_them(api, run_with_episodes):
    run, _won = run_with_episodes
    victor = api("victor", "viewer")
    started = victor.post(
        "exports/", json={"query": f"run={run.pk}&status=succeeded", "formats": ["hf"]}
    )
    assert started.status_code == 202, started.text
    export = started.json()
    assert (export["status"], export["total"], export["download"]) == ("queued", 2, None)
    assert problem_of(victor.get(f"exports/{export['id']}/download/"))[:2] == (409, "conflict")
    dataset_export_run(export_id=export["id"])  # the default queue's worker runs this
    done = victor.get(f"exports/{export['id']}/").json()
    assert (done["status"], done["done"], done["query"]) == (
        "done",
        2,
        f"run={run.pk}&status=succeeded",
    )
    archive = victor.get(done["download"].removeprefix("/api/v1/"))
    assert archive.status_code == 200
    names = zipfile.ZipFile(io.BytesIO(archive.content)).namelist()
    top = f"dartboard-export-{export['id']}/"
    assert top + "README.md" in names and any(n.startswith(top + "successes/") for n in names)
    assert not any(n.startswith(top + "failures/") for n in names)  # the filter held
    assert api(None).get(f"exports/{export['id']}/").status_code == 401


@pytest.mark.parametrize(
    ("body", "field"),
    [({"formats": ["csv"]}, "formats.0"), ({"formats": []}, "formats"),
     ({"query": "reward_min=lots"}, "query"), ({"query": "status=sideways"}, "query")],
)  # fmt: skip
def test_a_bad_export_is_refused_with_its_field_and_records_nothing(
    api, run_with_episodes, body, field
):
    refused = api("victor", "viewer").post("exports/", json=body)
    assert problem_of(refused)[::2] == (400, field)
    assert not DatasetExport.objects.exists()
