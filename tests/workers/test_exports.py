"""Every trainer update's scalars reach TensorBoard: a real update of the tiny policy, then
the event files in the run's directory read back with TensorBoard's own reader and checked
against the database."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from datamanager.models import TaskStat, TrainUpdate, Trajectory
from tests.workers.test_training_loop import _fill, run_on_tiny  # noqa: F401  (fixture)
from workers import exports, training_loop

pytestmark = [pytest.mark.django_db, pytest.mark.slow]


def _read(run_id: int) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(exports.tensorboard_dir(run_id)), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_each_update_is_written_to_tensorboard_as_the_database_has_it(run_on_tiny):  # noqa: F811
    run = run_on_tiny
    _fill(run)
    training_loop._TRAINERS.clear()
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
    training_loop._TRAINERS.clear()
    exports._WRITERS.clear()
    update = TrainUpdate.objects.create(run=run, number=1, policy_version=0, metrics={"loss": 1.0})
    assert exports.export_update(update_id=update.pk) == 0
    assert TrainUpdate.objects.filter(pk=update.pk).exists()
