"""The REST API, `/api/v1/`: an interface of the web layer over the same services, rules and
messages as the dashboard's pages (docs/scripting.md).

- `auth`: bearer tokens and the browser's session, the dashboard's roles, the write limit;
- `errors`: every refusal as JSON (`code`, `message`, `field`, `errors`);
- `schemas`: request and response shapes (the OpenAPI schema at /api/v1/schema/);
- `runs`, `sweeps`, `metrics`, `logs` (a run's process logs), `trajectories`, `catalog`
  (tasks, evaluations, hosts, slots): the endpoints; `urls` maps them.
"""
