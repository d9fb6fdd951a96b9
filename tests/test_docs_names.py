"""Every name the README and the docs cite names something that exists: a repository path (in
code or a link), a run setting (`trainer.lr`), a built-in task (`miniwob/click-button`,
`desktop/double-click`); the README's table lists every page of the site; and how long
`make test` takes is written in one place, docs/tests.md, which the others link to.

Make targets, commands and their flags are checked in tests/test_docs.py. Read as text, in a
few seconds: no site is built.
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

from hostagent.docs_reference import make_targets, setting_names
from tests.test_docs import nav_titles

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TIMES = ROOT / "docs" / "tests.md"  # the one page that says how long the suite takes
# Bare file names (no folder) of files that are not this repository's: the docs name them
# as what another project ships.
NOT_OURS = {
    "modeling_qwen2_5_vl.py": "transformers' Qwen2.5-VL model (docs/gpu-and-vllm.md)",
}


@cache
def repository_files() -> frozenset[str]:
    """Every file of the working tree that git tracks or would track (untracked, not ignored):
    a path under an ignored folder (.venv, var/) is no repository path."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return frozenset(line for line in listed.splitlines() if (ROOT / line).exists())


@cache
def _tops() -> frozenset[str]:
    """The repository's top-level folders and files (core, docs, .ci, Makefile)."""
    return frozenset(path.split("/")[0] for path in repository_files())


@cache
def _basenames() -> frozenset[str]:
    return frozenset(path.rsplit("/", 1)[-1] for path in repository_files())


def _code(text: str) -> list[str]:
    """The inline code spans and the fenced and indented code lines of a page."""
    fenced = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
    spans = [line for block in fenced for line in block.splitlines()]
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    spans += re.findall(r"`([^`\n]+)`", text)
    spans += re.findall(r"^    (\S.*)$", text, re.M)
    return spans


def _links(text: str) -> list[str]:
    """Relative link and image targets, without their anchors."""
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#")[0] for t in targets if t.split("#")[0] and ":" not in t.split("#")[0]]


# A path: words, dots and dashes between slashes, not inside a longer word, an absolute path,
# a home path (~/osworld), an artifact reference (artifact:policies/...) or a URL.
PATH = re.compile(r"(?<![\w.\-/~:$@<>{}])[\w.\-]+(?:/[\w.\-]*)*")
PLACEHOLDER = ("<", "*", "{")  # `bench/results/mainjob-seed<N>.json`: a prefix of a real path
OUR_BARE_NAMES = re.compile(r"[\w.\-]+\.(?:py|md)")


def _path_problem(token: str, after: str) -> str | None:
    """Why `token` (followed by `after`) cites no file of this repository, or None."""
    token = token.rstrip(".,")
    if "/" not in token:  # a bare name: ours when it is a module or a page of ours
        if not OUR_BARE_NAMES.fullmatch(token) or token in NOT_OURS:
            return None
        found = token in _basenames()
        return None if found else f"`{token}`: no file of this name in the repository"
    if token.split("/")[0] not in _tops():
        return None  # not under a folder of this repository (var/logs, controllers/setup.py)
    if after.startswith(PLACEHOLDER):
        found = any(path.startswith(token) for path in repository_files())
        return None if found else f"`{token}...`: nothing in the repository starts so"
    return None if (ROOT / token).exists() else f"`{token}` does not exist"


def test_every_repository_path_the_docs_cite_exists():
    """`tests/workers/test_evaluation.py`, `bench/results/mainjob-seed<N>.json` (a prefix),
    `test_roles.py` (a bare module name: some file of the repository has it), and every
    relative link and image (the site's build checks the pages' own, not the README's)."""
    wrong = []
    for doc in DOCS:
        text = doc.read_text()
        where = doc.relative_to(ROOT)
        for span in _code(text):
            for m in PATH.finditer(span):
                if problem := _path_problem(m.group(), span[m.end() :]):
                    wrong.append(f"{where}: {problem}")
        for target in _links(text):
            if not (doc.parent / target).resolve().exists():
                wrong.append(f"{where}: the link ({target}) leads to no file")
    assert not wrong, "\n".join(sorted(set(wrong)))


SECTIONS = sorted({name.split(".")[0] for name in setting_names() if "." in name})
# `section.knob` alone: not part of a dotted module path (workers.evaluation.x), a file name
# (curation.py), a call (env.get(...)) or a longer word.
SECTION = "|".join(SECTIONS)
SETTING = re.compile(rf"(?<![\w./-])((?:{SECTION})\.([a-z_][a-z0-9_]*))(?![\w(/-]|\.\w)")
FILE_SUFFIXES = {"py", "md", "json", "yaml", "yml", "txt", "toml", "log", "html", "js", "css"}
NOT_SETTINGS = {
    "trainer.learning_rate": "docs/runs-and-processes.md: the unknown setting a refusal names",
}


def test_every_run_setting_the_docs_name_exists():
    """Any `section.knob` in the text, code or link anchors (`trainer.lr`,
    `reference/settings.md#rollout.vllm_gpus`) is a RunConfig setting, or a module
    (`rollout.vllm_command`)."""
    names = set(setting_names())
    wrong = []
    for doc in DOCS:
        for m in SETTING.finditer(doc.read_text()):
            name, knob = m.group(1), m.group(2)
            module = ROOT / name.split(".")[0] / knob  # rollout.vllm_command
            if name in names or name in NOT_SETTINGS or knob in FILE_SUFFIXES:
                continue
            if not (module.with_suffix(".py").exists() or module.is_dir()):
                wrong.append(f"{doc.relative_to(ROOT)}: `{name}` is no run setting")
    assert not wrong, "\n".join(sorted(set(wrong)))


def builtin_task_names() -> set[str]:
    """What `manage.py import_builtin_tasks` imports."""
    from envmanager.desktop_tasks import desktop_task_records
    from envmanager.miniwob_tasks import miniwob_task_records
    from envmanager.sim_env import sim_task_records

    records = miniwob_task_records() + desktop_task_records() + sim_task_records()
    return {record["name"] for record in records}


# A built-in kind's task name; OSWorld's are the ids of the user's OSWorld checkout.
TASK = re.compile(r"(?<![\w./~-])((?:miniwob|desktop|sim)/[a-z0-9][a-z0-9-]*)(?![\w/<*-]|\.\w)")


def test_every_builtin_task_the_docs_name_exists():
    """`miniwob/click-button`, `desktop/editor-type-save`: a task the built-in import makes, or
    one a JSON example in the docs defines (docs/tasks.md's `miniwob/click-dialog-slow`)."""
    known = builtin_task_names()
    for doc in DOCS:
        for block in re.findall(r"```json\n(.*?)```", doc.read_text(), re.S):
            known |= set(re.findall(r'"name": "([^"]+)"', block))
    wrong = [
        f"{doc.relative_to(ROOT)}: `{name}` is no task (import_builtin_tasks makes none so)"
        for doc in DOCS
        for name in TASK.findall(doc.read_text())
        if name not in known
    ]
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_the_readme_lists_every_page_of_the_site():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Documentation", 1)[1]
    listed = set(re.findall(r"\]\(docs/([^)#]+)\)", table))
    missing = sorted(set(nav_titles()) - {"index.md"} - listed)  # index.md is the README's
    assert not missing, f"pages missing from the README's table of docs: {missing}"


# How long the suite takes, said in a sentence: "`make test` takes 13-15 minutes", "the
# suite then takes about 12 minutes", "(12-15 minutes on 2 cores)" after the suite.
DURATION = r"\d[\d.,]*(?:\s*-\s*\d[\d.,]*)?\s*(?:minutes?|min)\b"
SUITE_TIME = re.compile(
    rf"(?:make test(?:-fast)?`?|\bsuite\b)[^.;]{{0,40}}?(?:\btakes?\b|\btook\b|\bruns? in\b|\()"
    rf"[^.;()]{{0,30}}?{DURATION}",
    re.I,
)


def test_how_long_the_suite_takes_is_written_in_one_place():
    """docs/tests.md says it; the README links there and the Makefile's help names it, so a
    new measurement changes one line."""
    times = TIMES.read_text()
    section = times.split("## How long they take", 1)[1]
    assert re.match(rf"\s*Once installed, `make test` takes {DURATION} on 2 cores", section), (
        "docs/tests.md's *How long they take* opens with the figure"
    )
    elsewhere = []
    for doc in [*DOCS, ROOT / "Makefile"]:
        if doc != TIMES:
            text = " ".join(doc.read_text().split())
            elsewhere += [f"{doc.relative_to(ROOT)}: {m.group()!r}"
                          for m in SUITE_TIME.finditer(text)]  # fmt: skip
    helps = {target: text for target, text in make_targets() if target in ("test", "test-fast")}
    elsewhere += [f"make {target}'s help: {text!r}, not a pointer to docs/tests.md"
                  for target, text in helps.items()
                  if re.search(DURATION, text) or "docs/tests.md" not in text]  # fmt: skip
    assert not elsewhere, "the suite's time, written outside docs/tests.md:\n" + "\n".join(
        elsewhere
    )
    readme = (ROOT / "README.md").read_text()
    assert "(docs/tests.md#how-long-they-take)" in readme
