"""The docs tell the truth: the site builds in strict mode (a dead link or a page missing
from the nav fails), the generated reference matches the code, every command, script and
flag the README and docs name exists, the documented apt list is what make installs, and
the environment table lists exactly the variables the code reads.

And they read as a site (the built pages, read once per session): a long page has sections,
a page is titled as the navigation names it, a list renders as a list, a page or a run
setting the prose names is a link to it, and a screenshot opens whole."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import pytest
import yaml
from django.core.management import get_commands, load_command_class

from hostagent.docs_reference import make_targets, pages, setting_names

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CODE = ["core", "envmanager", "rollout", "training", "datamanager", "workers", "dartboard",
        "dartboard_client"]  # fmt: skip


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> dict[str, BuiltPage]:
    """The docs site, built once in strict mode: every nav page's article, by source path."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    built = {}
    for source in nav_titles():
        html = out / _url(source).lstrip("/") / "index.html"
        article = re.search(r'<article class="md-content__inner md-typeset">(.*?)</article>',
                            html.read_text(), re.S)  # fmt: skip
        assert article, f"{html}: no article (the theme's layout moved)"
        built[source] = BuiltPage.read(article.group(1))
    return built


def nav_titles() -> dict[str, str]:
    """mkdocs.yml's nav: each page's source path (under docs/) and its title there."""

    def walk(entries: list) -> Iterator[tuple[str, str]]:
        for entry in entries:
            for title, value in entry.items():
                yield from walk(value) if isinstance(value, list) else [(value, title)]

    return dict(walk(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]))


@dataclass
class BuiltPage:
    """What the tests read of a built page's article (its HTML parsed once)."""

    headings: list[tuple[int, str, str]] = field(default_factory=list)  # level, id, text
    paragraphs: list[str] = field(default_factory=list)  # each <p>'s text
    prose: list[tuple[str, bool]] = field(default_factory=list)  # (text, in <em>) outside
    # code, code blocks and links
    code_spans: list[str] = field(default_factory=list)  # inline code, not code blocks
    hrefs: list[str] = field(default_factory=list)
    images: list[tuple[str, str | None]] = field(default_factory=list)  # (src, enclosing href)

    @classmethod
    def read(cls, html: str) -> BuiltPage:
        reader = _ArticleReader()
        reader.feed(html)
        reader.close()
        return reader.page


class _ArticleReader(HTMLParser):
    VOID = {"img", "br", "hr", "input", "meta", "link", "wbr", "source"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.page = BuiltPage()
        self.open: list[tuple[str, dict[str, str | None]]] = []
        self.texts: list[list[str]] = []  # the text of each open <p>, <code>, heading

    def _inside(self, *tags: str) -> bool:
        return any(tag in tags for tag, _ in self.open)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "a" and attributes.get("href"):
            self.page.hrefs.append(attributes["href"] or "")
        if tag == "img":
            link = next((a.get("href") for t, a in reversed(self.open) if t == "a"), None)
            self.page.images.append((attributes.get("src") or "", link))
        if tag in self.VOID:
            return
        if tag == "a" and "headerlink" in (attributes.get("class") or ""):
            tag = "permalink"  # the heading's ¶, not its text
        self.open.append((tag, attributes))
        if tag in ("p", "code", "h1", "h2", "h3", "h4"):
            self.texts.append([])

    def handle_endtag(self, tag: str) -> None:
        if tag in self.VOID:
            return
        while self.open:
            opened, attributes = self.open.pop()
            if opened in ("p", "code", "h1", "h2", "h3", "h4"):
                text = "".join(self.texts.pop())
                if opened == "p":
                    self.page.paragraphs.append(text)
                elif opened == "code" and not self._inside("pre"):
                    self.page.code_spans.append(text)
                elif opened.startswith("h"):
                    self.page.headings.append((int(opened[1]), attributes.get("id") or "",
                                               text.strip()))  # fmt: skip
            if opened == tag or (opened == "permalink" and tag == "a"):
                break

    def handle_data(self, data: str) -> None:
        if self._inside("permalink"):
            return
        for text in self.texts:
            text.append(data)
        if not self._inside("code", "pre", "a", "script", "style"):
            self.page.prose.append((data, self._inside("em")))


def test_the_docs_site_builds_in_strict_mode(site):
    assert "Before you start" in {text for _, _, text in site["index.md"].headings}  # the README's


def test_every_long_page_is_split_into_sections(site):
    """A page longer than a screen or two has `##` headings: its contents list is not empty."""
    unsplit = []
    for source, page in site.items():
        lines = len((ROOT / "docs" / source).read_text().splitlines())
        if lines > 60 and sum(level == 2 for level, _, _ in page.headings) < 2:
            unsplit.append(f"{source}: {lines} lines and fewer than two `##` headings")
    assert not unsplit, "\n".join(unsplit)


def _url(source: str) -> str:
    """Where mkdocs serves a page: docs/x.md at /x/, docs/index.md at /."""
    return "/" + ("" if source == "index.md" else source.removesuffix(".md") + "/")


def _targets(source: str, page: BuiltPage) -> set[tuple[str, str]]:
    """(page URL, anchor) of every link on the page, resolved against the page's own URL."""
    out = set()
    for href in page.hrefs:
        target = urlsplit(urljoin("http://site" + _url(source), href))
        if target.netloc == "site":
            out.add((target.path, unquote(target.fragment)))
    return out


# A setting alone, or with its value: `trainer.lr`, `trainer.lr=1e-5`, `trainer.lora_rank 8`.
SETTING_IN_CODE = re.compile(r"([a-z_]+(?:\.[a-z0-9_]+)?)(?:$| ?= ?\S*$| \S+$)")


def test_every_setting_a_page_names_links_to_its_reference(site):
    """A page naming a run setting in code (`curation.staleness_k`, `trainer.lora_rank 8`,
    `trainer.lr=1e-5`) links it to its row of the settings reference at least once
    (reference/settings.md#curation.staleness_k)."""
    names = set(setting_names())
    unlinked = []
    for source, page in site.items():
        if source == "reference/settings.md":
            continue  # where the anchors are
        linked = {anchor for url, anchor in _targets(source, page)
                  if url == _url("reference/settings.md")}  # fmt: skip
        named = {m.group(1) for span in page.code_spans if (m := SETTING_IN_CODE.match(span))}
        unlinked += [f"{source}: `{name}` without a link to reference/settings.md#{name}"
                     for name in sorted(named & names - linked)]  # fmt: skip
    assert not unlinked, "\n".join(unlinked)


def test_every_screenshot_links_to_its_full_image(site):
    """An image is a link to its own file: a screenshot shown small (the dashboard page's
    tables) opens whole on a click."""
    unlinked = []
    for source, page in site.items():
        for src, href in page.images:
            full = urljoin("http://site" + _url(source), src)
            if href is None or urljoin("http://site" + _url(source), href) != full:
                unlinked.append(f"{source}: the image {src} is no link to the same file")
    assert not unlinked, "\n".join(unlinked)


def test_no_list_renders_as_a_paragraph(site):
    """A list needs a blank line before it: without one, markdown keeps its items in the
    paragraph above, each with a literal "- "."""
    glued = []
    for source, page in site.items():
        for text in page.paragraphs:
            if m := re.search(r"(?:^|\n)\s*(?:[-+*]|\d+\.) \S.*", text):
                glued.append(f"{source}: {m.group().strip()[:70]!r}")
    assert not glued, "a list item inside a paragraph (add a blank line before the list):\n" + (
        "\n".join(glued)
    )


def test_every_page_is_titled_as_the_navigation_names_it():
    """A page's `# ` heading is its title in mkdocs.yml's nav: the sidebar and the page agree."""
    wrong = []
    for source, title in nav_titles().items():
        first = re.search(r"^# (.+)$", (ROOT / "docs" / source).read_text(), re.M)
        if first is None or first.group(1).strip() != title:
            wrong.append(f"{source}: {first and first.group(1)!r}, the nav says {title!r}")
    assert not wrong, "\n".join(wrong)


def test_every_reference_to_a_page_is_a_link(site):
    """Prose that names a docs page ("docs/benchmarks.md", "see *Security model*", "*Disk over
    a long run*") links it: a page's file name, or a page's title (or file name in words) or a
    section's heading in emphasis or quotes, outside code and links, is a plain-text reference
    to resolve."""
    titles = {title.lower() for title in nav_titles().values()}
    titles |= {Path(source).stem.replace("-", " ") for source in site}  # *Scaling out*
    headings = {text.lower() for page in site.values() for _, _, text in page.headings}
    plain = []
    for source, page in site.items():
        for text, emphasized in page.prose:
            for m in re.finditer(r"(?<![\w/.-])(?:docs/)?((?:reference/)?[a-z0-9-]+\.md)\b", text):
                if m.group(1) in site:
                    plain.append(f"{source}: {m.group()!r}, not a link to {m.group(1)}")
            named = [text] if emphasized else []
            named += re.findall(r"[\"“]([^\"”]+)[\"”]", text)
            named = [" ".join(name.split()) for name in named]
            plain += [f"{source}: {name!r}, a page or section named without a link"
                      for name in named if name.lower() in titles | headings]  # fmt: skip
    assert not plain, "\n".join(plain)


def test_the_reference_pages_are_what_the_code_gives():
    for path, text in pages().items():
        assert path.exists() and path.read_text() == text, (
            f"{path.relative_to(ROOT)} is out of date: run `.venv/bin/python manage.py "
            "docs_reference`"
        )


def _code_spans() -> list[tuple[str, str]]:
    """(file, text) of every inline code span and fenced code line in the README and docs."""
    spans = []
    for path in DOCS:
        text = path.read_text()
        fences = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)  # ```bash, ```{.text .diagram}
        spans += [(path.name, line) for block in fences for line in block.splitlines()]
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        spans += [(path.name, s) for s in re.findall(r"`([^`\n]+)`", text)]
        indented = re.findall(r"^    (\S.*)$", text, re.M)  # indented code blocks
        spans += [(path.name, line) for line in indented]
    return spans


def _flags_after(text: str, start: int) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text[start:]))


def _command_flags(name: str) -> set[str]:
    command = load_command_class(get_commands()[name], name)
    parser = command.create_parser("manage.py", name)
    return {s for action in parser._actions for s in action.option_strings}


def test_every_command_script_and_flag_the_docs_name_exists():
    targets = {t for t, _ in make_targets()}
    commands = get_commands()
    wrong = []
    for where, span in _code_spans():
        for m in re.finditer(r"(?<![\w/.-])make ([a-z][a-z-]*)(?![\w=-])", span):
            if m.group(1) not in targets:
                wrong.append(f"{where}: `make {m.group(1)}` is no make target")
        for m in re.finditer(r"ARGS='([^']*)'", span):
            unknown = _flags_after(m.group(1), 0) - _command_flags("run_dartboard")
            wrong += [f"{where}: run_dartboard has no {flag}" for flag in sorted(unknown)]
        for m in re.finditer(r"manage\.py ([a-z_]+)", span):
            name = m.group(1)
            if name not in commands:
                wrong.append(f"{where}: `manage.py {name}` is no command")
                continue
            end = span.find(";", m.end())
            rest = span[: end if end > 0 else len(span)]
            unknown = _flags_after(rest, m.end()) - _command_flags(name)
            wrong += [f"{where}: manage.py {name} has no {flag}" for flag in sorted(unknown)]
        for m in re.finditer(r"(?<![\w.-])bench/([a-z_]+)\.py|-m bench\.([a-z_]+)", span):
            name = m.group(1) or m.group(2)
            script = ROOT / "bench" / f"{name}.py"
            if not script.exists():
                wrong.append(f"{where}: bench/{name}.py does not exist")
                continue
            source = script.read_text()
            end = span.find(";", m.end())
            rest = span[: end if end > 0 else len(span)]
            for flag in sorted(_flags_after(rest, m.end())):
                if f'"{flag}"' not in source:
                    wrong.append(f"{where}: bench/{name}.py has no {flag}")
    assert not wrong, "\n".join(wrong)


def test_every_dartboard_command_and_flag_the_docs_name_exists():
    """`dartboard run create cfg.yaml --set ...` in the docs: each word a command of the
    `dartboard` CLI (dartboard_client/cli.py), each flag one of its options."""
    import click

    from dartboard_client.cli import main

    wrong, seen = [], 0
    for where, span in _code_spans():
        m = re.match(r"\s*(?:\$ )?(?:\.venv/bin/)?dartboard((?: [a-z][a-z-]*)*)(.*)", span)
        if m:
            command: click.Command = main
            flags = {"--help", *(o for p in main.params for o in p.opts)}
            words = m.group(1).split()
            for i, word in enumerate(words):
                if not isinstance(command, click.Group):
                    break  # the rest are arguments
                if word not in command.commands:
                    wrong.append(f"{where}: `dartboard {' '.join(words[: i + 1])}` is no command")
                    break
                command = command.commands[word]
                flags |= {o for p in command.params for o in p.opts}
            seen += 1
            rest = m.group(2).split(";")[0]
            wrong += [f"{where}: `dartboard {' '.join(words)}` has no {flag}"
                      for flag in sorted(_flags_after(rest, 0) - flags)]  # fmt: skip
    assert not wrong, "\n".join(wrong)
    assert seen >= 10  # docs/scripting.md's


def test_every_json_example_the_docs_show_is_what_the_code_takes_or_gives():
    """Every JSON block in the docs is checked against the code that reads or writes it: a
    run config (its keys are RunConfig's) must pass the run form's validation, a task record
    the task importer's, an API refusal must be what the API answers for that input. A block
    of another kind fails here until this test knows how to check it."""
    from dataclasses import fields

    from dartboard.api.errors import body, config_problems
    from datamanager.config import ConfigInvalid, RunConfig
    from datamanager.task_import import parse_task_record
    from envmanager.osworld_tasks import is_osworld_task, osworld_task_problems

    sections = {f.name for f in fields(RunConfig)}
    kinds: dict[str, int] = {}
    for doc in DOCS:
        for block in re.findall(r"```json\n(.*?)```", doc.read_text(), flags=re.S):
            data = json.loads(block)
            where = f"{doc.relative_to(ROOT)}: {block[:60]!r}"
            if set(data) <= sections:
                RunConfig.from_dict(data)
                kind = "run config"
            elif "env_kind" in data:
                parse_task_record(data, where)
                kind = "task record"
            elif is_osworld_task(data):
                assert osworld_task_problems(data) == [], where
                kind = "osworld task"
            elif {"code", "message", "field", "errors"} <= set(data):
                assert data["code"] == "invalid_config", where  # the one refusal shown
                with pytest.raises(ConfigInvalid) as refused:
                    RunConfig.from_dict(_config_with(data["field"], -1.0))
                assert data == body(config_problems(refused.value)), where
                kind = "refusal"
            else:
                raise AssertionError(f"a JSON example this test cannot check: {where}")
            kinds[kind] = kinds.get(kind, 0) + 1
    assert kinds.keys() == {"run config", "task record", "refusal", "osworld task"}, kinds


def _config_with(path: str, value: object) -> dict:
    from datamanager.config import config_override

    return config_override({}, path, value)


def test_the_documented_apt_list_is_what_make_installs():
    readme = (ROOT / "README.md").read_text()
    listed = re.search(r"install what they need with\s+apt \(sudo when not root\):(.*?)\.\n",
                       readme, re.S)  # fmt: skip
    assert listed, "README: the apt sentence moved"
    documented = {p.strip() for p in listed.group(1).replace("\n", " ").split(",")}
    makefile = (ROOT / "Makefile").read_text()
    installed = set(re.search(r"^APT_PACKAGES := (.*)$", makefile, re.M).group(1).split())
    assert documented == installed


def _constants() -> dict[str, str]:
    """Module-level NAME = "STRING" assignments across the code (env variable names)."""
    out = {}
    for pkg in CODE:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                        and isinstance(node.value.value, str)):  # fmt: skip
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            out[target.id] = node.value.value
    return out


READERS = {"os.environ.get", "os.getenv", "environ.get", "os.environ.setdefault", "env.get"}
HELPERS = {"_home_secret"}  # config_env's readers that take the variable as name=


def variables_read() -> dict[str, str]:
    """Every environment variable the code reads by name, and one file that reads it."""
    constants = _constants()
    found: dict[str, str] = {}
    for pkg in CODE:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                key = None
                if isinstance(node, ast.Call) and ast.unparse(node.func) in HELPERS:
                    key = next((k.value for k in node.keywords if k.arg == "name"), None)
                elif isinstance(node, ast.Call) and node.args:
                    func = ast.unparse(node.func)
                    if func in READERS or func.split(".")[-1].startswith("env_"):
                        key = node.args[0]
                    elif func.endswith(".get") and isinstance(node.args[0], ast.Name):
                        key = node.args[0]  # a mapping of the environment, by a constant
                        key = key if key.id.endswith("_ENV") else None
                elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
                      and ast.unparse(node.value) == "os.environ"):  # fmt: skip
                    key = node.slice
                name = (
                    key.value if isinstance(key, ast.Constant)
                    else constants.get(key.id) if isinstance(key, ast.Name)
                    else None
                )  # fmt: skip
                if isinstance(name, str) and re.fullmatch(r"[A-Z][A-Z0-9_]+", name):
                    found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_the_environment_tables_list_exactly_the_variables_the_code_reads():
    page = (ROOT / "docs" / "configuration.md").read_text()
    first_cells = re.findall(r"^\| ([^|]+) \|", page, re.M)
    documented = {v for cell in first_cells for v in re.findall(r"`([A-Z][A-Z0-9_]+)`", cell)}
    read = variables_read()
    undocumented = {f"{v} (read in {read[v]})" for v in set(read) - documented}
    assert not undocumented, f"read by the code, not in docs/configuration.md: {undocumented}"
    assert not documented - set(read), "documented, read nowhere: " + str(documented - set(read))


@pytest.mark.parametrize("variable", ["DARTBOARD_HOME", "DARTBOARD_VLLM_PYTHON", "LOCAL_RANK"])
def test_the_scan_finds_reads_through_constants_and_helpers(variable):
    assert variable in variables_read()
