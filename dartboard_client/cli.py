"""The `dartboard` command: a thin client of the REST API (`dartboard --help`).

    dartboard run create cfg.yaml --set trainer.lr=1e-5 --start
    dartboard run watch 12
    dartboard run logs 12 inference-0
    dartboard sweep cfg.yaml --grid trainer.lr=1e-5,5e-5 --seeds 2
    dartboard metrics 12 --csv
    dartboard trajectories --run 12 --status failed --limit 50

The server and token come from --url/--token, DARTBOARD_URL/DARTBOARD_TOKEN or the client
config file (`Settings.load`). A refusal prints the server's code and every problem, and
exits 1.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click
import yaml

from dartboard_client.client import ENDED, Client, DartboardError

SCOPES = ("train_instances", "heldout", "eval_split")


def parse_value(text: str) -> Any:
    """A setting's value as typed: JSON when it parses (1e-5, true, "x", [1, 2]), else the
    text itself (a name, a path)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_assignment(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise click.BadParameter(f"{text!r} is not SETTING=VALUE (e.g. trainer.lr=1e-5)")
    return key.strip(), value


def overrides_of(assignments: tuple[str, ...]) -> dict[str, Any]:
    return {key: parse_value(value) for key, value in map(parse_assignment, assignments)}


def grid_of(assignments: tuple[str, ...]) -> dict[str, list[Any]]:
    """SETTING=V1,V2,... each, or SETTING=[JSON list] for values holding commas."""
    grid: dict[str, list[Any]] = {}
    for key, value in map(parse_assignment, assignments):
        values = parse_value(value) if value.strip().startswith("[") else None
        if not isinstance(values, list):
            values = [parse_value(v.strip()) for v in value.split(",") if v.strip()]
        grid[key] = values
    return grid


def read_config(path: Path) -> dict[str, Any]:
    """Run settings from a .yaml, .yml or .json file (what is left out takes its default)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise click.ClickException(f"{path}: cannot read it: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise click.ClickException(
            f"{path}: not valid {path.suffix.lstrip('.') or 'JSON'}: {exc}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise click.ClickException(
            f"{path}: run settings must be a mapping, got {type(data).__name__}"
        )
    return data


def emit(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))


def run_line(run: dict[str, Any]) -> str:
    why = run.get("queue_reason") or run.get("status_message") or ""
    return f"#{run['id']} {run['name']}: {run['status']}" + (f" ({why})" if why else "")


def greedy_line(metrics: dict[str, Any]) -> str:
    """The newest finished greedy evaluation of each scope, e.g. 'train_instances v4: 60%
    [45%, 73%] (18/30)'."""
    newest: dict[str, dict[str, Any]] = {}
    for point in metrics.get("greedy", []):
        newest[point["scope"]] = point  # by version within a scope
    if not newest:
        return "no greedy evaluation yet"
    return "; ".join(
        f"{scope} v{p['version']}: {p['rate']:.0%} [{p['low']:.0%}, {p['high']:.0%}] "
        f"({p['ok']}/{p['scored']})"
        for scope, p in newest.items()
    )


class Context:
    def __init__(self, url: str | None, token: str | None) -> None:
        self.url, self.token = url, token
        self._client: Client | None = None

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.url, self.token)
        return self._client


pass_ctx = click.make_pass_decorator(Context)


@click.group()
@click.option(
    "--url",
    envvar="DARTBOARD_URL",
    help="The server (default: DARTBOARD_URL, the config file, http://127.0.0.1:8000).",
)
@click.option(
    "--token",
    envvar="DARTBOARD_TOKEN",
    help="An API token from your account page (default: DARTBOARD_TOKEN, the config file).",
)
@click.pass_context
def main(ctx: click.Context, url: str | None, token: str | None) -> None:
    """Dartboard from the command line: runs, sweeps, metrics and trajectories through the
    server's API, with your token's roles."""
    ctx.obj = Context(url, token)


@main.command()
@pass_ctx
def whoami(ctx: Context) -> None:
    """Who the token is for, and what they may do."""
    me = ctx.client.me()
    click.echo(
        f"{me['username']} ({', '.join(me['roles']) or 'no role'}): may {', '.join(me['may'])}"
    )


# ---------------------------------------------------------------------- runs


@main.group()
def run() -> None:
    """Create, control, watch and read runs."""


@run.command("create")
@click.argument("config", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--name", help="The run's name (default: the file's name).")
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="SETTING=VALUE",
    help="Change a setting, e.g. trainer.lr=1e-5 (repeatable).",
)
@click.option("--start", is_flag=True, help="Start it at once.")
@click.option("--json", "as_json", is_flag=True, help="Print the run as JSON.")
@pass_ctx
def run_create(
    ctx: Context, config: Path, name: str | None, sets: tuple[str, ...], start: bool, as_json: bool
) -> None:
    """Create a run from a YAML or JSON file of settings."""
    made = ctx.client.run_create(
        name=name or config.stem,
        config=read_config(config),
        overrides=overrides_of(sets),
        start=start,
    )
    emit(made) if as_json else click.echo(run_line(made))


@run.command("list")
@click.option("--status", help="Only runs in this status.")
@click.option("--sweep", type=int, help="Only this sweep's runs.")
@click.option("--limit", type=int, default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def run_list(
    ctx: Context, status: str | None, sweep: int | None, limit: int, as_json: bool
) -> None:
    """Runs, newest first."""
    page = ctx.client.runs(status=status, sweep=sweep, limit=limit)
    if as_json:
        emit(page)
        return
    for item in page["results"]:
        click.echo(run_line(item))


@run.command("show")
@click.argument("run_id", type=int)
@click.option(
    "--config",
    "config_only",
    is_flag=True,
    help="Only its resolved settings, as YAML (a file for run create or sweep).",
)
@pass_ctx
def run_show(ctx: Context, run_id: int, config_only: bool) -> None:
    """A run as JSON: settings, status, placement, why it waits."""
    shown = ctx.client.run(run_id)
    if config_only:
        click.echo(yaml.safe_dump(shown["config"], sort_keys=False), nl=False)
    else:
        emit(shown)


def _control(action: str) -> click.Command:
    @click.argument("run_id", type=int)
    @pass_ctx
    def command(ctx: Context, run_id: int) -> None:
        click.echo(run_line(ctx.client.run_control(run_id, action)))

    command.__doc__ = f"{action.capitalize()} a run, as the run page's button does."
    return run.command(action)(command)


for _action in ("start", "pause", "resume", "stop"):
    _control(_action)


@run.command("copy")
@click.argument("run_id", type=int)
@click.option("--name")
@click.option("--set", "sets", multiple=True, metavar="SETTING=VALUE")
@click.option("--start", is_flag=True)
@pass_ctx
def run_copy(
    ctx: Context, run_id: int, name: str | None, sets: tuple[str, ...], start: bool
) -> None:
    """A new run with a run's settings and your changes."""
    click.echo(
        run_line(ctx.client.run_copy(run_id, name=name, overrides=overrides_of(sets), start=start))
    )


@run.command("watch")
@click.argument("run_id", type=int)
@click.option(
    "--interval", type=float, default=10.0, show_default=True, help="Seconds between looks."
)
@pass_ctx
def run_watch(ctx: Context, run_id: int, interval: float) -> None:
    """Its status and newest greedy success, a line each time one changes, until it ends
    (Ctrl-C stops watching, not the run)."""
    last = ""
    try:
        while True:
            current = ctx.client.run(run_id)
            line = f"{run_line(current)} | {greedy_line(ctx.client.metrics(run_id))}"
            if line != last:
                click.echo(f"{time.strftime('%H:%M:%S')} {line}")
                last = line
            if current["status"] in ENDED:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        return


@run.command("logs")
@click.argument("run_id", type=int)
@click.argument("process", required=False)
@click.option("--host", help="The host, where the run has a process of that name on several.")
@click.option("--json", "as_json", is_flag=True, help="The list as JSON.")
@pass_ctx
def run_logs(
    ctx: Context, run_id: int, process: str | None, host: str | None, as_json: bool
) -> None:
    """Without PROCESS: the run's processes, each with its host and log size. With it: the
    end of its log (inference-0, router, worker-train, worker-env-0, ...), on any host."""
    if process is not None:
        if as_json:
            raise click.UsageError("--json lists the processes: leave out PROCESS")
        click.echo(ctx.client.log(run_id, process, host=host), nl=False)
        return
    listed = [row for row in ctx.client.logs(run_id) if host is None or row["host"] == host]
    if as_json:
        emit(listed)
        return
    if not listed:
        click.echo(f"run {run_id} has no process log yet" + (f" on {host}" if host else ""))
    for row in listed:
        state = "running" if row["running"] else "stopped"
        click.echo(
            f"{row['host']}  {row['process']}  {state}  {row['size']} bytes  {row['updated_at']}"
        )


# ---------------------------------------------------------------------- sweeps


@main.command()
@click.argument("config", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--grid",
    "grid",
    multiple=True,
    metavar="SETTING=V1,V2",
    help="Values to sweep (repeatable: every combination).",
)
@click.option("--seeds", type=int, default=1, show_default=True, help="Seeds per combination.")
@click.option(
    "--parallel", type=int, default=1, show_default=True, help="Runs queued or running at once."
)
@click.option("--name", help="The sweep's name (default: the file's name).")
@click.option(
    "--set", "sets", multiple=True, metavar="SETTING=VALUE", help="Change a setting of every run."
)
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def sweep(
    ctx: Context,
    config: Path,
    grid: tuple[str, ...],
    seeds: int,
    parallel: int,
    name: str | None,
    sets: tuple[str, ...],
    as_json: bool,
) -> None:
    """Create a sweep: a run per grid combination and seed, started PARALLEL at a time as
    earlier ones end; its page lines up their curves."""
    made = ctx.client.sweep_create(
        name=name or config.stem,
        config=read_config(config),
        grid=grid_of(grid),
        seeds=seeds,
        parallel=parallel,
        overrides=overrides_of(sets),
    )
    if as_json:
        emit(made)
        return
    click.echo(
        f"sweep #{made['id']} {made['name']}: {len(made['members'])} runs, {ctx.client.settings.url}{made['url']}"
    )
    for member in made["members"]:
        click.echo(f"  {run_line(member['run'])}")


@main.group()
def sweeps() -> None:
    """List, read, stop sweeps and read their curves."""


@sweeps.command("list")
@pass_ctx
def sweeps_list(ctx: Context) -> None:
    for item in ctx.client.sweeps()["results"]:
        states = ", ".join(m["run"]["status"] for m in item["members"])
        click.echo(f"#{item['id']} {item['name']}: {states}")


@sweeps.command("show")
@click.argument("sweep_id", type=int)
@pass_ctx
def sweeps_show(ctx: Context, sweep_id: int) -> None:
    emit(ctx.client.sweep(sweep_id))


@sweeps.command("stop")
@click.argument("sweep_id", type=int)
@pass_ctx
def sweeps_stop(ctx: Context, sweep_id: int) -> None:
    """Stop its active runs; the others never start."""
    stopped = ctx.client.sweep_stop(sweep_id)
    click.echo(f"sweep #{stopped['id']} stopped")


@sweeps.command("metrics")
@click.argument("sweep_id", type=int)
@pass_ctx
def sweeps_metrics(ctx: Context, sweep_id: int) -> None:
    """Every member's greedy success per version, as CSV."""
    click.echo(ctx.client.sweep_metrics_csv(sweep_id), nl=False)


# ---------------------------------------------------------------------- reads


@main.command()
@click.argument("run_id", type=int)
@click.option("--csv", "as_csv", is_flag=True, help="CSV of one kind (--kind) instead of JSON.")
@click.option(
    "--kind",
    type=click.Choice(["greedy", "success", "throughput", "updates"]),
    default="greedy",
    show_default=True,
)
@pass_ctx
def metrics(ctx: Context, run_id: int, as_csv: bool, kind: str) -> None:
    """A run's metrics: greedy success per version with its interval, success rate,
    throughput, each update's metrics."""
    if as_csv:
        click.echo(ctx.client.metrics_csv(run_id, kind), nl=False)
    else:
        emit(ctx.client.metrics(run_id))


@main.command()
@click.option("--run", "run_id", type=int, help="Only this run's.")
@click.option("--status", help="succeeded, failed, error, aborted, running.")
@click.option("--task", help="A part of the task's name.")
@click.option(
    "--filter",
    "filters",
    multiple=True,
    metavar="NAME=VALUE",
    help="Any filter of the trajectory list page (reward=positive, source=precollected, ...).",
)
@click.option("--limit", type=int, default=50, show_default=True)
@click.option("--offset", type=int, default=0)
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def trajectories(
    ctx: Context,
    run_id: int | None,
    status: str | None,
    task: str | None,
    filters: tuple[str, ...],
    limit: int,
    offset: int,
    as_json: bool,
) -> None:
    """Trajectories, newest first, filtered as the trajectory list page."""
    extra = dict(map(parse_assignment, filters))
    page = ctx.client.trajectories(
        run=run_id, status=status, task=task, limit=limit, offset=offset, **extra
    )
    if as_json:
        emit(page)
        return
    click.echo(f"{page['count']} trajectories")
    for t in page["results"]:
        click.echo(
            f"#{t['id']} run {t['run']} {t['task']}: {t['status']} reward {t['reward']} ({t['length']} steps)"
        )


@main.command()
@click.argument("trajectory_id", type=int)
@pass_ctx
def trajectory(ctx: Context, trajectory_id: int) -> None:
    """A trajectory with its steps, as JSON."""
    emit(ctx.client.trajectory(trajectory_id))


@main.command()
@click.argument("trajectory_id", type=int)
@click.argument(
    "action", type=click.Choice(["accept", "unpool", "reject", "trim", "label", "reward"])
)
@click.option("--keep-steps", type=int, help="trim: steps kept from the start.")
@click.option("--label", "label", help="label: env_bug, reward_wrong, agent_mistake or fine.")
@click.option("--comment", default="")
@click.option("--reward", type=float, help="reward: the new reward (admins).")
@click.option("--reason", help="reward: why (recorded).")
@pass_ctx
def curate(
    ctx: Context,
    trajectory_id: int,
    action: str,
    keep_steps: int | None,
    label: str | None,
    comment: str,
    reward: float | None,
    reason: str | None,
) -> None:
    """Curate a trajectory as its page's buttons do."""
    bodies: dict[str, dict[str, Any]] = {
        "trim": {"keep_steps": keep_steps},
        "label": {"label": label, "comment": comment},
        "reward": {"reward": reward, "reason": reason},
    }
    body = bodies.get(action, {})
    done = ctx.client.curate(
        trajectory_id, action, **{k: v for k, v in body.items() if v is not None}
    )
    click.echo(
        f"#{done['id']}: {done['status']}, in pool {done['in_pool']}, rejected {done['rejected']}"
    )


@main.command()
@click.argument("run_id", type=int)
@click.option("--scope", type=click.Choice(SCOPES), default="train_instances", show_default=True)
@click.option("--version", type=int, help="Default: the run's newest.")
@pass_ctx
def evaluate(ctx: Context, run_id: int, scope: str, version: int | None) -> None:
    """Evaluate a running run's version now, on its env slots."""
    job = ctx.client.evaluate(run_id, scope, version)
    click.echo(f"evaluation #{job['id']} {job['name']}: {job['status']}")


@main.command()
@click.argument("job_id", type=int)
@pass_ctx
def evaluation(ctx: Context, job_id: int) -> None:
    """An evaluation job with its report, as JSON."""
    emit(ctx.client.evaluation(job_id))


@main.command()
@click.option("--split", type=click.Choice(["train", "eval"]))
@click.option("-q", "query", help="A part of the name or a tag.")
@click.option("--limit", type=int, default=100, show_default=True)
@pass_ctx
def tasks(ctx: Context, split: str | None, query: str | None, limit: int) -> None:
    """Tasks by name; an osworld task with what it needs of its slot and the files the
    file cache lacks."""
    for t in ctx.client.tasks(split=split, q=query, limit=limit)["results"]:
        line = f"#{t['id']} {t['name']} ({t['env_kind']}, {t['split']})"
        if t.get("needs"):
            line += f" needs: {', '.join(t['needs'])}"
        if t.get("missing_files"):
            line += f"; {len(t['missing_files'])} file(s) not in the file cache"
        click.echo(line)


@main.command()
@pass_ctx
def hosts(ctx: Context) -> None:
    """The hosts whose agents place runs, as JSON."""
    emit(ctx.client.hosts())


def run_cli(args: list[str] | None = None) -> int:
    """`dartboard`'s entry point: a refusal is printed with every problem, exit status 1."""
    try:
        main.main(args=args, prog_name="dartboard", standalone_mode=False)
    except DartboardError as exc:
        if len(exc.errors) > 1:
            click.echo(f"error ({exc.code}): {len(exc.errors)} problems:", err=True)
            for problem in exc.errors:
                click.echo(f"  {problem.get('message')}", err=True)
        else:
            click.echo(f"error ({exc.code}): {exc.message}", err=True)
        return 1
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_cli())
