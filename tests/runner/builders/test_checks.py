"""The checks after the schema (runner/builders/checks.py): the schema alone imports no torch, transformers
or user code; the checks find the rest, all at once, at their lines; the tuner's run leaves user code alone."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import BERT_TINY, ROOT
from ckrun.runner.builders.checks import load_checked
from ckrun.runner.problems import InputError


def test_the_schema_alone_imports_no_torch_transformers_or_user_code():
    code = textwrap.dedent("""
        import sys
        from ckrun.runner.recipe.library import library_recipes
        from ckrun.runner.recipe.load import load_recipe
        for path in library_recipes().values():
            load_recipe(path)
        print(sorted(m for m in ("torch", "transformers", "torchvision") if m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_the_schemas_problems_and_the_deeper_ones_come_at_once(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(Path(BERT_TINY).read_text().replace("  steps: 30", "  steps: 0")
                      .replace("    hidden_size: 128", "    hiden_size: 128"))
    with pytest.raises(InputError) as caught:
        load_checked(recipe)
    assert [problem.key for problem in caught.value.problems] == ["model.config.hiden_size", "train.steps"]
    assert all(problem.place.line for problem in caught.value.problems)


def test_without_user_code_the_factory_is_not_imported(tmp_path, monkeypatch):
    (tmp_path / "marked_models.py").write_text("import sys\nsys.imported_marked = True\ndef net(width=2):\n    pass\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {source: python, name: 'marked_models:net', config: {widht: 3}}\n"
                      "data: {source: synthetic, task: image_classification}\ntrain: {batch_size: 2, steps: 1}\n")
    monkeypatch.delitem(sys.modules, "marked_models", raising=False)
    load_checked(recipe, user_code=False)  # `ckrun tune` in its own process: the model child checks the code
    assert not hasattr(sys, "imported_marked")
    with pytest.raises(InputError) as caught:
        load_checked(recipe)
    [problem] = caught.value.problems
    assert problem.key == "model.config.widht" and problem.place.line == 1
    monkeypatch.delattr(sys, "imported_marked")
