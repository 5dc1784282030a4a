"""No import runs back up the house. runner/'s layers, lowest first; a module imports only from its
own layer or the ones below it:

1. foundations  problems, units, environment (messages and the errors that end a command, numbers for
                people, the environment variables read)
2. plan         plan/ (the memory policies and distributed strategies as types, the MemoryPlan made of
                them: plain data that imports nothing else of ckrun)
3. disk         disk/ (files written whole, the lock a directory's owner holds and its holder's record,
                the checkpoint file format, the tables kept in the user's cache folder)
4. recipe       recipe/ (YAML, the validated recipe and where its lines are, the bundled library)
5. builders     builders/, models/ (model, data, optimizer from a recipe)
6. memory       memory/ (a plan applied to a built model; its peak measured)
7. parallel     parallel/ (ranks joined as a device mesh, DDP/FSDP2/HSDP/TP put on the planned model,
                torchrun started)
8. train        train/ (the step and the loop; the plan applied, the memory measured), its folders
                (checkpoint/, eval/, output/, run/, measure/) in finer layers of their own: TRAIN_LAYERS
9. predict      predict/ (the training step run on fake tensors with a plan applied: above train)
10. top         api (training as a call), cli/, __main__ (the one place that sees everything)

autotune/ stands above all of runner/, and no runner module imports it: the CLI names the tune and
report verbs as module strings and loads the one asked for with importlib (DESIGN: the CLI is the
one place that sees both), which is no import statement. Every import counts, top-level or inside a
function: a lazy import that runs back up is still a crossing. None is allowed: the recipe's schema
imports nothing from builders/ (what needs a built or imported thing is checked after the schema, in
runner/builders/checks.py). ALLOWED would list an exception with its reason, and a test keeps that
list from going stale.

Within a folder, and across runner/ and autotune/, no import circle (an import inside a function
that only hides one from Python counts), and no private name (`_x`) read from another module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conftest import ROOT

LAYERS = [
    ("foundations", {"ckrun.runner.problems", "ckrun.runner.units", "ckrun.runner.environment"}),
    ("plan", {"ckrun.runner.plan"}),
    ("disk", {"ckrun.runner.disk"}),
    ("recipe", {"ckrun.runner.recipe"}),
    ("builders", {"ckrun.runner.builders", "ckrun.runner.models"}),
    ("memory", {"ckrun.runner.memory"}),
    ("parallel", {"ckrun.runner.parallel"}),
    ("train", {"ckrun.runner.train"}),
    ("predict", {"ckrun.runner.predict"}),
    ("top", {"ckrun.runner.api", "ckrun.runner.cli", "ckrun.runner"}),
]

# (importer, imported) -> why it may run up a layer
ALLOWED: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    """A file's installed module name: runner/ and autotune/ are ckrun.runner and ckrun.autotune."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(["ckrun", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, absolute, relative ones resolved; `from X import name` counts
    as X.name when that is a module of ours (`from ckrun.runner.train.checkpoint import store`), else as X."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _from_module(path, node)
            found.update(f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base for alias in node.names)
    return {module for module in found if _is_ours(module)}


def _from_module(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` in `path` reads from, relative imports resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    if not node.level:
        return node.module or ""
    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join([*anchor, *([node.module] if node.module else [])])


def _is_ours(module: str) -> bool:
    return module.split(".")[:2] in (["ckrun", "runner"], ["ckrun", "autotune"])


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.removeprefix("ckrun.").split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def layer_of(module: str) -> int:
    """The layer of the longest prefix of `module` named in LAYERS."""
    parts = module.split(".")
    for length in range(len(parts), 0, -1):
        prefix = ".".join(parts[:length])
        for index, (_, members) in enumerate(LAYERS):
            if prefix in members:
                return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}")


def runner_files() -> list[Path]:
    return sorted((ROOT / "runner").rglob("*.py"))


def autotune_files() -> list[Path]:
    return sorted((ROOT / "autotune").rglob("*.py"))


def crossings() -> set[tuple[str, str]]:
    """(importer, imported) for every import from a higher layer or from autotune/."""
    found = set()
    for path in runner_files():
        importer = module_name(path)
        for imported in imports_of(path):
            if imported.startswith("ckrun.autotune") or layer_of(imported) > layer_of(importer):
                found.add((importer, imported))
    return found


def test_no_runner_module_imports_from_a_layer_above_it_or_from_autotune():
    running_up = {(a, b): f"{LAYERS[layer_of(a)][0]} imports {LAYERS[layer_of(b)][0] if b.startswith('ckrun.runner') else 'autotune'}"
                  for a, b in crossings() - ALLOWED.keys()}
    assert not running_up, running_up


def test_every_allowed_crossing_is_still_there():
    assert ALLOWED.keys() <= crossings(), "remove the crossings no module makes any more from ALLOWED"


def test_every_runner_module_has_a_layer():
    for path in runner_files():
        layer_of(module_name(path))


# The command line's modules: they parse, call and print. The library never calls its CLI (as optuna's
# library never calls optuna's): what a verb and a Python call share is below both (runner/api.py,
# autotune/request.py, autotune/tune.py, runner/predict/plan_lines.py).
CLI_MODULES = ("ckrun.runner.cli", "ckrun.__main__", "ckrun.autotune.cli_tune", "ckrun.autotune.cli_report")


def _is_cli(module: str) -> bool:
    return any(module == cli or module.startswith(f"{cli}.") for cli in CLI_MODULES)


def test_no_module_outside_the_cli_imports_a_cli_module():
    top = sorted((ROOT / "ckrun").glob("*.py"))
    calling = {module_name(path) if path.parent.name != "ckrun" else f"ckrun.{path.stem}".removesuffix(".__init__"):
               sorted(m for m in imports_of(path) | _ckrun_imports(path) if _is_cli(m))
               for path in [*runner_files(), *autotune_files(), *top]}
    assert not {module: cli for module, cli in calling.items() if cli and not _is_cli(module)}
    assert _is_cli("ckrun.runner.cli.estimate") and not _is_cli("ckrun.runner.client")  # the check itself
    assert "ckrun.runner.cli" in calling["ckrun.__main__"]  # the walk reads the top package too
    import ckrun

    assert not [module for module in ckrun._PUBLIC.values() if _is_cli(module)]  # the API's names, imported by name


def _ckrun_imports(path: Path) -> set[str]:
    """`ckrun.x` names of the top package's files (`from ckrun.runner.cli import entry`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ckrun"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("ckrun"))
    return found


def test_the_walk_sees_relative_lazy_and_from_package_imports():
    """The checker itself: on the real files it must find the imports known to be there."""
    estimate = imports_of(ROOT / "runner" / "predict" / "estimate.py")
    assert {"ckrun.runner.train.step", "ckrun.runner.memory.apply", "ckrun.runner.predict.cuda_model"} <= estimate
    assert "ckrun.runner.builders.pretrained" in imports_of(ROOT / "runner" / "builders" / "checks.py")  # inside a function
    assert "ckrun.runner.memory.measure" in imports_of(ROOT / "runner" / "train" / "trainer.py")
    assert layer_of("ckrun.runner.predict.estimate") > layer_of("ckrun.runner.train.step") > layer_of("ckrun.runner.memory.apply")
    assert layer_of("ckrun.runner.memory.apply") > layer_of("ckrun.runner.builders.pretrained") > layer_of("ckrun.runner.disk.checkpoint_files")


# runner/train/'s own layers, lowest first: a module of train/ imports only train/ modules of its own
# layer or below. Its folders name ideas (checkpoint/, eval/, output/, run/, measure/); the layers say
# which of their modules stand on which, since an idea's parts sit at different heights (the checkpoint
# store is below what a run writes, --resume above it).
TRAIN_LAYERS = [
    ("step and saved state", {"step", "checkpoint", "checkpoint.store", "checkpoint.fingerprint", "checkpoint.sharded",
                              "run.memory_cap", "run.room", "measure", "measure.measurement", "measure.update_error", "eval",
                              "eval.metrics", "eval.early_stop", "output", "output.numbers", "run"}),
    ("what a run writes and says", {"output.directory", "output.trackers", "output.sinks", "output.curves",
                                    "run.guard", "run.progress", "run.start_line"}),
    ("what the loop calls", {"ranked", "checkpoint.resume", "output.export", "run.ownership", "eval.evaluate",
                             "measure.lossy"}),
    ("the trainer", {"trainer"}),
    ("evaluation's schedule", {"eval.best", "eval.schedule"}),
    ("the loop", {"loop"}),
    ("the tuner's probe", {"measure.probe"}),
]


def sub_layer_of(module: str, package: str, layers: list[tuple[str, set[str]]]) -> int:
    """The layer in `layers` (a folder's own, named relative to `package`) of the longest prefix of `module`."""
    parts = module.removeprefix(f"{package}.").split(".")
    for length in range(len(parts), 0, -1):
        found = [index for index, (_, members) in enumerate(layers) if ".".join(parts[:length]) in members]
        if found:
            return found[0]
    raise AssertionError(f"{module} is in no layer of {package}: add it to the layers of {package} in {Path(__file__).name}")


def imports_running_up(package: str, layers: list[tuple[str, set[str]]]) -> set[tuple[str, str]]:
    """(importer, imported) for each import within `package` from one of its layers above the importer's."""
    inside = [path for path in [*runner_files(), *autotune_files()] if module_name(path).startswith(f"{package}.")]
    return {(module_name(path), imported) for path in inside for imported in imports_of(path)
            if imported.startswith(f"{package}.")
            and sub_layer_of(imported, package, layers) > sub_layer_of(module_name(path), package, layers)}


def test_every_train_module_has_one_train_layer():
    named = [short for _, members in TRAIN_LAYERS for short in members]
    assert len(named) == len(set(named)), "a module named in two layers of TRAIN_LAYERS"
    on_disk = {module_name(path).removeprefix("ckrun.runner.train.") for path in (ROOT / "runner" / "train").rglob("*.py")}
    assert on_disk - {"ckrun.runner.train"} == set(named), "TRAIN_LAYERS and runner/train/'s files differ"


def test_the_recipe_schema_imports_nothing_from_build():
    """Validating a recipe's schema imports neither torch nor transformers nor user code: builders/ is above it."""
    found = {path.name: {m for m in imports_of(path) if m.startswith("ckrun.runner.builders")}
             for path in sorted((ROOT / "runner" / "recipe").glob("*.py"))}
    assert "recipe.py" in found and "load.py" in found  # the walk reads the schema's files
    assert not any(found.values()), found


def test_the_developers_guide_lists_the_same_layers():
    """docs/DEVELOPING.md's Layout section names each layer's modules in this order, so the two cannot drift apart."""
    guide = (ROOT / "docs" / "DEVELOPING.md").read_text(encoding="utf-8")
    layout = re.split(r"\n#{2,} ", guide.split("\n## Layout", 1)[1])[0]
    items = re.findall(r"^\d+\. (.*?)(?=^\d+\. |^\s*$)", layout, re.M | re.S)
    assert len(items) == len(LAYERS), items
    for item, (name, members) in zip(items, LAYERS, strict=True):
        for module in members - {"ckrun.runner"}:
            short = module.removeprefix("ckrun.runner.")
            shown = f"`{short}`" if ROOT.joinpath("runner", f"{short}.py").is_file() else f"`{short}/`"
            assert shown in item, f"docs/DEVELOPING.md's layer {name} does not name {shown}: {item!r}"


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle of `graph` once, as the modules along it (a depth-first walk per module)."""
    found, seen = [], set()
    for start in sorted(graph):
        stack = [(start, [start])]
        while stack:
            module, path = stack.pop()
            for imported in sorted(graph.get(module, ())):
                if imported == start and frozenset(path) not in seen:
                    seen.add(frozenset(path))
                    found.append(path + [start])
                elif imported not in path and imported > start:
                    stack.append((imported, path + [imported]))
    return found


# (importer, imported) -> why the two import each other; an edge listed here is left out of the walk.
# Empty: what both sides of a circle need goes where it belongs (a module of its own, or the lower
# side). Optional heavy packages (torchvision, peft, torchao) are imported inside functions too, but
# they are not ours and make no circle.
CIRCLE_EXCEPTIONS: dict[tuple[str, str], str] = {}


def import_graph() -> dict[str, set[str]]:
    """Each module of runner/ and autotune/ -> the modules of ours it imports, anywhere in the file."""
    return {module_name(path): imports_of(path) - {module_name(path)} for path in [*runner_files(), *autotune_files()]}


def test_no_import_circle_in_runner_or_autotune():
    """No import, not even one inside a function or read only by a type checker, runs back to a
    module that imports it: the modules stand in layers within each folder too (facts, candidate,
    space, knobs in autotune/; data below image_loader, estimate below fallback, fingerprint below
    checkpoint and resume). An import inside a function to break a circle hides it from Python only."""
    graph = {module: {m for m in imported if (module, m) not in CIRCLE_EXCEPTIONS}
             for module, imported in import_graph().items()}
    assert not _circles(graph), _circles(graph)


def test_every_circle_exception_is_still_an_import():
    graph = import_graph()
    assert all(imported in graph.get(importer, ()) for importer, imported in CIRCLE_EXCEPTIONS), \
        "remove the imports no module makes any more from CIRCLE_EXCEPTIONS"


def test_the_circle_walk_finds_each_circle_once():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _circles({"a": {"b"}, "b": {"a", "c"}, "c": {"b"}}) == [["a", "b", "a"], ["b", "c", "b"]]
    assert "ckrun.runner.train.checkpoint.fingerprint" in import_graph()["ckrun.runner.train.checkpoint.resume"]  # the walk reads our modules


def private_names_used(path: Path, source: str | None = None) -> set[str]:
    """`module._name` for each private name `path` takes from another module of ours: `from X import
    _name`, or `_name` read as an attribute of a module of ours it imported (`import ckrun.runner.x as x;
    x._name`, `from runner import x; x._name`). Dunder names are public protocol, not private."""
    tree = ast.parse(path.read_text(encoding="utf-8") if source is None else source)
    me, modules, found = module_name(path), {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _is_ours(base := _from_module(path, node)):
            for alias in node.names:
                if _is_module(f"{base}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{base}.{alias.name}"
                elif _is_private(alias.name) and base != me:
                    found.add(f"{base}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in (alias for alias in node.names if _is_ours(alias.name)):  # `import a.b` binds a
                modules[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and (owner := _module_read(node.value, modules)):
            if owner != me:
                found.add(f"{owner}.{node.attr}")
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _module_read(node: ast.expr, modules: dict[str, str]) -> str | None:
    """The module of ours `node` names (`x`, `ckrun.runner.train.x`), given the names imported as modules."""
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in modules:
        return None
    module = ".".join([modules[node.id], *reversed(chain)])
    return module if _is_module(module) else None


def test_no_private_name_is_imported_across_modules():
    """What another module needs is public: a leading underscore promises that only its own module
    reads it, so renaming or removing it is safe without a search."""
    used = {path.relative_to(ROOT).as_posix(): sorted(names) for path in [*runner_files(), *autotune_files()]
            if (names := private_names_used(path))}
    assert not used, used


def test_the_private_name_walk_sees_each_form():
    """The checker itself, on a made-up module of runner/memory/ (absolute, relative, attribute reads)."""
    source = ("from ckrun.runner.units import _x\nfrom .offload import _y, ok\nimport ckrun.runner.disk.files\nimport ckrun.runner.disk.lock as l\n"
              "from ckrun.runner.train import step\nckrun.runner.disk.files._z(); l._w; step.__name__; _own = 1; self._v\n")
    assert private_names_used(ROOT / "runner" / "memory" / "made_up.py", source) == {
        "ckrun.runner.units._x", "ckrun.runner.memory.offload._y", "ckrun.runner.disk.files._z", "ckrun.runner.disk.lock._w"}


# autotune/'s own layers, lowest first, as runner/train/ has them: its folders name ideas (space/,
# search/, probes/, outputs/), and a module imports only autotune modules of its own layer or below.
# The search proposes and screens without knowing what answers a probe (the caller hands it an
# `evaluate`), so probes/ stands above it: the model child runs the solver, the screen returns the
# search's `Prediction`. tune orchestrates all of them; the CLIs and the Python API sit on top.
AUTOTUNE_LAYERS = [
    ("foundations", {"cap", "records"}),
    ("space", {"space"}),
    ("search", {"search"}),
    ("probes", {"probes"}),
    ("outputs", {"outputs"}),
    ("one tune", {"tune"}),
    ("front", {"request", "cli_tune", "cli_report", "api"}),
]


def test_every_autotune_module_has_one_autotune_layer():
    named = [name for _, members in AUTOTUNE_LAYERS for name in members]
    assert len(named) == len(set(named)), "a name in two layers of AUTOTUNE_LAYERS"
    on_disk = {module_name(path).removeprefix("ckrun.autotune.").split(".")[0] for path in autotune_files()} - {"ckrun"}
    assert on_disk == set(named), "AUTOTUNE_LAYERS and autotune/'s files and folders differ"


@pytest.mark.parametrize("package, layers", [("ckrun.runner.train", TRAIN_LAYERS), ("ckrun.autotune", AUTOTUNE_LAYERS)])
def test_no_module_imports_from_a_layer_of_its_folder_above_it(package, layers):
    running_up = imports_running_up(package, layers)
    assert not running_up, running_up
