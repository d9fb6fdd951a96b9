"""The `osworld` backend on a real sandboxed Dartboard desktop serving OSWorld's protocol:
the scripted oracle solves every shipped OSWorld-format task (scored by the wheel's metrics
and getters), a random policy does not, and evaluator or VM failures are environment
errors, never a reward of 0."""

from __future__ import annotations

import json
import random

import pytest

from core.protocol import Action, ActionType, EnvUnavailable, TaskSpec
from envmanager.oracles import oracle_action
from envmanager.osworld_env import OSWorldEnv
from envmanager.osworld_oracles import OSWORLD_PLANS, osworld_task_files

pytestmark = [pytest.mark.desktop]

TASKS = {f"osworld/{json.loads(p.read_text())['id']}": p for p in osworld_task_files()}


def spec(name: str) -> TaskSpec:
    data = json.loads(TASKS[name].read_text())
    return TaskSpec(
        name=name, env_kind="osworld", env_config={"osworld": data}, instruction=data["instruction"]
    )


@pytest.fixture(scope="module")
def env(osworld_desktop):
    e = OSWorldEnv(
        address=osworld_desktop.address, token=osworld_desktop.token, settle_s=0.1, wait_seconds=0.3
    )
    yield e
    e.close()


def test_every_shipped_task_has_an_oracle_and_at_least_ten_ship():
    assert len(TASKS) >= 10 and set(TASKS) == set(OSWORLD_PLANS)


def test_the_oracle_solves_every_osworld_task(env):
    rewards = {}
    for name in sorted(TASKS):
        obs = env.reset(spec(name))
        assert (obs.width, obs.height) == (1024, 768) and obs.metadata["vm"] == env.address
        while (
            action := oracle_action(env_kind="osworld", task_name=name, observation=obs)
        ) is not None:
            obs = env.step(action)
            if action.ends_episode:
                break
        rewards[name] = env.evaluate().reward
    assert rewards == dict.fromkeys(TASKS, 1.0)


def _random_action(rng: random.Random) -> Action:
    kind = rng.choice(["click", "type", "hotkey", "scroll", "finished", "call_user"])
    x, y = rng.randrange(1024), rng.randrange(768)
    if kind == "type":
        return Action(type=ActionType.TYPE, text=rng.choice(["ls\n", "hello", "red blue", "x"]))
    if kind == "hotkey":
        return Action(type=ActionType.HOTKEY, key=rng.choice(["enter", "ctrl s", "ctrl a", "tab"]))
    if kind == "scroll":
        return Action(type=ActionType.SCROLL, x=x, y=y, direction=rng.choice(["up", "down"]))
    if kind in ("finished", "call_user"):
        return Action(type=ActionType(kind))
    return Action(type=ActionType.CLICK, x=x, y=y)


def test_a_random_policy_does_not_solve_them(env):
    rng = random.Random(7)
    successes = 0
    names = sorted(TASKS)[::2]  # six of the twelve: terminal, editor and browser tasks
    for name in names:
        env.reset(spec(name))
        for _ in range(2):
            action = _random_action(rng)
            env.step(action)
            if action.ends_episode:
                break
        successes += env.evaluate().success
    assert successes < len(names)


def test_call_user_solves_only_the_infeasible_task(env):
    env.reset(spec("osworld/dartboard-terminal-mkdir"))
    env.step(Action(type=ActionType.CALL_USER))
    assert env.evaluate().reward == 0.0  # OSWorld: FAIL on a feasible task scores 0
    env.reset(spec("osworld/dartboard-infeasible-spotify"))
    env.step(Action(type=ActionType.FINISHED, text="played it"))
    assert env.evaluate().reward == 0.0


def test_a_failing_evaluator_is_an_environment_error_not_a_zero(env):
    task = spec("osworld/dartboard-terminal-mkdir")
    broken = dict(task.env_config["osworld"])
    # exact_match reads rules["expected"]: a rule without it makes the wheel's metric raise.
    broken["evaluator"] = {
        "func": "exact_match",
        "result": {"type": "vm_command_line", "command": ["echo", "yes"]},
        "expected": {"type": "rule", "rules": {"wanted": "yes\n"}},
    }
    env.reset(TaskSpec(task.name, "osworld", {"osworld": broken}, task.instruction))
    with pytest.raises(EnvUnavailable, match="exact_match failed: KeyError"):
        env.evaluate()


def test_an_unreachable_vm_is_unavailable_at_once():
    dead = OSWorldEnv(address="127.0.0.1:9", token="t")
    with pytest.raises(EnvUnavailable, match=r"127\.0\.0\.1:9"):
        dead.reset(spec("osworld/dartboard-terminal-mkdir"))


def test_a_vm_with_no_way_to_reset_is_refused_with_the_reason():
    """A server that answers the health check but has no snapshot provider configured and no
    /dartboard/reset (an OSWorld VM's own server): resetting it would leave the last task's
    state, so the backend refuses."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class VMServer(BaseHTTPRequestHandler):
        def do_POST(self):
            found = self.path == "/screen_size"
            body = b'{"width": 1920, "height": 1080}' if found else b"Not Found"
            self.send_response(200 if found else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), VMServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        vm = OSWorldEnv(address=f"127.0.0.1:{server.server_address[1]}", token="t")
        assert vm.screen_size() == (1920, 1080)
        with pytest.raises(EnvUnavailable, match="cannot be reset: configure a provider"):
            vm.reset(spec("osworld/dartboard-terminal-mkdir"))
    finally:
        server.shutdown()


@pytest.mark.parametrize("text", ["café au lait", "日本語", "naïve résumé 👍"])
def test_text_beyond_ascii_is_typed_on_the_osworld_desktop(env, text):
    """pyautogui alone types 'caf' for 'café': the editor task asked for each text, and
    given exactly that text to type, scores 1."""
    data = json.loads(TASKS["osworld/dartboard-editor-type-save"].read_text())
    data["evaluator"]["expected"]["rules"] = text
    env.reset(TaskSpec(name="osworld/dartboard-editor-type-save", env_kind="osworld",
                       env_config={"osworld": data}, instruction=f"Type {text} and save."))  # fmt: skip
    for action in [
        Action(type=ActionType.CLICK, x=400, y=300),
        Action(type=ActionType.TYPE, text=text),
        Action(type=ActionType.HOTKEY, key="ctrl s"),
    ]:
        env.step(action)
    assert env.evaluate().reward == 1.0


def test_a_task_needing_what_the_desktop_does_not_offer_is_refused_before_its_setup(env):
    tabs = {
        "id": "open-tabs",
        "instruction": "Read the open tabs.",
        "config": [
            {"type": "execute", "parameters": {"command": ["touch", "/home/user/setup-ran"]}},
            {"type": "chrome_open_tabs", "parameters": {"urls_to_open": ["http://localhost/"]}},
        ],
        "evaluator": {"func": "infeasible"},
    }
    task = TaskSpec(name="osworld/open-tabs", env_kind="osworld", env_config={"osworld": tabs})
    with pytest.raises(EnvUnavailable, match=r"osworld/open-tabs needs chrome_cdp, which this "
                                             r"desktop does not offer \(it offers app:chrome"):  # fmt: skip
        env.reset(task)
    assert env.controller.get_file("/home/user/setup-ran") is None  # no step of it ran
