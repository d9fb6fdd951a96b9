"""`Client`: every API endpoint as a method returning the server's JSON (or CSV text), and
`DartboardError` for a refusal, with the server's code, message, field and every problem.

Where the server is and who you are: `Settings.load()` reads DARTBOARD_URL and
DARTBOARD_TOKEN, else the file DARTBOARD_CLIENT_CONFIG names (default
~/.config/dartboard/client.yaml) with `url:` and `token:` lines.
"""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import yaml

DEFAULT_URL = "http://127.0.0.1:8000"
CONFIG_FILE = Path("~/.config/dartboard/client.yaml")
ENDED = ("stopped", "finished", "failed")


class DartboardError(Exception):
    """The server refused a request (or could not be reached: code `unreachable`)."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status = status
        self.code = str(body.get("code") or "error")
        self.message = str(body.get("message") or f"HTTP {status}")
        self.field = body.get("field")
        self.errors: list[dict[str, Any]] = list(body.get("errors") or [body])
        super().__init__(f"{self.code}: {self.message}")


@dataclass(frozen=True)
class Settings:
    url: str
    token: str

    @classmethod
    def load(cls, url: str | None = None, token: str | None = None) -> Settings:
        """Arguments first, then DARTBOARD_URL / DARTBOARD_TOKEN, then the config file."""
        path = Path(os.environ.get("DARTBOARD_CLIENT_CONFIG") or CONFIG_FILE).expanduser()
        saved: dict[str, Any] = {}
        if path.exists():
            loaded = yaml.safe_load(path.read_text()) or {}
            if not isinstance(loaded, dict):
                raise DartboardError(0, {"code": "bad_config", "message": f"{path}: not a mapping"})
            saved = loaded
        return cls(
            url=(url or os.environ.get("DARTBOARD_URL") or saved.get("url") or DEFAULT_URL).rstrip(
                "/"
            ),
            token=token or os.environ.get("DARTBOARD_TOKEN") or str(saved.get("token") or ""),
        )


class Client:
    """The API of one Dartboard server, as one user (their token's roles)."""

    def __init__(
        self, url: str | None = None, token: str | None = None, *, timeout: float = 60.0
    ) -> None:
        self.settings = Settings.load(url, token)
        headers = {"Accept": "application/json"}
        if self.settings.token:
            headers["Authorization"] = f"Bearer {self.settings.token}"
        self._http = httpx.Client(base_url=self.settings.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """A call to /api/v1/`path`; DartboardError unless it succeeded."""
        url = path if path.startswith("/") else f"/api/v1/{path}"
        try:
            response = self._http.request(method, url, **kwargs)
        except httpx.TransportError as exc:
            raise DartboardError(
                0,
                {
                    "code": "unreachable",
                    "message": f"no answer from {self.settings.url} ({exc}); set DARTBOARD_URL",
                },
            ) from None
        if response.is_success:
            return response
        try:
            body = response.json()
        except ValueError:
            body = {"code": "error", "message": response.text[:500] or response.reason_phrase}
        raise DartboardError(response.status_code, body if isinstance(body, dict) else {})

    def get(self, path: str, **params: Any) -> Any:
        query = {k: v for k, v in params.items() if v is not None and v != ""}
        return self.request("GET", path, params=query).json()

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self.request("POST", path, json=body or {}).json()

    # ------------------------------------------------------------------ runs

    def me(self) -> dict[str, Any]:
        return self.get("me/")

    def run_create(
        self,
        *,
        name: str,
        config: dict[str, Any] | None = None,
        overrides: dict[str, Any] | None = None,
        start: bool = False,
    ) -> dict[str, Any]:
        body = {"name": name, "config": config or {}, "overrides": overrides or {}, "start": start}
        return self.post("runs/", body)

    def runs(self, **filters: Any) -> dict[str, Any]:
        """{count, results}: status=, owner=, sweep=, limit=, offset=."""
        return self.get("runs/", **filters)

    def run(self, run_id: int) -> dict[str, Any]:
        return self.get(f"runs/{run_id}/")

    def run_control(self, run_id: int, action: str) -> dict[str, Any]:
        """start, pause, resume or stop, as the run page's buttons."""
        return self.post(f"runs/{run_id}/{action}/")

    def run_copy(
        self,
        run_id: int,
        *,
        name: str | None = None,
        overrides: dict[str, Any] | None = None,
        start: bool = False,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"overrides": overrides or {}, "start": start}
        if name:
            body["name"] = name
        return self.post(f"runs/{run_id}/copy/", body)

    def slots(self, run_id: int) -> list[dict[str, Any]]:
        return self.get(f"runs/{run_id}/slots/")

    def logs(self, run_id: int) -> list[dict[str, Any]]:
        """The run's processes with a log: host, process, size, running, updated_at, url."""
        return self.get(f"runs/{run_id}/logs/")

    def log(self, run_id: int, process: str, *, host: str | None = None) -> str:
        """The end of one process's log, as text; `host` where the run has a process of that
        name on several hosts."""
        params = {"host": host} if host else {}
        return self.request(
            "GET", f"runs/{run_id}/logs/{quote(process, safe='')}/", params=params
        ).text

    # ------------------------------------------------------------------ metrics

    def metrics(self, run_id: int) -> dict[str, Any]:
        return self.get(f"runs/{run_id}/metrics/")

    def metrics_csv(self, run_id: int, kind: str = "greedy") -> str:
        """greedy, success, throughput or updates, as CSV text."""
        return self.request("GET", f"runs/{run_id}/metrics.csv", params={"kind": kind}).text

    def metrics_rows(self, run_id: int, kind: str = "greedy") -> list[dict[str, str]]:
        return list(csv.DictReader(io.StringIO(self.metrics_csv(run_id, kind))))

    def metrics_frame(self, run_id: int, kind: str = "greedy") -> Any:
        """The CSV as a pandas DataFrame (pandas is the notebook's, not a dependency)."""
        import pandas  # optional: only a notebook that asks for a frame needs it

        return pandas.read_csv(io.StringIO(self.metrics_csv(run_id, kind)))

    # ------------------------------------------------------------------ sweeps

    def sweep_create(
        self,
        *,
        name: str,
        config: dict[str, Any] | None = None,
        grid: dict[str, list[Any]] | None = None,
        seeds: int = 1,
        parallel: int = 1,
        overrides: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = {
            "name": name,
            "config": config or {},
            "grid": grid or {},
            "seeds": seeds,
            "parallel": parallel,
            "overrides": overrides or {},
        }
        return self.post("sweeps/", body)

    def sweeps(self, **page: Any) -> dict[str, Any]:
        return self.get("sweeps/", **page)

    def sweep(self, sweep_id: int) -> dict[str, Any]:
        return self.get(f"sweeps/{sweep_id}/")

    def sweep_stop(self, sweep_id: int) -> dict[str, Any]:
        return self.post(f"sweeps/{sweep_id}/stop/")

    def sweep_metrics_csv(self, sweep_id: int) -> str:
        return self.request("GET", f"sweeps/{sweep_id}/metrics.csv").text

    # ------------------------------------------------------------------ trajectories

    def trajectories(self, **filters: Any) -> dict[str, Any]:
        """{count, results}, filtered as the trajectory list page: run=, status=, task=,
        reward=, ..., limit=, offset=."""
        return self.get("trajectories/", **filters)

    def trajectory(self, trajectory_id: int) -> dict[str, Any]:
        return self.get(f"trajectories/{trajectory_id}/")

    def screenshot(self, url: str) -> bytes:
        """A step's screenshot (PNG bytes) by the `screenshot_url` its step gives."""
        return self.request("GET", url).content

    def curate(self, trajectory_id: int, action: str, **body: Any) -> dict[str, Any]:
        """accept, unpool, reject, trim (keep_steps=), label (label=, comment=) or reward
        (reward=, reason=)."""
        return self.post(f"trajectories/{trajectory_id}/{action}/", body)

    # ------------------------------------------------------------------ the rest

    def tasks(self, **filters: Any) -> dict[str, Any]:
        return self.get("tasks/", **filters)

    def evaluations(self, **filters: Any) -> dict[str, Any]:
        return self.get("evaluations/", **filters)

    def evaluation(self, job_id: int) -> dict[str, Any]:
        return self.get(f"evaluations/{job_id}/")

    def evaluate(self, run_id: int, scope: str, version: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"run": run_id, "scope": scope}
        if version is not None:
            body["version"] = version
        return self.post("evaluations/", body)

    def hosts(self) -> list[dict[str, Any]]:
        return self.get("hosts/")
