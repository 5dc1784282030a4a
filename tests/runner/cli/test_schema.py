"""`ckrun schema`: the JSON Schema an editor completes recipes with agrees with `ckrun validate`."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ckrun.runner.cli import main
from ckrun.runner.recipe.library import library_recipes
from ckrun.runner.recipe.load import recipe_from_text
from ckrun.runner.problems import InputError


@pytest.fixture(scope="module")
def schema() -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["schema"]) == 0
    return json.loads(out.getvalue())


def unknown_keys(schema: dict, node: dict, value, path: str = "") -> list[str]:
    """The dotted keys in `value` that the schema's objects do not allow (keys only, not values)."""
    node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]] if "$ref" in node else node
    alternatives = node.get("anyOf") or node.get("oneOf")
    if alternatives:  # a union: the keys are fine if one member its tag picks takes them all
        found = [unknown_keys(schema, alt, value, path) for alt in alternatives if tag_fits(schema, alt, value)]
        return min(found, key=len) if found else []
    if isinstance(value, dict) and "properties" in node:
        bad = []
        for key, item in value.items():
            if key in node["properties"]:
                bad += unknown_keys(schema, node["properties"][key], item, f"{path}{key}.")
            elif node.get("additionalProperties") is False:
                bad.append(f"{path}{key}")
        return bad
    return []


def tag_fits(schema: dict, node: dict, value) -> bool:
    """Whether `value`'s tag (name, policy, source, strategy) is one this union member's schema allows."""
    node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]] if "$ref" in node else node
    for tag, spec in node.get("properties", {}).items():
        allowed = [spec["const"]] if "const" in spec else spec.get("enum")
        if isinstance(value, dict) and tag in value and allowed is not None and value[tag] not in allowed:
            return False
    return True


def test_the_schema_describes_the_recipe(schema):
    assert schema["$schema"].endswith("2020-12/schema") and schema["title"] == "ckrun recipe"
    assert {"model", "data", "train", "memory", "output"} <= set(schema["properties"])
    assert schema["$defs"]["ModelSpec"]["properties"]["name"]["description"]  # field docstrings become hover help


@pytest.mark.parametrize("name", sorted(library_recipes()))
def test_every_library_recipe_has_only_keys_the_schema_knows(schema, name):
    document = yaml.safe_load(library_recipes()[name].read_text())
    assert unknown_keys(schema, schema, document) == []


def mapping_paths(value, path=()) -> list[tuple]:
    """Every mapping in a document, by its key path; model.config is free-form for the schema (the model's
    config class decides), so it is left out."""
    if not isinstance(value, dict) or path == ("model", "config"):
        return []
    return [path] + [p for key, item in value.items() for p in mapping_paths(item, (*path, key))]


BERT_TINY = yaml.safe_load(library_recipes()["bert_tiny"].read_text())


@settings(max_examples=25, deadline=None)
@given(where=st.sampled_from(mapping_paths(BERT_TINY)), key=st.from_regex(r"[a-z][a-z_]{0,11}", fullmatch=True))
def test_the_schema_and_validate_agree_on_which_keys_exist(schema, where, key):
    document = json.loads(json.dumps(BERT_TINY))
    mapping = document
    for part in where:
        mapping = mapping[part]
    mapping.setdefault(key, 1)
    dotted = ".".join((*where, key))
    schema_rejects = dotted in unknown_keys(schema, schema, document)
    try:
        recipe_from_text(yaml.safe_dump(document))
        problems = []
    except InputError as err:
        problems = [str(p) for p in err.problems]
    validate_rejects = any(f" {dotted}: unknown key" in p for p in problems)
    assert schema_rejects == validate_rejects, (dotted, problems)
