"""No import runs back up the house. runner/'s layers, lowest first; a module imports only from its
own layer or the ones below it:

1. foundations  problems, units, files, lock, environment, yamlio, choices, policies, pool_policies,
                strategies, plan, checkpoint_files, user_cache (messages, YAML, the policies, distributed
                strategies and the plan's data, the checkpoint file format, the lock a directory's
                owner holds, the environment variables read, the tables kept in the user's cache folder)
2. recipe       recipe, recipe_data, recipe_train, recipe_sinks, recipe_adapters, load, located, library
                (the validated recipe and where its lines are)
3. builders     builders/, models/ (model, data, optimizer from a recipe)
4. memory       memory/ (a plan applied to a built model; its peak measured)
5. parallel     parallel/ (ranks joined as a device mesh, DDP/FSDP2/HSDP/TP put on the planned model,
                torchrun started)
6. train        train/ (the step and the loop; the plan applied, the memory measured)
7. predict      predict/ (the training step run on fake tensors with a plan applied: above train)
8. cli          cli/, __main__ (the one place that sees everything)

autotune/ stands above all of runner/, and no runner module imports it: the CLI names the tune and
report verbs as module strings and loads the one asked for with importlib (DESIGN: the CLI is the
one place that sees both), which is no import statement. Every import counts, top-level or inside a
function: a lazy import that runs back up is still a crossing. None is allowed: the recipe's schema
imports nothing from builders/ (what needs a built or imported thing is checked after the schema, in
runner/builders/checks.py). ALLOWED would list an exception with its reason, and a test keeps that
list from going stale.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT

LAYERS = [
    ("foundations", {"runner.problems", "runner.units", "runner.files", "runner.lock", "runner.environment", "runner.yamlio",
                     "runner.choices", "runner.policies", "runner.pool_policies", "runner.strategies", "runner.plan", "runner.checkpoint_files",
                     "runner.user_cache"}),
    ("recipe", {"runner.recipe", "runner.recipe_data", "runner.recipe_train", "runner.recipe_sinks",
                "runner.recipe_adapters", "runner.load", "runner.located", "runner.library"}),
    ("builders", {"runner.builders", "runner.models"}),
    ("memory", {"runner.memory"}),
    ("parallel", {"runner.parallel"}),
    ("train", {"runner.train"}),
    ("predict", {"runner.predict"}),
    ("cli", {"runner.cli", "runner.__main__", "runner"}),
]

# (importer, imported) -> why it may run up a layer
ALLOWED: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, absolute, relative ones resolved; `from X import name` counts
    as X.name when that is a module of ours (`from runner.train import checkpoint`), else as X."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            found.update(f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base for alias in node.names)
    return {module for module in found if module.split(".")[0] in ("runner", "autotune")}


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
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


def crossings() -> set[tuple[str, str]]:
    """(importer, imported) for every import from a higher layer or from autotune/."""
    found = set()
    for path in runner_files():
        importer = module_name(path)
        for imported in imports_of(path):
            if imported.split(".")[0] == "autotune" or layer_of(imported) > layer_of(importer):
                found.add((importer, imported))
    return found


def test_no_runner_module_imports_from_a_layer_above_it_or_from_autotune():
    running_up = {(a, b): f"{LAYERS[layer_of(a)][0]} imports {LAYERS[layer_of(b)][0] if b.startswith('runner') else 'autotune'}"
                  for a, b in crossings() - ALLOWED.keys()}
    assert not running_up, running_up


def test_every_allowed_crossing_is_still_there():
    assert ALLOWED.keys() <= crossings(), "remove the crossings no module makes any more from ALLOWED"


def test_every_runner_module_has_a_layer():
    for path in runner_files():
        layer_of(module_name(path))


def test_the_walk_sees_relative_lazy_and_from_package_imports():
    """The checker itself: on the real files it must find the imports known to be there."""
    estimate = imports_of(ROOT / "runner" / "predict" / "estimate.py")
    assert {"runner.train.step", "runner.memory.apply", "runner.predict.cuda_model"} <= estimate
    assert "runner.builders.pretrained" in imports_of(ROOT / "runner" / "builders" / "checks.py")  # inside a function
    assert "runner.memory.measure" in imports_of(ROOT / "runner" / "train" / "loop.py")
    assert layer_of("runner.predict.estimate") > layer_of("runner.train.step") > layer_of("runner.memory.apply")
    assert layer_of("runner.memory.apply") > layer_of("runner.builders.pretrained") > layer_of("runner.checkpoint_files")


def test_the_recipe_schema_imports_nothing_from_build():
    """Validating a recipe's schema imports neither torch nor transformers nor user code: builders/ is above it."""
    schema = ["recipe", "recipe_data", "recipe_train", "recipe_sinks", "load", "located"]
    found = {name: {m for m in imports_of(ROOT / "runner" / f"{name}.py") if m.startswith("runner.builders")}
             for name in schema}
    assert not any(found.values()), found


def test_the_developers_guide_lists_the_same_layers():
    """docs/DEVELOPING.md's Layout section names each layer's modules in this order, so the two cannot drift apart."""
    guide = (ROOT / "docs" / "DEVELOPING.md").read_text(encoding="utf-8")
    layout = re.split(r"\n#{2,} ", guide.split("\n## Layout", 1)[1])[0]
    items = re.findall(r"^\d\. (.*?)(?=^\d\. |^\s*$)", layout, re.M | re.S)
    assert len(items) == len(LAYERS), items
    for item, (name, members) in zip(items, LAYERS, strict=True):
        for module in members - {"runner"}:
            short = module.removeprefix("runner.")
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


def test_autotune_has_no_import_circle():
    """The tuner's modules stand in layers too (facts, candidate, space, sharding, knobs, ...): no
    import, not even one read only by a type checker, runs back to a module that imports it."""
    graph = {module_name(path): {m for m in imports_of(path) if m.startswith("autotune")}
             for path in sorted((ROOT / "autotune").rglob("*.py"))}
    assert not _circles(graph), _circles(graph)
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
