"""A run's scalars in MLflow: one MLflow run per Dartboard run in the experiment
DARTBOARD_MLFLOW_EXPERIMENT (default `dartboard`), named `dartboard-run-<id> <name>`, tagged
`dartboard_run_id`, its resolved config as params; one point per trainer update at the
update's number and time. On when DARTBOARD_MLFLOW_TRACKING_URI is set (an MLflow server over
http(s), or file:///path with MLFLOW_ALLOW_FILE_STORE=true).

    mlflow ui --backend-store-uri file:///path   # or the server's own page

Called by workers/exports.py in the trainer process, after the update is committed.
"""

from __future__ import annotations

import re
from typing import Any

from django.conf import settings

from datamanager.models import Run, TrainUpdate
from datamanager.selectors.scalars import run_params

RUN_TAG = "dartboard_run_id"
_RUNS: dict[int, tuple[Any, str]] = {}  # Dartboard run id -> (MlflowClient, MLflow run id)
# MLflow accepts only these characters in a metric name; a task name may hold others.
_NOT_IN_METRIC_NAME = re.compile(r"[^\w\-. /]")


def _mlflow_run(run: Run) -> tuple[Any, str]:
    if run.pk not in _RUNS:
        # Start-up cost (two seconds) only in a trainer that exports to MLflow.
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=settings.DARTBOARD_MLFLOW_TRACKING_URI)
        name = settings.DARTBOARD_MLFLOW_EXPERIMENT
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        # After a trainer restart the run is found by its tag and continued, not duplicated.
        found = client.search_runs(
            [experiment_id], filter_string=f"tags.{RUN_TAG} = '{run.pk}'", max_results=1
        )
        if found:
            mlflow_run_id = found[0].info.run_id
        else:
            created = client.create_run(
                experiment_id,
                run_name=f"dartboard-run-{run.pk} {run.name}",
                tags={RUN_TAG: str(run.pk)},
            )
            mlflow_run_id = created.info.run_id
            params = [Param(key, str(value)) for key, value in run_params(run=run).items()]
            # Params are written once: MLflow refuses to change a logged one.
            for start in range(0, len(params), 100):  # MLflow takes 100 params a batch
                client.log_batch(mlflow_run_id, params=params[start : start + 100])
        _RUNS[run.pk] = (client, mlflow_run_id)
    return _RUNS[run.pk]


def mlflow_log(update: TrainUpdate, scalars: dict[str, float]) -> None:
    from mlflow.entities import Metric  # start-up cost only where MLflow is on

    client, mlflow_run_id = _mlflow_run(update.run)
    timestamp_ms = int(update.created_at.timestamp() * 1000)
    metrics = [
        Metric(_NOT_IN_METRIC_NAME.sub("_", tag), value, timestamp_ms, update.number)
        for tag, value in scalars.items()
    ]
    for start in range(0, len(metrics), 1000):  # MLflow takes 1000 metrics a batch
        client.log_batch(mlflow_run_id, metrics=metrics[start : start + 1000])


def mlflow_close(run_id: int) -> None:
    # The MLflow run stays open (RUNNING): the Dartboard run goes on after this trainer.
    _RUNS.pop(run_id, None)
