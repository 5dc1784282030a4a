"""The guides stay true to the tree (issue 31 point 5, issue 41 point 4): README.md is the newcomer's
page (at most 350 lines), the user's reference is on the docs/ pages it links to, and docs/DEVELOPING.md
is the maintainer's guide. Each opens with a table of contents whose every entry reaches a heading and
lists every `##` section, in order; every link between them reaches a page and a heading; every ckrun
command in their code blocks is one ckrun's own parser accepts; the maintainer's guide names only
files, classes, functions and constants that exist, so a rename or a move that forgets it fails here,
not in the next engineer's hands; and docs/predicting.md names every GPU `--gpu` knows."""

from __future__ import annotations

import ast
import itertools
import re
import shlex
from functools import cache

import pytest

from conftest import ROOT
from ckrun.runner.predict.hardware import known_names

README = ROOT / "README.md"
DEVELOPING = ROOT / "docs" / "DEVELOPING.md"
# the user's pages: every docs/ page the README links to but the maintainer's guide and the benchmarks
PAGES = sorted({ROOT / link for link in re.findall(r"\]\((docs/[\w.]+\.md)[)#]", README.read_text(encoding="utf-8"))}
               - {DEVELOPING, *(ROOT / "docs").glob("benchmarks*.md")})
GUIDES = [README, DEVELOPING, *PAGES]
README_LINES = 350  # a newcomer's page (issue 41 point 4): the reference is on the pages
CODE = ("runner", "autotune", "bench", "tests")
NOT_OURS = {"ParallelDims": "torchtitan's, which the strategy decision compares ckrun's strategies with"}


def anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def headings(text: str) -> list[tuple[int, str]]:
    """(level, title) of every heading outside fenced code (a `# comment` in a block is none)."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"(#{1,6}) (.+)", line)):
            found.append((len(match[1]), match[2].strip()))
    return found


def contents(text: str) -> list[tuple[str, str]]:
    """(text, anchor) of each link of the table of contents: the links before the first `##` heading."""
    top = text.split("\n## ", 1)[0]
    return re.findall(r"^\s*- \[(.+?)\]\(#([^)]+)\)\s*$", top, re.M)


def test_anchors_are_githubs():
    assert anchor("Set-up on a fresh machine") == "set-up-on-a-fresh-machine"
    assert anchor("Weights, optimizer and loss") == "weights-optimizer-and-loss"
    assert anchor("A `tuner` knob (autotune/space/knobs.py)") == "a-tuner-knob-autotunespaceknobspy"
    assert headings("# A\n```\n# not one\n```\n## B") == [(1, "A"), (2, "B")]


@pytest.mark.parametrize("guide", GUIDES, ids=lambda path: path.name)
def test_every_contents_entry_reaches_its_heading_and_every_section_is_listed_in_order(guide):
    text = guide.read_text(encoding="utf-8")
    entries, titles = contents(text), [(level, title) for level, title in headings(text) if level > 1]
    assert entries, f"{guide.name} has no table of contents before its first section"
    by_anchor = {anchor(title): title for _, title in titles}
    assert len(by_anchor) == len(titles), f"{guide.name}: two headings share an anchor"
    for shown, target in entries:
        assert target in by_anchor, f"{guide.name}: the contents' {shown!r} links to #{target}, which no heading has"
        assert shown == by_anchor[target], f"{guide.name}: the contents say {shown!r} for {by_anchor[target]!r}"
    listed = [target for _, target in entries]
    sections = [anchor(title) for level, title in titles if level == 2]
    assert [target for target in listed if target in sections] == sections, \
        f"{guide.name}: the contents must list every ## section, in order: {sections}"
    assert listed == [anchor(title) for _, title in titles if anchor(title) in listed], \
        f"{guide.name}: the contents are not in the order of the headings"


def test_the_readme_points_maintainers_to_their_guide():
    assert "(docs/DEVELOPING.md)" in README.read_text(encoding="utf-8")


def test_the_readme_is_a_newcomers_page_linking_every_users_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_LINES, f"README.md has {len(text.splitlines())} lines; move reference to docs/"
    assert [title for level, title in headings(text) if level == 2][:2] == ["Set-up on a fresh machine", "Your first tune"]
    users = {path for path in (ROOT / "docs").glob("*.md") if path != DEVELOPING and not path.name.startswith("benchmarks")}
    assert set(PAGES) == users and len(PAGES) >= 7, "a docs/ page the README does not link to"


def _targets(guide) -> list[tuple[str, str]]:
    """(file, anchor) of each relative link of a page, outside code; the file relative to the page's folder."""
    prose = re.sub(r"```.*?```", "", guide.read_text(encoding="utf-8"), flags=re.S)
    return [(target, fragment) for target, fragment in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", prose)
            if "://" not in target]


@pytest.mark.parametrize("guide", GUIDES, ids=lambda path: path.name)
def test_every_link_reaches_a_page_and_its_heading(guide):
    links = _targets(guide)
    assert links or guide == DEVELOPING, f"{guide.name} links nowhere"
    for target, fragment in links:
        page = (guide.parent / target).resolve() if target else guide
        assert page.exists(), f"{guide.name} links to {target}, which is not there"
        if fragment and page.suffix == ".md":
            titles = {anchor(title) for _, title in headings(page.read_text(encoding="utf-8"))}
            assert fragment in titles, f"{guide.name} links to {target}#{fragment}, which {page.name} has no heading for"


# --- every command the user's pages show is one ckrun accepts --------------------------------------


def _blocks(text: str) -> list[tuple[str, str]]:
    """(language, text) of each fenced code block."""
    found, language, lines = [], None, []
    for line in text.splitlines():
        if line.startswith("```") and language is None:
            language, lines = line[3:].strip(), []
        elif line.startswith("```"):
            found.append((language, "\n".join(lines)))
            language = None
        elif language is not None:
            lines.append(line)
    return found


def _commands(text: str) -> list[list[str]]:
    """Each ckrun command line of the page's shell blocks (``` or ```bash), as its arguments after
    `ckrun`: comments, `$ `, variables, srun's options and torchrun's (`-m ckrun`) and redirections left out."""
    found = []
    for language, block in _blocks(text):
        if language not in ("", "bash"):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True) if re.search(r"\bckrun\b", line) else []
            if "ckrun" not in words or words[0] not in ("ckrun", "srun", "torchrun", "$") and "=" not in words[0]:
                continue
            after = words[len(words) - words[::-1].index("ckrun"):] if words[0] == "torchrun" else \
                words[words.index("ckrun") + 1:]
            found.append(list(itertools.takewhile(lambda word: word not in (">", "|", "&&"), after)))
    return found


def _parses(argv: list[str]) -> str | None:
    """Why ckrun's parser refuses `ckrun ARGV`, or None: the verb's own arguments, as `ckrun` reads them."""
    from ckrun.runner.cli import UsageError, _parse, _parser, _plugins, _verb_and_argv, load_command

    try:
        plugins = _plugins()
        verb, argv = _verb_and_argv(argv, plugins)
        _parse(_parser(load_command(verb, plugins) if verb else None, plugins), argv)
    except (UsageError, SystemExit) as err:
        return str(err)
    return None


@pytest.mark.parametrize("guide", [README, *PAGES], ids=lambda path: path.name)
def test_every_command_the_page_shows_parses(guide):
    commands = _commands(guide.read_text(encoding="utf-8"))
    assert commands or guide.name not in ("README.md", "distributed.md"), "the command reader reads nothing"
    refused = {" ".join(argv): why for argv in commands if (why := _parses(argv))}
    assert not refused, refused


def test_the_command_reader_reads_what_a_page_writes():
    text = ("```\nckrun tune my.yaml --max-mem 40GB   # a comment\nckrun schema > x.json\n```\n"
            "```bash\ntorchrun --nnodes 2 \\\n    -m ckrun run my.yaml --resume\nsrun --ntasks-per-node=1 ckrun my.yaml --nproc 8\n"
            "$ HF_HUB_OFFLINE=1 ckrun llama.yaml\npip install ckrun\n```\n```python\nckrun.train('x')\n```")
    assert _commands(text) == [["tune", "my.yaml", "--max-mem", "40GB"], ["schema"], ["run", "my.yaml", "--resume"],
                               ["my.yaml", "--nproc", "8"], ["llama.yaml"]]
    assert _parses(["tune", "my.yaml", "--max-mem", "40GB"]) is None
    assert "unrecognized arguments: --trialz 3" in _parses(["tune", "my.yaml", "--max-mem", "40GB", "--trialz", "3"])


# --- what the maintainer's guide names exists ------------------------------------------------------


def _spans(text: str) -> list[str]:
    """Every `code span` of the text outside fenced blocks, and each word of a fenced block."""
    fences = re.findall(r"```\w*\n(.*?)```", text, re.S)
    prose = re.sub(r"```\w*\n.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", prose) + [word for block in fences for word in block.split()]


def _paths(text: str) -> set[str]:
    """Repository paths named: each word of a code span with a `/` in it, but a placeholder's (OUT/x),
    an absolute path, a URL or an option."""
    found = set()
    for span in _spans(text):
        for word in span.split():
            word = word.strip("\"'(),;:")
            if word.startswith(("/", "$", "-", "~", ".")) or "=" in word or "://" in word:
                continue
            if "/" in word and re.fullmatch(r"[\w.\-/*]+", word) and not word.split("/")[0].isupper():
                found.add(word)
    return found


def _exists(path: str) -> bool:
    """From the repository's root, or (the layer list's `builders/checks.py`) from runner/'s."""
    return any(list(base.glob(path.rstrip("/"))) for base in (ROOT, ROOT / "runner"))


def _links(text: str) -> set[str]:
    return {target for target in re.findall(r"\]\(([^)#]+)\)", text) if "://" not in target}


def test_every_path_the_guide_names_exists():
    text = DEVELOPING.read_text(encoding="utf-8")
    paths = _paths(text)
    assert {"runner/plan/policies.py", "autotune/space/knobs.py", "bench/gpu/call.sh"} <= paths, "the path reader reads nothing"
    missing = sorted(path for path in paths if not _exists(path))
    missing += sorted(link for link in _links(text) if not (DEVELOPING.parent / link).exists())
    assert not missing, f"docs/DEVELOPING.md names paths that do not exist: {missing}"


@cache
def _defined() -> tuple[frozenset[str], frozenset[str], str]:
    """(names defined, names imported, all source text) over ckrun's code and tests."""
    defined, imported, texts = set(), set(), []
    for folder in CODE:
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            texts.append(text)
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    defined.add(node.name)
                elif isinstance(node, ast.Assign | ast.AnnAssign):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    defined.update(t.id if isinstance(t, ast.Name) else t.attr for t in targets
                                   if isinstance(t, ast.Name | ast.Attribute))
                elif isinstance(node, ast.ImportFrom | ast.Import):
                    imported.update(alias.asname or alias.name.split(".")[-1] for alias in node.names)
    texts.append((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return frozenset(defined), frozenset(imported), "\n".join(texts)


def _missing_name(span: str) -> str | None:
    """Why a code span naming a class, constant or function names nothing in the code; None if it does
    (or is no such name: a recipe key, a value, a command)."""
    defined, imported, source = _defined()
    if span.startswith(("ckrun.runner.", "ckrun.autotune.", "bench.")):  # a dotted path into the code: its last name
        parts = span.removeprefix("ckrun.").split(".")
        return None if parts[-1] in defined or ROOT.joinpath(*parts).with_suffix(".py").is_file() else span
    match = re.fullmatch(r"([A-Za-z_]\w*)(\(.*\))?", span)
    if match is None or span in NOT_OURS:
        return None
    name, called = match[1], match[2]
    if called or (name[0].isupper() and not name.isupper()):  # a function or a class: defined, or imported from torch
        return None if name in defined or name in imported else span
    if "_" in name or name.isupper():  # snake_case or a constant: said somewhere in the code
        return None if re.search(rf"\b{re.escape(name)}\b", source) else span
    return None


def test_every_class_function_and_constant_the_guide_names_is_in_the_code():
    spans = _spans(DEVELOPING.read_text(encoding="utf-8"))
    assert {"KNOBS", "Strategy", "plan_problems"} <= set(spans), "the name reader reads nothing"
    missing = sorted({why for span in spans if (why := _missing_name(span))})
    assert not missing, f"docs/DEVELOPING.md names what the code does not have: {missing}"


def test_the_name_check_finds_what_is_gone():
    assert _missing_name("NoSuchStrategy") == "NoSuchStrategy"
    assert _missing_name("no_such_function()") == "no_such_function()"
    assert _missing_name("ckrun.runner.predict.efficiency.no_such_entry") == "ckrun.runner.predict.efficiency.no_such_entry"
    assert _missing_name("ckrun.runner.predict.efficiency.write_entry") is None
    assert _missing_name("memory.sharding") is None and _missing_name("ParallelDims") is None
    assert _paths("`bench/gpu/tables.py OUT/x.json --out docs/benchmarks_gpu.md` and `/tmp/p` `gpu.json`") == \
        {"bench/gpu/tables.py", "docs/benchmarks_gpu.md"}
    assert _exists("builders/checks.py") and _exists("docs/benchmarks_*.md") and not _exists("runner/no_such.py")


def test_the_predicting_page_names_every_gpu_the_estimate_knows():
    """A GPU row (runner/predict/gpus.py) is a `--gpu` name: the user's page on predicting lists each one."""
    section = (ROOT / "docs" / "predicting.md").read_text(encoding="utf-8").split("## The time model", 1)[1]
    named = {word for span in re.findall(r"`([^`]+)`", section.split("\n## ", 1)[0]) for word in span.split()}
    assert set(known_names()) <= named, sorted(set(known_names()) - named)
