"""`ckrun schema`: the recipe's JSON Schema, for completion and checks in an editor.

pydantic writes it from the same models that validate a recipe, field docstrings included, so
an editor's hover help and `ckrun validate` can never disagree about which keys exist.
"""

from __future__ import annotations

import json

from . import Command


def add_arguments(parser) -> None:
    pass  # the schema is one: no recipe, no options


def run(args) -> int:
    from ..recipe.recipe import Recipe

    # pydantic writes draft 2020-12; saying so lets an editor pick the right validator
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **Recipe.model_json_schema(),
              "title": "ckrun recipe"}
    print(json.dumps(schema, indent=2))
    return 0


COMMAND = Command(
    "schema", "print the recipe's JSON Schema, for completion and checks in an editor", add_arguments, run,
    epilog="examples:\n  ckrun schema > ckrun.schema.json\n"
    "  then start a recipe with:  # yaml-language-server: $schema=ckrun.schema.json",
)
