"""Exporting trajectories as data sets other tools read: a Hugging Face dataset (parquet with
embedded screenshots, `successes` and `failures` configs, a card), an SFT view (each step as
the chat its policy saw and the reply to learn), and OSWorld result folders.

`dataset_write` streams: trajectory ids are read once, then trajectories in chunks with their
steps, each screenshot read from storage as its row is written; the writers hold one row
group. `dataset_export_create` records an export asked for in the browser or the API and
enqueues `dataset_export_run` (the Celery task `workers.tasks.dataset_export`, default queue),
which writes the files, zips them into the media storage (`exports/`) and keeps the export's
progress on its row.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery import current_app as celery_app
from django.conf import settings
from django.contrib.auth.models import User
from django.core.files import File
from django.core.files.storage import default_storage
from django.db import transaction
from django.utils import timezone

from core.prompts import decode_image_parts
from core.protocol import Action
from datamanager.config import RunConfig
from datamanager.demos.osworld import OsworldStep, osworld_write
from datamanager.demos.pyautogui import pyautogui_code
from datamanager.models import DatasetExport, ExportStatus, Step, Trajectory, TrajectoryStatus
from datamanager.selectors.steps import trajectory_turns
from datamanager.selectors.trajectories import TrajectoryFilter, trajectory_queryset

EXPORT_FORMATS = ("hf", "sft", "osworld")
CHUNK = 100  # trajectories fetched with their steps at once


class ExportError(ValueError):
    """An export cannot be made; the message says why."""


@dataclass
class ExportCounts:
    trajectories: int = 0
    rows: dict[str, int] = field(default_factory=dict)


def dataset_write(
    *,
    flt: TrajectoryFilter,
    formats: list[str],
    out: Path,
    query: str = "",
    licence: str = "other",
    progress: Callable[[int, int], None] | None = None,
) -> ExportCounts:
    """Write the trajectories `flt` selects into `out` in `formats`; `query` is the filter as
    the trajectory list's query string (the card quotes it)."""
    unknown = sorted(set(formats) - set(EXPORT_FORMATS))
    if unknown or not formats:
        raise ExportError(f"formats must be some of {', '.join(EXPORT_FORMATS)}, got {formats}")
    # pyarrow is imported here, not with this module: every worker and the web import this
    # module at their start, and few of them ever export.
    from datamanager.demos.hf import SFT_SCHEMA, STEP_SCHEMA, ShardWriter, dataset_card

    ids = list(trajectory_queryset(flt=flt).values_list("pk", flat=True))
    counts = ExportCounts()
    writers: dict[str, ShardWriter] = {}
    if "hf" in formats:
        writers["successes"] = ShardWriter(out, "successes", STEP_SCHEMA)
        writers["failures"] = ShardWriter(out, "failures", STEP_SCHEMA)
    if "sft" in formats:
        writers["sft"] = ShardWriter(out, "sft", SFT_SCHEMA)
    configs = _RunConfigs()
    for traj, steps in _trajectories(ids):
        turns = trajectory_turns(traj, steps, cfg=configs.of(traj))
        if "hf" in formats:
            config = "successes" if traj.status == TrajectoryStatus.SUCCEEDED else "failures"
            for turn in turns:
                writers[config].add(_step_row(traj, turn.step, turn.screenshot_png))
        if "sft" in formats:
            for turn in turns:
                if turn.messages is not None:
                    writers["sft"].add(
                        {
                            "trajectory_id": traj.pk,
                            "step_index": turn.step.index,
                            "task": traj.task.name,
                            **_chat(turn.messages, turn.reply),
                        }
                    )
        if "osworld" in formats and steps:
            osworld_write(
                _osworld_folder(out, traj),
                steps=[
                    OsworldStep(
                        png=t.screenshot_png,
                        code=_code(t.step),
                        response=t.step.thought or t.step.raw_output,
                    )
                    for t in turns
                ],
                score=float(traj.reward or 0.0),
                task=traj.task.name,
                instruction=traj.instruction,
            )
        counts.trajectories += 1
        if progress is not None:
            progress(counts.trajectories, len(ids))
    for name, writer in writers.items():
        writer.close()
        counts.rows[name] = writer.rows
    if "hf" in formats or "sft" in formats:
        dataset_card(
            out,
            title="Dartboard trajectories",
            query=query,
            licence=licence,
            configs={k: v for k, v in counts.rows.items() if v},
            notes=[f"Trajectories: {counts.trajectories}."],
        )
    return counts


def _trajectories(ids: list[int]) -> Iterator[tuple[Trajectory, list[Step]]]:
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        trajs = Trajectory.objects.select_related("task", "run").in_bulk(chunk)
        steps: dict[int, list[Step]] = {pk: [] for pk in chunk}
        for step in Step.objects.filter(trajectory_id__in=chunk).order_by("trajectory_id", "index"):
            steps[step.trajectory_id].append(step)
        for pk in chunk:
            if pk in trajs:  # deleted since the ids were read
                yield trajs[pk], steps[pk]


def _step_row(traj: Trajectory, step: Step, png: bytes) -> dict[str, Any]:
    action = step.action or {}
    return {
        "trajectory_id": traj.pk,
        "step_index": step.index,
        "task": traj.task.name,
        "instruction": traj.instruction,
        "run_id": traj.run_id,
        "source": traj.source,
        "status": traj.status,
        "reward": traj.reward,
        "image": {"bytes": png, "path": f"traj-{traj.pk}-{step.index:03d}.png"},
        "screen_width": step.screen_width,
        "screen_height": step.screen_height,
        "action": json.dumps(action) if action else "",
        "action_type": action.get("type", ""),
        "thought": step.thought,
        "raw_output": step.raw_output,
        "error": step.parse_error or traj.error,
        "policy_version": step.policy_version,
    }


def _code(step: Step) -> str:
    if not step.action:
        return "WAIT"  # a step whose reply did not parse: nothing was done on the screen
    return pyautogui_code(Action.from_json(step.action))


def _osworld_folder(out: Path, traj: Trajectory) -> Path:
    """results/<action space>/<observation>/<model>/<domain>/<task id>/ as OSWorld lays them
    out; model: the trajectory (so repeats of a task stay apart), domain: the task's env
    kind, task id: an OSWorld task's id, else its name with '/' as '_' (`dartboard.json`
    keeps the name)."""
    task_id = traj.task.name.removeprefix("osworld/").replace("/", "_")
    model = f"dartboard-traj-{traj.pk}"
    return out / "osworld" / "pyautogui" / "screenshot" / model / traj.task.env_kind / task_id


class _RunConfigs:
    """Each trajectory's run's settings, parsed once per export; the defaults for
    trajectories without a run (imported demonstrations)."""

    def __init__(self) -> None:
        self._configs: dict[int | None, RunConfig] = {}

    def of(self, traj: Trajectory) -> RunConfig:
        if traj.run_id not in self._configs:
            self._configs[traj.run_id] = traj.run.cfg if traj.run is not None else RunConfig()
        return self._configs[traj.run_id]


def _chat(messages: list[dict], reply: str) -> dict[str, Any]:
    """OpenAI messages -> the chat-template layout SFT trainers load (`{"type": "image"}`
    placeholders, the images in order in `images`), the reply as the last message."""
    images = decode_image_parts(messages)
    out = []
    for message in messages:
        content = message["content"]
        parts = (
            [{"type": "text", "text": content}]
            if isinstance(content, str)
            else [
                {"type": "image", "text": None}
                if p.get("type") == "image_url"
                else {"type": "text", "text": p.get("text")}
                for p in content
            ]
        )
        out.append({"role": message["role"], "content": parts})
    out.append({"role": "assistant", "content": [{"type": "text", "text": reply}]})
    return {"messages": out, "images": [{"bytes": png, "path": None} for png in images]}


# ---------------------------------------------------------------- background exports


def dataset_export_create(
    *, flt: TrajectoryFilter, query: str, formats: list[str], user: User | None
) -> DatasetExport:
    """Record an export and queue its writing (the task `workers.tasks.dataset_export`, sent by
    name) once the caller's transaction commits."""
    unknown = sorted(set(formats) - set(EXPORT_FORMATS))
    if unknown or not formats:
        raise ExportError(f"choose formats among {', '.join(EXPORT_FORMATS)}")
    export = DatasetExport.objects.create(
        created_by=user,
        filter={"query": query, "filter": flt.to_json()},
        formats=formats,
        total=trajectory_queryset(flt=flt).count(),
    )
    transaction.on_commit(
        lambda: celery_app.send_task("workers.tasks.dataset_export", args=(export.pk,))
    )
    return export


def dataset_export_run(*, export_id: int) -> DatasetExport:
    """Write export `export_id` (a queued one) into the media storage as a .zip; its row says
    how far it is, and why it failed if it does."""
    export = DatasetExport.objects.get(pk=export_id)
    if export.status != ExportStatus.QUEUED:
        return export
    DatasetExport.objects.filter(pk=export_id).update(status=ExportStatus.RUNNING)
    work = Path(tempfile.mkdtemp(prefix=f"export-{export_id}-", dir=_scratch()))
    try:

        def progress(done: int, total: int) -> None:
            if done % 20 == 0 or done == total:
                DatasetExport.objects.filter(pk=export_id).update(done=done, total=total)

        dataset_write(
            flt=TrajectoryFilter.from_json(export.filter["filter"]),
            formats=list(export.formats),
            out=work / "data",
            query=export.filter.get("query", ""),
            progress=progress,
        )
        archive = work / "export.zip"
        # Stored, not deflated: parquet and PNG are compressed already.
        with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zf:
            for path in sorted((work / "data").rglob("*")):
                if path.is_file():
                    zf.write(
                        path, f"dartboard-export-{export_id}/{path.relative_to(work / 'data')}"
                    )
        with archive.open("rb") as fh:
            key = default_storage.save(f"exports/export-{export_id}.zip", File(fh))
        DatasetExport.objects.filter(pk=export_id).update(
            status=ExportStatus.DONE, archive=key, finished_at=timezone.now()
        )
    except Exception as exc:
        DatasetExport.objects.filter(pk=export_id).update(
            status=ExportStatus.FAILED,
            error=f"{type(exc).__name__}: {exc}",
            finished_at=timezone.now(),
        )
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    export.refresh_from_db()
    return export


def _scratch() -> Path:
    path = Path(settings.DARTBOARD_HOME) / "scratch"
    path.mkdir(parents=True, exist_ok=True)
    return path
