"""The recipe library through the real CLI: `ckrun ls`, `ckrun cp`, names resolved anywhere a path is."""

from __future__ import annotations

import json
import os
import sys
import zipfile
from pathlib import Path

import pytest

import children

from ckrun.runner.recipe import library
from ckrun.runner.cli import ls
from ckrun.runner.cli.ls import format_count
from ckrun.runner.recipe.library import library_recipes, resolve_recipe
from ckrun.runner.problems import InputError

ROOT = Path(__file__).resolve().parents[3]

# published sizes; ckrun's counts are built from the recipes, so they must agree within 1%
KNOWN_SIZES = {"bert_large": 335e6, "gpt2": 124e6, "gpt2_xl": 1.56e9, "resnet50": 25.6e6, "vit_b_16": 86.6e6,
               "roberta_large": 355e6, "llama_1b": 1.1e9, "t5_base": 223e6, "resnet152": 60.2e6, "vit_l_16": 304e6}


def parse_count(text: str) -> float:
    units = {"k": 1e3, "M": 1e6, "B": 1e9}
    return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)


def ls_rows(ckrun, *args) -> dict[str, list[str]]:
    code, out, err = ckrun("ls", *args)
    assert code == 0, err
    header, *rows = out.splitlines()
    assert header.split()[:3] == ["NAME", "FAMILY", "PARAMS"]
    return {row.split()[0]: row.split(maxsplit=3)[1:] for row in rows}


def test_ls_lists_every_recipe_with_family_count_and_description(ckrun):
    rows = ls_rows(ckrun)
    assert set(rows) == set(library_recipes())
    for name, (family, count, description) in rows.items():
        assert family in ("language", "vision", "classic") and parse_count(count) > 0 and description, name


def test_ls_counts_match_the_published_sizes_within_one_percent(ckrun):
    rows = ls_rows(ckrun)
    for name, size in KNOWN_SIZES.items():
        assert parse_count(rows[name][1]) == pytest.approx(size, rel=0.01), name
    assert rows["bert_large"][1] == "335.2M" and rows["gpt2_xl"][1] == "1.56B"


def test_ls_counts_are_computed_from_the_recipe(ckrun, monkeypatch, tmp_path):
    recipe = tmp_path / "deeper.yaml"
    text = (ROOT / "recipes" / "bert_tiny.yaml").read_text()
    recipe.write_text(text.replace("num_hidden_layers: 2", "num_hidden_layers: 4"))
    monkeypatch.setattr(library, "library_recipes", lambda: {"deeper": recipe, "bert_tiny": ROOT / "recipes" / "bert_tiny.yaml"})
    rows = ls_rows(ckrun)
    layer = 4 * 128 * 128 + 2 * 128 * 512 + 512 + 9 * 128  # one BERT layer of width 128, intermediate 512
    assert parse_count(rows["deeper"][1]) - parse_count(rows["bert_tiny"][1]) == pytest.approx(2 * layer, rel=0.01)


def test_ls_shows_the_rest_when_one_recipe_is_broken(ckrun, monkeypatch, tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text((ROOT / "recipes" / "bert_tiny.yaml").read_text().replace("  steps: 30", "  stepz: 30"))
    monkeypatch.setattr(library, "library_recipes", lambda: {"broken": broken, "gpt2": ROOT / "recipes" / "gpt2.yaml"})
    code, out, err = ckrun("ls")
    assert code == 2 and "train.stepz: unknown key" in err and len(err.splitlines()) == 1
    assert "124.4M" in out and "ckrun validate broken" in out


def test_ls_json_is_the_table_as_data(ckrun, monkeypatch, tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text((ROOT / "recipes" / "bert_tiny.yaml").read_text().replace("  steps: 30", "  stepz: 30"))
    recipes = {"broken": broken, "gpt2": ROOT / "recipes" / "gpt2.yaml", "resnet50": ROOT / "recipes" / "resnet50.yaml"}
    monkeypatch.setattr(library, "library_recipes", lambda: recipes)
    code, out, err = ckrun("ls", "--json")
    entries = {entry["name"]: entry for entry in json.loads(out)}
    assert code == 2 and "train.stepz: unknown key" in err  # as the table: the rest listed, the broken one named
    gpt2 = entries["gpt2"]
    assert set(gpt2) == {"name", "family", "parameters", "description", "path"} and gpt2["description"]
    assert (gpt2["family"], format_count(gpt2["parameters"]), gpt2["path"]) == ("language", "124.4M", str(recipes["gpt2"]))
    assert entries["broken"]["parameters"] is None and entries["resnet50"]["family"] == "vision"
    code, out, _ = ckrun("ls", "vision", "--json")
    assert [entry["name"] for entry in json.loads(out)] == ["resnet50"]


def test_ls_filters_by_family(ckrun):
    rows = ls_rows(ckrun, "vision")
    assert set(rows) >= {"resnet50", "resnet152", "vit_b_16", "vit_l_16"}
    assert {family for family, _, _ in rows.values()} == {"vision"}
    code, _, err = ckrun("ls", "visoin")
    assert code == 2 and "no such family" in err and len(err.splitlines()) == 1


def test_cp_copies_the_file_with_its_comments(ckrun, tmp_path):
    dest = tmp_path / "my.yaml"
    code, out, _ = ckrun("cp", "gpt2", dest)
    assert code == 0 and str(dest) in out
    assert dest.read_text() == (ROOT / "recipes" / "gpt2.yaml").read_text()
    assert dest.read_text().startswith("# ckrun recipes/gpt2.yaml")
    code, out, err = ckrun("validate", dest)
    assert code == 0, err


def test_cp_refuses_to_overwrite_unless_forced(ckrun, tmp_path):
    dest = tmp_path / "my.yaml"
    dest.write_text("# my edits\n")
    code, _, err = ckrun("cp", "gpt2", dest)
    assert code == 2 and len(err.splitlines()) == 1 and "--force" in err
    assert dest.read_text() == "# my edits\n"
    code, _, _ = ckrun("cp", "gpt2", dest, "--force")
    assert code == 0 and dest.read_text() == (ROOT / "recipes" / "gpt2.yaml").read_text()


def test_cp_into_a_folder_keeps_the_file_name(ckrun, tmp_path):
    code, _, _ = ckrun("cp", "resnet50", tmp_path)
    assert code == 0 and (tmp_path / "resnet50.yaml").is_file()


def test_cp_unknown_name_lists_close_matches(ckrun, tmp_path):
    code, _, err = ckrun("cp", "gtp2", tmp_path / "x.yaml")
    assert code == 2 and "did you mean gpt2" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x.yaml").exists()


def test_unknown_names_list_every_close_recipe():
    with pytest.raises(InputError) as caught:
        resolve_recipe("bert")
    assert all(name in str(caught.value) for name in ("bert_base", "bert_tiny", "bert_large"))
    with pytest.raises(InputError, match="llama_1b"):
        resolve_recipe("llama")


def test_names_resolve_with_or_without_yaml_and_paths_win(tmp_path, monkeypatch):
    assert resolve_recipe("gpt2") == resolve_recipe("gpt2.yaml") == library_recipes()["gpt2"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt2.yaml").write_text("x: 1\n")
    assert resolve_recipe("gpt2.yaml") == Path("gpt2.yaml")  # a file that exists is never shadowed
    with pytest.raises(InputError):
        resolve_recipe("configs/gpt2.yaml")  # a path that does not exist is not a library name


def test_every_command_takes_a_library_name(ckrun):
    code, out, _ = ckrun("validate", "classic_conv20")
    assert code == 0 and out.strip().endswith("classic_conv20.yaml: OK")
    code, out, _ = ckrun("show", "classic_conv20", "model.config.depth=8")
    assert code == 0 and "depth: 8" in out


def _can_build_wheels_here() -> bool:
    """Whether this environment's setuptools can build the wheel without build isolation: it must meet
    pyproject's build requirement (>= 68) and have bdist_wheel (built in since 70.1, else the wheel
    package). A venv made by `python3.11 -m venv` has setuptools 65.5 without wheel, and
    `pip install -e .` builds in an isolated environment and leaves that alone: CI's venv is such a one."""
    import importlib.metadata
    import importlib.util
    import re

    try:
        found = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("setuptools"))
    except importlib.metadata.PackageNotFoundError:
        return False
    version = (int(found[1]), int(found[2])) if found else (0, 0)
    return version >= (68, 0) and (version >= (70, 1) or importlib.util.find_spec("wheel") is not None)


def test_the_wheel_carries_every_recipe(tmp_path):
    # offline and fast with this environment's setuptools when it can; otherwise the way `pip install`
    # builds it, in an isolated environment with the build requirements pyproject names (needs the index)
    isolation = ["--no-build-isolation"] if _can_build_wheels_here() else []
    children.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", str(ROOT),
                  "-w", str(tmp_path)], check=True, capture_output=False)
    (wheel,) = tmp_path.glob("ckrun-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"ckrun/recipes/{path.relative_to(ROOT / 'recipes').as_posix()}" for path in library_recipes().values()} <= names
    assert {"ckrun/recipes/__init__.py", "ckrun/recipes/parameter_counts.json", "ckrun/runner/models/classics.py"} <= names
    # one import name in site-packages, whatever the folders are called here (tests/test_import_name.py)
    assert {name.split("/")[0] for name in names if ".dist-info/" not in name} == {"ckrun"}


def test_a_recipe_path_that_is_not_a_readable_file_is_one_line(tmp_path, ckrun):
    for name, expected in [(str(tmp_path), "is not a regular file"), ("a" * 5000, "File name too long")]:
        code, _, err = ckrun("validate", name)
        assert code == 2 and len(err.splitlines()) == 1 and expected in err, err


def _ls_in_a_child() -> tuple[str, list[str]]:
    """(exit status and the heavy modules `ckrun ls` imported, its table's lines), in a fresh interpreter."""
    code = ("import contextlib, io, sys\nfrom ckrun.runner.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out: status = main(['ls'])\n"
            "print(status, sorted(m for m in ('torch', 'transformers', 'torchvision') if m in sys.modules))\n"
            "print(out.getvalue(), end='')")
    done = children.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    said, *table = done.stdout.splitlines()
    assert said, done.stderr[-2000:]
    return said, table


def test_a_first_ls_imports_no_torch(tmp_path):
    said, table = _ls_in_a_child()  # this test's user cache is new and empty: every count is the shipped one
    assert said == "0 []" and len(table) == len(library_recipes()) + 1


def test_the_shipped_counts_are_the_built_counts():
    shipped = json.loads((ROOT / "recipes" / ls.COUNTS).read_text())
    built = ls.shipped_table(library_recipes())
    assert shipped == built, ("recipes/parameter_counts.json is stale; write this into it:\n"
                              + json.dumps(built, indent=1))


def test_a_damaged_shipped_table_means_building(ckrun, monkeypatch, tmp_path):
    (tmp_path / "tiny.yaml").write_text((ROOT / "recipes" / "bert_tiny.yaml").read_text())
    (built,) = ls.shipped_table({"tiny": tmp_path / "tiny.yaml"}).values()
    monkeypatch.setattr(library, "library_root", lambda: tmp_path)
    for damage in ('{"a": ', '["a list"]', '{"key": {"parameters": "4M"}}'):
        (tmp_path / ls.COUNTS).write_text(damage)
        assert ls_rows(ckrun)["tiny"][1] == format_count(built["parameters"])


def test_ls_keeps_its_counts_and_a_second_ls_imports_no_torch(ckrun, tmp_path):
    first = ls_rows(ckrun)
    said, table = _ls_in_a_child()
    assert said == "0 []"  # every count from the cache: nothing heavy imported
    assert {row.split()[0]: row.split(maxsplit=3)[1:] for row in table[1:]} == first


def test_a_python_models_count_follows_its_module_file(ckrun, monkeypatch, tmp_path):
    module = tmp_path / "own_net.py"
    recipe = tmp_path / "own.yaml"
    recipe.write_text("description: own\nmodel: {source: python, name: 'own_net:make'}\ndata: {source: synthetic, task: causal_lm, vocab_size: 8}\n"
                      "train: {batch_size: 2, steps: 1}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(library, "library_recipes", lambda: {"own": recipe})
    for width, count in ((4, "20"), (8, "72")):  # a Linear(width, width): width^2 + width
        module.write_text(f"import torch\n\n\ndef make(**config):\n    return torch.nn.Linear({width}, {width})\n")
        sys.modules.pop("own_net", None)
        assert ls_rows(ckrun)["own"][1] == count


def test_a_damaged_count_cache_is_rebuilt(ckrun, monkeypatch, tmp_path):
    cache = Path(os.environ["XDG_CACHE_HOME"]) / "ckrun" / "parameter_counts.json"
    cache.parent.mkdir(parents=True, exist_ok=True)
    recipe = tmp_path / "three.yaml"  # not a library model: its count is built and kept in the user's cache
    recipe.write_text((ROOT / "recipes" / "bert_tiny.yaml").read_text().replace("num_hidden_layers: 2",
                                                                                "num_hidden_layers: 3"))
    monkeypatch.setattr(library, "library_recipes", lambda: {"three": recipe})
    for damage in ('{"a": ', '["not", "a", "dict"]', '{"key": "335M"}'):
        cache.write_text(damage)
        assert ls_rows(ckrun)["three"][1] == "1.7M"
        assert json.loads(cache.read_text())  # written again, whole


EDITABLE = """
import contextlib, importlib.machinery, io, sys
ROOT = {root!r}

class Editable:  # as setuptools' editable finder: the packages found by a meta path finder, not on sys.path
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name in ("ckrun",):
            return importlib.machinery.PathFinder.find_spec(name, [ROOT])
        return None

sys.path = [p for p in sys.path if p not in ("", ROOT)]
sys.meta_path.insert(0, Editable)  # before any other finder of these names (a shared venv's own editable install)
from ckrun.runner.cli import main
with contextlib.redirect_stdout(io.StringIO()): status = main(['ls'])
print(status, sorted(m for m in ('torch', 'transformers', 'torchvision') if m in sys.modules))
"""


def test_ls_is_warm_under_an_editable_install(tmp_path):
    """issue 36 point 9: the classic_* recipes' module (ckrun.runner.models.classics) is found through the
    editable finder, so their counts are kept and a second ls imports nothing heavy (it built them every time)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = EDITABLE.format(root=str(ROOT))
    said = [children.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
            for _ in range(2)]
    assert said[0].stdout.startswith("0 "), said[0].stderr[-2000:]
    assert said[1].stdout.strip() == "0 []", said[1].stderr[-2000:]
