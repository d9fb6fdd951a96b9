"""The trainer worker on real data: batches from ready groups, a real tiny-policy update,
published versions, staleness, the trainer's view on each step, and resume after a crash."""

import pytest
import torch
from django.conf import settings
from django.core.files.storage import default_storage

from core.lora import is_adapter_dir
from core.policy import install_weights, load_policy
from datamanager.models import (
    GroupStatus,
    PolicyVersion,
    Run,
    RunStatus,
    Step,
    TaskGroup,
    TrainUpdate,
)
from datamanager.services import batches
from rollout.weight_receive import WeightReceiver
from tests.datamanager.factories import make_running_run, make_tasks, play
from workers import training_loop

pytestmark = [pytest.mark.django_db, pytest.mark.slow]


@pytest.fixture
def run_on_tiny(tiny_policy_dir, tmp_path, settings):
    settings.CHECKPOINT_ROOT = tmp_path / "checkpoints"
    make_tasks(2)
    return make_running_run(
        {
            "policy": str(tiny_policy_dir),
            "curation": {"n_max": 2, "n_min": 2, "entropy_top_q": 0.5},
            "trainer": {"min_groups": 2, "lr": 1e-3, "kl_coef": 0.0, "max_updates": 1},
        }
    )


def _fill(run, version=0):
    # Two tasks, two rollouts each, one success per task: both groups have reward variance.
    # Groups fill one after another: claims go t0, t0, t1, t1.
    for success in (True, False, True, False):
        play(run, success=success, steps=2, version=version)


def test_one_update_trains_marks_steps_and_publishes_a_version(run_on_tiny):
    run = run_on_tiny
    _fill(run)
    assert TaskGroup.objects.filter(run=run, status=GroupStatus.READY).count() == 2
    training_loop.trainers_forget_all()
    before = {
        k: v.clone()
        for k, v in training_loop.get_trainer(run, _cfg(run)).policy.model.state_dict().items()
    }
    reason = training_loop.train_for(run_id=run.pk, max_seconds=120)
    assert reason == "max_updates reached"
    update = TrainUpdate.objects.get(run=run)
    assert update.metrics["n_samples"] == 8 and update.metrics["optimizer_steps"] == 1
    assert update.metrics["kept_step_fraction"] == pytest.approx(0.5)
    steps = Step.objects.filter(trajectory__run=run)
    assert steps.filter(trained_in_update=update).count() == 8
    assert (
        steps.filter(entropy_kept=True).count() == 4
        and steps.filter(entropy_kept=False).count() == 4
    )
    assert all(s.advantage is not None for s in steps)
    assert TaskGroup.objects.filter(run=run, status=GroupStatus.TRAINED).count() == 2
    pv = PolicyVersion.objects.get(run=run)
    assert (
        pv.version == 1
        and (settings.CHECKPOINT_ROOT / f"run-{run.pk}" / "v00001" / "config.json").exists()
    )
    after = training_loop.trainer_held(run_id=run.pk).policy.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "no parameter changed"


def test_a_published_version_is_pulled_from_the_trainers_memory_equal_to_its_checkpoint(
    run_on_tiny, tiny_policy_dir, monkeypatch, django_capture_on_commit_callbacks
):
    run = run_on_tiny
    _fill(run)
    syncs: list[dict] = []  # what the router is told (no router runs here)
    monkeypatch.setattr(training_loop, "router_sync", lambda **sync: syncs.append(sync))
    training_loop.trainers_forget_all()
    try:
        with django_capture_on_commit_callbacks(execute=True):
            assert training_loop.train_for(run_id=run.pk, max_seconds=120) == "max_updates reached"
        (sync,) = syncs
        assert sync["version"] == 1 and sync["weights"].version == 1
        assert sync["weights"].host == settings.DARTBOARD_WEIGHT_SERVER
        worker = load_policy(tiny_policy_dir)
        WeightReceiver(timeout_s=30).load(
            policy=worker, weights=sync["weights"], swap=lambda s: install_weights(worker, s)
        )
    finally:
        training_loop.trainers_forget_all()  # stops the run's weight server too
    published = load_policy(settings.CHECKPOINT_ROOT / f"run-{run.pk}" / "v00001")
    mine, theirs = worker.model.state_dict(), published.model.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_a_trajectory_whose_screenshot_is_lost_is_left_out_and_training_goes_on(run_on_tiny):
    # The object storage lost a screenshot (a bucket restored from an older backup, an
    # S3-compatible server that keeps nothing): that trajectory cannot be rebuilt, the rest can.
    run = run_on_tiny
    _fill(run)
    lost = Step.objects.filter(trajectory__run=run).order_by("pk").first()
    default_storage.delete(lost.screenshot.name)
    training_loop.trainers_forget_all()
    assert training_loop.train_for(run_id=run.pk, max_seconds=120) == "max_updates reached"
    update = TrainUpdate.objects.get(run=run)
    assert update.metrics["n_samples"] == 6  # 8 steps, less the 2 of the unreadable one
    traj = lost.trajectory
    traj.refresh_from_db()
    assert traj.rejected and traj.status in ("succeeded", "failed")  # its outcome stands
    assert "screenshot is missing from storage" in traj.error and lost.screenshot.name in traj.error
    assert not Step.objects.filter(trajectory=traj, trained_in_update__isnull=False).exists()


def test_trainer_waits_and_says_so(run_on_tiny):
    run = run_on_tiny
    play(run, success=True)
    training_loop.trainers_forget_all()
    assert training_loop.train_for(run_id=run.pk, max_seconds=1.5) == "time slice over"
    run.refresh_from_db()
    assert "waiting for 2 ready groups: 0 ready" in run.status_message


def test_stale_steps_are_flagged_and_left_out(run_on_tiny):
    run = run_on_tiny
    _fill(run, version=0)
    batch = batches.batch_collect(run=run, current_version=5)  # k = 2: version 0 is stale
    assert batch is not None and batch.samples == [] and len(batch.stale_step_ids) == 8


def test_groups_with_only_stale_steps_leave_the_queue_as_skipped(run_on_tiny, caplog):
    # A run whose trainer moved on (here: to version 5) while version-0 groups piled up: they
    # must not sit at the head of the ready queue forever, collected and dropped on every try.
    run = run_on_tiny
    _fill(run, version=0)
    training_loop.trainers_forget_all()
    training_loop.get_trainer(run, _cfg(run)).state.version = 5
    with caplog.at_level("INFO", logger="dartboard.trainer"):
        assert training_loop.train_for(run_id=run.pk, max_seconds=1.5) == "time slice over"
    assert "skipped 2 ready groups with nothing left to train (8 stale steps" in caplog.text
    assert TaskGroup.objects.filter(run=run, status=GroupStatus.SKIPPED).count() == 2
    assert Step.objects.filter(trajectory__run=run, stale=True).count() == 8
    assert not TrainUpdate.objects.filter(run=run).exists()
    run.refresh_from_db()
    assert "waiting for 2 ready groups: 0 ready" in run.status_message
    _fill(run, version=5)  # fresh groups train at once, without the stale ones
    assert training_loop.train_for(run_id=run.pk, max_seconds=120) == "max_updates reached"
    update = TrainUpdate.objects.get(run=run)
    assert update.metrics["n_samples"] == 8
    assert set(
        Step.objects.filter(trained_in_update=update).values_list("policy_version", flat=True)
    ) == {5}


def test_resume_after_crash_continues_from_the_published_version(run_on_tiny):
    run = run_on_tiny
    _fill(run)
    training_loop.trainers_forget_all()
    training_loop.train_for(run_id=run.pk, max_seconds=120)
    weights = {
        k: v.clone()
        for k, v in training_loop.trainer_held(run_id=run.pk).policy.model.state_dict().items()
    }
    training_loop.trainers_forget_all()  # the worker process died
    # Reaching max_updates finished the run: it runs on with a higher one.
    Run.objects.filter(pk=run.pk).update(
        config={**run.config, "trainer": {**run.config["trainer"], "max_updates": 2}},
        status=RunStatus.RUNNING,
    )
    run.refresh_from_db()
    resumed = training_loop.get_trainer(run, run.cfg)
    assert (resumed.state.updates, resumed.state.version) == (1, 1)
    for name, value in resumed.policy.model.state_dict().items():
        assert torch.equal(value, weights[name]), f"{name} differs from the published version"
    _fill(run, version=1)
    training_loop.train_for(run_id=run.pk, max_seconds=120)
    trainer = training_loop.trainer_held(run_id=run.pk)
    assert trainer.state.updates == 2 and trainer.state.version == 2
    assert TrainUpdate.objects.filter(run=run).count() == 2
    # No step was trained twice: each update used only the new groups' steps.
    assert Step.objects.filter(trajectory__run=run, train_uses__gt=1).count() == 0
    assert Step.objects.filter(trajectory__run=run, train_uses=1).count() == 16
    del weights


def test_versions_go_to_the_store_and_a_trainer_on_another_host_resumes_from_it(
    run_on_tiny, s3_artifacts, settings, tmp_path
):
    """Nothing shared but the services: the published version is in S3 (moto's server), the
    router is told its reference, and a trainer on a host with an empty disk fetches it."""
    from core.artifacts import ArtifactRef

    settings.DARTBOARD_ARTIFACTS = s3_artifacts
    run = run_on_tiny
    _fill(run)
    training_loop.trainers_forget_all()
    training_loop.train_for(run_id=run.pk, max_seconds=120)
    published = PolicyVersion.objects.get(run=run, version=1)
    ref = ArtifactRef.parse(published.artifact)
    assert ref.key == f"runs/{run.pk}/v00001"
    weights = {
        k: v.clone()
        for k, v in training_loop.trainer_held(run_id=run.pk).policy.model.state_dict().items()
    }

    training_loop.trainers_forget_all()  # the trainer moves to another host: nothing on its disk
    settings.CHECKPOINT_ROOT = tmp_path / "host-b" / "checkpoints"
    settings.DARTBOARD_ARTIFACT_CACHE = tmp_path / "host-b" / "cache"
    run.refresh_from_db()
    resumed = training_loop.get_trainer(run, run.cfg)
    assert (resumed.state.updates, resumed.state.version) == (1, 1)
    assert (settings.DARTBOARD_ARTIFACT_CACHE / ref.digest).is_dir()
    for name, value in resumed.policy.model.state_dict().items():
        assert torch.equal(value, weights[name]), f"{name} differs from the stored version"
    del weights


def test_a_lora_run_publishes_adapter_versions_and_resumes_from_them(run_on_tiny):
    run = run_on_tiny
    trainer_cfg = {**run.config["trainer"], "lora_rank": 4, "lora_alpha": 8, "kl_coef": 0.1}
    Run.objects.filter(pk=run.pk).update(config={**run.config, "trainer": trainer_cfg})
    run.refresh_from_db()
    _fill(run)
    training_loop.trainers_forget_all()
    base = {k: v.clone() for k, v in load_policy(run.config["policy"]).model.state_dict().items()}
    assert training_loop.train_for(run_id=run.pk, max_seconds=120) == "max_updates reached"
    published = settings.CHECKPOINT_ROOT / f"run-{run.pk}" / "v00001"
    assert PolicyVersion.objects.get(run=run).checkpoint == str(published)
    assert is_adapter_dir(published) and not (published / "model.safetensors").exists()
    trained = training_loop.trainer_held(run_id=run.pk).policy.model
    assert any("lora_B" in n and v.abs().sum() > 0 for n, v in trained.named_parameters())
    frozen = trained.get_base_model().state_dict()  # LoRA-wrapped layers keep theirs in base_layer
    for key, value in base.items():
        wrapped = key.rsplit(".", 1)[0] + ".base_layer." + key.rsplit(".", 1)[1]
        assert torch.equal(frozen.get(key, frozen.get(wrapped)), value), key
    training_loop.trainers_forget_all()  # the worker died: resume from the adapter version
    resumed = training_loop.get_trainer(run, _cfg(run))
    assert (resumed.state.updates, resumed.state.version) == (1, 1)
    for name, value in resumed.policy.model.named_parameters():
        if "lora_" in name:
            assert torch.equal(value, dict(trained.named_parameters())[name]), name


@pytest.mark.parametrize("mode", ["full", "lora", "sharded"])
def test_two_trainer_replicas_take_the_one_process_update(run_on_tiny, mode):
    """trainer.replicas = 2: the trainer worker starts a follower process and both take each
    update; the loss is the one-process loss, and the follower is gone when the trainer is."""
    runs = [run_on_tiny, make_running_run(run_on_tiny.config)]
    losses = []
    for run, replicas in zip(runs, (1, 2), strict=True):
        extra = {"lora_rank": 4, "lora_alpha": 8} if mode == "lora" else {}
        if mode == "sharded" and replicas > 1:
            extra["shard"] = True
        trainer_cfg = {**run.config["trainer"], "replicas": replicas, **extra}
        Run.objects.filter(pk=run.pk).update(config={**run.config, "trainer": trainer_cfg})
        run.refresh_from_db()
        _fill(run)
        training_loop.trainers_forget_all()
        torch.manual_seed(0)
        assert training_loop.train_for(run_id=run.pk, max_seconds=300) == "max_updates reached"
        losses.append(TrainUpdate.objects.get(run=run).metrics["loss"])
        assert PolicyVersion.objects.filter(run=run, version=1).exists()
    followers = training_loop.replica_group_held(run_id=runs[1].pk).followers
    assert len(followers) == 1 and followers[0].poll() is None
    training_loop.trainer_forget(run_id=runs[1].pk)
    assert followers[0].poll() == 0  # told to stop, and it did
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    if mode == "sharded":  # the published version holds the whole, gathered model
        published = settings.CHECKPOINT_ROOT / f"run-{runs[1].pk}" / "v00001"
        assert (published / "model.safetensors").stat().st_size > 1_000_000


def _cfg(run):

    return run.cfg


def _store_demos(tasks) -> None:
    """One one-step oracle-style demo per task in the experience pool."""
    from core.steps import StepRecord
    from datamanager.services.pool import demo_store
    from tests.conftest import png_bytes

    for i, task in enumerate(tasks):
        demo_store(
            task=task,
            instruction=f"Click button {i}",
            reward=1.0,
            steps=[
                StepRecord.demonstration(
                    index=0,
                    screenshot_png=png_bytes(color=(200, 40 * i, 40)),
                    width=160,
                    height=210,
                    raw_output=f"Thought: press it\nAction: click(start_box='({30 + 50 * i},100)')",
                    thought="press it",
                    action={"type": "click", "x": 30 + 50 * i, "y": 100},
                )
            ],
        )


def test_warm_start_behaviour_clones_the_pool_and_lowers_its_loss(
    tiny_policy_dir, tmp_path, settings
):
    settings.CHECKPOINT_ROOT = tmp_path / "checkpoints"
    _store_demos(make_tasks(2))
    run = make_running_run(
        {
            "policy": str(tiny_policy_dir),
            "trainer": {"warm_start_bc_updates": 6, "lr": 3e-3, "kl_coef": 0.0, "max_updates": 6},
        }
    )
    training_loop.trainers_forget_all()
    assert training_loop.train_for(run_id=run.pk, max_seconds=300) == "max_updates reached"
    updates = list(TrainUpdate.objects.filter(run=run).order_by("number"))
    assert [u.metrics["kind"] for u in updates] == ["warm_start"] * 6
    assert updates[-1].metrics["bc_loss"] < updates[0].metrics["bc_loss"] * 0.8
    assert PolicyVersion.objects.get(run=run).version == 1  # published once, at the end


def test_pool_demos_are_mixed_into_an_rl_update_and_behaviour_cloned(
    tiny_policy_dir, tmp_path, settings
):
    """trainer.pool_mix_steps: the RL update also trains that many pool demo steps by
    behaviour cloning (the groups still give the policy-gradient signal)."""
    settings.CHECKPOINT_ROOT = tmp_path / "checkpoints"
    tasks = make_tasks(2)
    _store_demos(tasks)
    run = make_running_run(
        {
            "policy": str(tiny_policy_dir),
            "curation": {"n_max": 2, "n_min": 2, "experience_pool": False},
            "trainer": {"min_groups": 2, "kl_coef": 0.0, "max_updates": 1,
                        "bc_weight": 0.5, "pool_mix_steps": 1},
        }
    )  # fmt: skip
    _fill(run)
    training_loop.trainers_forget_all()
    assert training_loop.train_for(run_id=run.pk, max_seconds=120) == "max_updates reached"
    update = TrainUpdate.objects.get(run=run)
    assert update.metrics["kind"] == "rl"
    assert update.metrics["n_samples"] == 9 and update.metrics["n_demo_steps"] == 1
    assert update.metrics["bc_loss"] > 0 and update.metrics["n_trained_steps"] > 0
    trained = Step.objects.filter(trained_in_update=update)
    assert trained.filter(trajectory__source="online").count() == 8


def test_scheduled_evaluation_of_the_start_then_of_the_newest_version(
    tiny_policy_dir, tmp_path, settings
):
    from datamanager.models import EvalJob, Task
    from datamanager.services.evaluations import eval_schedule_next

    settings.CHECKPOINT_ROOT = tmp_path / "checkpoints"
    make_tasks(2)
    Task.objects.create(name="miniwob/held-out", env_kind="miniwob", split="eval")
    run = make_running_run(
        {
            "policy": str(tiny_policy_dir),
            "curation": {"n_max": 2, "n_min": 2},
            "trainer": {"min_groups": 2, "kl_coef": 0.0, "max_updates": 1},
            "evaluation": {"every_n_versions": 1, "k": 3},
        }
    )
    _fill(run)
    training_loop.trainers_forget_all()
    training_loop.train_for(run_id=run.pk, max_seconds=120)
    # The starting policy first (the baseline the versions are compared against); v1, which
    # the update published meanwhile, once that job has ended.
    (baseline,) = EvalJob.objects.filter(run=run)
    assert baseline.policy == str(tiny_policy_dir) and baseline.policy_version == 0
    EvalJob.objects.filter(pk=baseline.pk).update(status="finished")
    (job,) = eval_schedule_next(run_id=run.pk)
    assert job.policy == f"run:{run.pk}:v1" and job.policy_version == 1
    assert job.task_names == ["miniwob/held-out"] and job.k == 3 and job.total == 3


@pytest.mark.parametrize("mode", ["decoupled", "synchronous"])
def test_a_failing_trainer_says_why_on_the_run_and_retries(
    mode, tiny_policy_dir, tmp_path, settings
):
    """A trainer that cannot go on (here its start checkpoint lost its weights) must not stop
    silently while the run keeps rolling out: the run says what failed, and a retry from the
    last published checkpoint is queued. The same for the synchronous baseline's driver."""
    import shutil

    from dartboard.celery import app
    from workers import tasks

    train_run = tasks.train_run if mode == "decoupled" else tasks.sync_run

    settings.CHECKPOINT_ROOT = tmp_path / "checkpoints"
    policy = tmp_path / "policy"
    shutil.copytree(tiny_policy_dir, policy)
    make_tasks(2)
    run = make_running_run({"policy": str(policy), "mode": mode, "trainer": {"kl_coef": 0.0}})
    for weights in policy.glob("*.safetensors"):
        weights.unlink()
    training_loop.trainers_forget_all()
    with app.connection_for_write() as conn:
        redis = conn.default_channel.client
        queued = redis.llen("train")
        result = train_run(run.pk)
        assert redis.llen("train") == queued + 1
        redis.lpop("train")  # the retry; no worker runs in this test
    assert result.startswith("failed: ")
    run.refresh_from_db()
    assert run.status_message.startswith("trainer failed: ")
    assert "Retrying in 30 s" in run.status_message
    assert training_loop.trainer_held(run_id=run.pk) is None


def _publish_next(run: Run, trainer_cfg: dict, version: int) -> None:
    """Episodes of `version`, then one update that publishes the next version."""
    _fill(run, version=version)
    # One update per slice: the slice ends as it lands, not 120 s later.
    limited = {**trainer_cfg, "max_updates": version + 1}
    Run.objects.filter(pk=run.pk).update(config={**run.config, "trainer": limited})
    training_loop.train_for(run_id=run.pk, max_seconds=120)
    # Reaching max_updates finishes the run: the next round raises it and runs on.
    Run.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING)


def test_only_the_newest_versions_keep_their_optimizer_state_here_and_in_the_store(
    run_on_tiny, s3_artifacts, settings
):
    """Three versions published with optimizer_states_kept = 2: version 1's state is gone from
    the trainer's disk and from the store, its weights stay (and still serve); a restarted
    trainer resumes from the newest."""
    from core.artifacts import STATE_FILE, ArtifactRef, fetch, open_store
    from rollout.checkpoints import SERVING_SKIPS

    settings.DARTBOARD_ARTIFACTS = s3_artifacts
    run = run_on_tiny
    trainer_cfg = {**run.config["trainer"], "max_updates": 3, "optimizer_states_kept": 2}
    Run.objects.filter(pk=run.pk).update(config={**run.config, "trainer": trainer_cfg})
    run.refresh_from_db()
    training_loop.trainers_forget_all()
    for version in range(3):
        _publish_next(run, trainer_cfg, version)
    run_dir = settings.CHECKPOINT_ROOT / f"run-{run.pk}"
    store = open_store(s3_artifacts)
    kept = {}
    for pv in PolicyVersion.objects.filter(run=run).order_by("version"):
        key = ArtifactRef.parse(pv.artifact).key
        local = (run_dir / f"v{pv.version:05d}" / STATE_FILE).exists()
        try:
            store.get_bytes(f"{key}/{STATE_FILE}")
            stored = True
        except Exception:
            stored = False
        kept[pv.version] = (local, stored)
        # Every version's weights still serve (inference fetches them without the state).
        fetch(store, ArtifactRef.parse(pv.artifact), settings.DARTBOARD_ARTIFACT_CACHE,
              skip=SERVING_SKIPS)  # fmt: skip
    assert kept == {1: (False, False), 2: (True, True), 3: (True, True)}
    training_loop.trainers_forget_all()
    resumed = training_loop.get_trainer(run, run.cfg)
    assert (resumed.state.updates, resumed.state.version) == (3, 3)


def test_old_versions_weights_are_pruned_but_every_nth_the_best_and_the_evaluated_stay(
    run_on_tiny, s3_artifacts, settings
):
    """Six versions with versions_kept = 2 and versions_keep_every = 4: the newest two (5, 6),
    every 4th (4), the best by greedy success (1) and the one an evaluation is queued for (2)
    keep their weights; version 3's are gone from the trainer's disk, this host's cache and
    the store, its row and metrics stay; every version recorded what it costs on disk."""
    from core.artifacts import MANIFEST, ArtifactRef, fetch, open_store
    from datamanager.models import EvalJob, EvalScope, EvalStatus, Purpose, Task, Trajectory
    from rollout.checkpoints import SERVING_SKIPS

    settings.DARTBOARD_ARTIFACTS = s3_artifacts
    run = run_on_tiny
    trainer_cfg = {**run.config["trainer"], "optimizer_states_kept": 1, "versions_kept": 2,
                   "versions_keep_every": 4}  # fmt: skip
    training_loop.trainers_forget_all()
    task = Task.objects.first()
    for version in range(6):
        _publish_next(run, trainer_cfg, version)
        if version == 1:  # version 1 was evaluated greedily: 2 of 2 on held-out seeds
            job = EvalJob.objects.create(name="v1", policy="x", run=run, policy_version=1,
                                         scope=EvalScope.HELDOUT, status=EvalStatus.FINISHED)  # fmt: skip
            for seed in range(2):
                Trajectory.objects.create(run=run, task=task, eval_job=job, purpose=Purpose.EVAL,
                                          seed=seed, status="succeeded", reward=1.0)  # fmt: skip
            EvalJob.objects.filter(run=run).exclude(pk=job.pk).delete()  # the loop's own
        if version == 2:  # version 2's evaluation is still to run
            EvalJob.objects.filter(run=run).exclude(policy_version=1).delete()
            EvalJob.objects.create(name="v2", policy="x", run=run, policy_version=2,
                                   status=EvalStatus.QUEUED)  # fmt: skip
    run_dir = settings.CHECKPOINT_ROOT / f"run-{run.pk}"
    store = open_store(s3_artifacts)
    versions = list(PolicyVersion.objects.filter(run=run).order_by("version"))
    assert [pv.version for pv in versions if pv.pruned_at is not None] == [3]
    for pv in versions:
        ref = ArtifactRef.parse(pv.artifact)
        try:
            store.get_bytes(f"{ref.key}/{MANIFEST}")
            stored = True
        except Exception:
            stored = False
        on_disk = (run_dir / f"v{pv.version:05d}").exists()
        assert (on_disk, stored) == ((pv.version != 3,) * 2), pv.version
        assert pv.weights_bytes > 1_000_000  # the tiny policy's weights: about 23 MB
        if pv.version != 3:
            fetch(store, ref, settings.DARTBOARD_ARTIFACT_CACHE, skip=SERVING_SKIPS)
    assert not list(
        settings.DARTBOARD_ARTIFACT_CACHE.glob(f"{ArtifactRef.parse(versions[2].artifact).digest}*")
    )
    assert versions[-1].state_bytes > versions[-1].weights_bytes  # AdamW: two moments a weight


def test_a_worker_shutting_down_mid_update_records_nothing_and_the_groups_train_after(
    run_on_tiny, monkeypatch
):
    """Ctrl-C while an update runs: the trainer leaves between micro-batches instead of
    finishing a long update; no version, no update, the groups still ready; the restarted
    trainer trains them."""
    from training.trainer import PolicyTrainer
    from workers.lifecycle import shutdown_requested

    run = run_on_tiny
    _fill(run)
    training_loop.trainers_forget_all()
    logprob_fn = PolicyTrainer.logprob_fn

    def stopping(self, model, samples):
        shutdown_requested.set()  # Ctrl-C arrives during the update's first pass
        return logprob_fn(self, model, samples)

    monkeypatch.setattr(PolicyTrainer, "logprob_fn", stopping)
    try:
        assert training_loop.train_for(run_id=run.pk, max_seconds=120) == "time slice over"
    finally:
        shutdown_requested.clear()
    assert not TrainUpdate.objects.filter(run=run).exists()
    assert not PolicyVersion.objects.filter(run=run).exists()
    assert TaskGroup.objects.filter(run=run, status=GroupStatus.READY).count() == 2
    monkeypatch.setattr(PolicyTrainer, "logprob_fn", logprob_fn)
    assert training_loop.train_for(run_id=run.pk, max_seconds=120) == "max_updates reached"
    assert TaskGroup.objects.filter(run=run, status=GroupStatus.TRAINED).count() == 2


def test_a_full_disk_pauses_the_run_leaves_no_half_version_and_it_resumes_with_room(
    run_on_tiny, small_disk, settings
):
    """The version's checkpoint cannot be written: the run pauses saying what and where, no
    version and no update are recorded, nothing half-written stays, the groups stay ready;
    with the disk still full the watchdog leaves it paused; once there is room it resumes
    it and the next update publishes."""
    import subprocess

    from datamanager.models import RunStatus
    from workers.disk import runs_resume_after_disk

    settings.CHECKPOINT_ROOT = small_disk
    run = run_on_tiny
    _fill(run)
    training_loop.trainers_forget_all()
    training_loop.train_for(run_id=run.pk, max_seconds=120)
    run.refresh_from_db()
    assert (run.status, run.paused_for_disk) == (RunStatus.PAUSED, True)
    assert run.status_message.startswith(
        f"paused: no space left on device writing version 1's checkpoint under {small_disk}"
    )
    assert not PolicyVersion.objects.filter(run=run).exists()
    assert not TrainUpdate.objects.filter(run=run).exists()
    assert TaskGroup.objects.filter(run=run, status=GroupStatus.READY).count() == 2
    assert not list(small_disk.rglob("*.tmp"))  # the half-written version is gone
    assert run.actions.filter(action="pause", user=None).exists()
    assert runs_resume_after_disk() == []  # still full: it stays paused
    subprocess.run(["mount", "-o", "remount,size=600m", str(small_disk)], check=True)
    assert runs_resume_after_disk() == [run.pk]
    run.refresh_from_db()
    assert (run.status, run.paused_for_disk) == (RunStatus.RUNNING, False)
    assert run.status_message.startswith("resumed:")
    training_loop.train_for(run_id=run.pk, max_seconds=120)
    assert PolicyVersion.objects.filter(run=run, version=1).exists()
