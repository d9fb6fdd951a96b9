"""Every trainer update's scalars reach TensorBoard, and W&B and MLflow when configured: a real
update of the tiny policy, then what each tool stored read back with its own reader (W&B's
offline run file, MLflow's client) and checked against the database. No network: W&B runs
offline, MLflow on a local file store."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from datamanager.models import TaskStat, TrainUpdate, Trajectory
from datamanager.selectors.scalars import run_scalars
from tests.helpers import wait_until
from tests.workers.test_training_loop import _fill, run_on_tiny  # noqa: F401  (fixture)
from workers import exports, training_loop

if TYPE_CHECKING:
    from wandb.proto import wandb_internal_pb2

pytestmark = [pytest.mark.django_db, pytest.mark.slow]
# The trackers' readers (tensorboard, wandb, mlflow: slow to import) are imported where they
# are used, so only the xdist worker that runs this module loads them.


def _read(run_id: int) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(exports.tensorboard_dir(run_id)), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_each_update_is_written_to_tensorboard_as_the_database_has_it(run_on_tiny):  # noqa: F811
    run = run_on_tiny
    _fill(run)
    training_loop.trainers_forget_all()
    # Writers are cached per run id in this process: an earlier test's run 1 (its directory
    # gone) must not take this one's scalars.
    exports.exports_close_all()
    assert training_loop.train_for(run_id=run.pk, max_seconds=120) == "max_updates reached"
    exports.exports_close(run.pk)
    update = TrainUpdate.objects.get(run=run)

    scalars = _read(run.pk)
    for key in ("loss", "kl", "mean_entropy", "is_weight_mean", "clip_fraction", "n_samples"):
        assert scalars[f"train/{key}"] == [(1, pytest.approx(update.metrics[key], rel=1e-6))]
    for stat in TaskStat.objects.filter(run=run).select_related("task"):
        assert scalars[f"success/{stat.task.name}"] == [(1, pytest.approx(stat.success_rate))]
        assert scalars[f"budget/{stat.task.name}"] == [(1, stat.rollout_budget)]
    succeeded = Trajectory.objects.filter(run=run, status="succeeded").count()
    assert scalars["env/trajectories_succeeded"] == [(1, succeeded)] and succeeded == 2


def test_an_export_that_fails_leaves_the_update_standing(run_on_tiny, settings, tmp_path):  # noqa: F811
    run = run_on_tiny
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the event files should go")
    settings.CHECKPOINT_ROOT = blocker  # the writer cannot make its directory
    _fill(run)
    training_loop.trainers_forget_all()
    exports.exports_close_all()
    update = TrainUpdate.objects.create(run=run, number=1, policy_version=0, metrics={"loss": 1.0})
    assert exports.export_update(update_id=update.pk).tensorboard == 0
    assert TrainUpdate.objects.filter(pk=update.pk).exists()


def _wandb_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """The records of a `.wandb` run file. wandb 0.31 ships no Python reader for it (its
    `sdk.internal.datastore` is gone; wandb-core in Go writes it), so this reads the format:
    a 7-byte header `:W&B` + magic + version, then LevelDB-log chunks in 32 KiB blocks,
    each `crc32 (4) | length (2, little-endian) | type (1: full, 2: first, 3: middle,
    4: last)`, a record being one serialized `wandb_internal.Record`."""
    from wandb.proto import wandb_internal_pb2

    block = 32 * 1024
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left in the block for a header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _wandb_offline(wandb_dir: Path) -> tuple[set[str], dict[str, str], dict[int, dict]]:
    """(W&B run ids, config, step -> {tag: value}) over every offline run file under WANDB_DIR
    (each trainer process that resumes the run writes its own file, all for the one run id)."""
    run_ids, config, history = set(), {}, {}
    for path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_ids.add(record.run.run_id)
                config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "history":
                # A tag with a slash is stored as its parts (`nested_key`), others as `key`.
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                history[record.history.step.num] = {
                    k: v for k, v in items.items() if not k.startswith("_")
                }
    return run_ids, config, history


def _wandb_offline_whole(wandb_dir: Path, steps: list[int]):
    """`_wandb_offline` once its history holds `steps`, else None (a file still written)."""
    from google.protobuf.message import DecodeError

    try:
        found = _wandb_offline(wandb_dir)
    except DecodeError:  # a record cut by the writer
        return None
    return found if sorted(found[2]) == steps else None


@pytest.fixture
def trackers_on(settings, tmp_path, monkeypatch):
    """W&B offline under tmp_path (never a login or the network) and an MLflow file store."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    (tmp_path / "wandb").mkdir()
    settings.DARTBOARD_WANDB_PROJECT = "dartboard-test"
    settings.DARTBOARD_MLFLOW_TRACKING_URI = f"file://{tmp_path / 'mlruns'}"
    settings.DARTBOARD_MLFLOW_EXPERIMENT = "dartboard-test"
    return tmp_path


def test_updates_reach_wandb_and_mlflow_as_the_database_has_them_across_a_restart(
    run_on_tiny,  # noqa: F811
    trackers_on,
):
    run = run_on_tiny
    _fill(run)
    training_loop.trainers_forget_all()
    assert training_loop.train_for(run_id=run.pk, max_seconds=120) == "max_updates reached"
    first = TrainUpdate.objects.get(run=run)
    at_first = run_scalars(update=first)
    exports.exports_close(run.pk)  # the trainer process stops (W&B flushes its run file)
    # A restarted trainer exports the next update: the same W&B and MLflow runs go on.
    second = TrainUpdate.objects.create(
        run=run, number=2, policy_version=1, metrics={"loss": 0.25, "kl": 0.5}
    )
    result = exports.export_update(update_id=second.pk)
    exports.exports_close(run.pk)
    assert result.wandb == result.mlflow == len(run_scalars(update=second)) > 10

    # W&B's service process writes the run file; on a loaded machine the last update's
    # record lands there a moment after `finish()` returns.
    run_ids, config, history = wait_until(
        lambda: _wandb_offline_whole(trackers_on / "wandb", steps=[1, 2]),
        timeout=30,
        what="both updates in W&B's offline run files",
    )
    assert run_ids == {f"dartboard-run-{run.pk}"}
    assert config["trainer.lr"] == 1e-3 and config["curation.n_max"] == 2
    assert sorted(history) == [1, 2]
    assert history[1] == pytest.approx(at_first, rel=1e-6)
    assert history[1]["train/loss"] == pytest.approx(first.metrics["loss"], rel=1e-6)
    assert history[2]["train/loss"] == 0.25 and history[2]["train/kl"] == 0.5
    for stat in TaskStat.objects.filter(run=run).select_related("task"):
        assert history[2][f"success/{stat.task.name}"] == pytest.approx(stat.success_rate)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file://{trackers_on / 'mlruns'}")
    experiment = client.get_experiment_by_name("dartboard-test")
    [mlflow_run] = client.search_runs([experiment.experiment_id])  # one run, not one a process
    assert mlflow_run.data.tags["dartboard_run_id"] == str(run.pk)
    assert mlflow_run.info.run_name == f"dartboard-run-{run.pk} {run.name}"
    assert mlflow_run.data.params["trainer.lr"] == "0.001"
    for tag, value in at_first.items():
        steps = client.get_metric_history(mlflow_run.info.run_id, tag)
        assert next((m.step, m.value) for m in steps) == (1, pytest.approx(value, rel=1e-6))
    losses = client.get_metric_history(mlflow_run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in losses] == [
        (1, pytest.approx(first.metrics["loss"], rel=1e-6)),
        (2, 0.25),
    ]
    assert losses[1].timestamp == int(second.created_at.timestamp() * 1000)


def test_an_unusable_mlflow_store_is_logged_and_the_update_stands(
    run_on_tiny,  # noqa: F811
    settings,
    tmp_path,
    monkeypatch,
    caplog,
):
    run = run_on_tiny
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the MLflow store should go")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    settings.DARTBOARD_MLFLOW_TRACKING_URI = f"file://{blocker / 'mlruns'}"
    _fill(run)
    exports.exports_close_all()
    update = TrainUpdate.objects.create(run=run, number=1, policy_version=0, metrics={"loss": 1.0})
    with caplog.at_level(logging.ERROR, logger="dartboard.exports"):
        result = exports.export_update(update_id=update.pk)
    exports.exports_close(run.pk)
    assert result.mlflow == 0 and result.tensorboard > 0 and result.wandb is None
    [record] = caplog.records
    assert f"update {update.pk} (run {run.pk}, step 1) to MLflow failed" in record.getMessage()
    assert "not-a-directory" in str(record.exc_info[1])
    assert TrainUpdate.objects.filter(pk=update.pk).exists()
