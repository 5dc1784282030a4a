"""Names in a recipe resolved to Python objects: a transformers class, a `package.module:factory`.

The recipe checks them at validation (so `ckrun validate` catches a typo) and build/ uses them:
this module imports neither torch nor transformers until a name has to be looked up.
"""

from __future__ import annotations

import importlib

from ..problems import suggest


def transformers_class(name: str):
    """The transformers model class called `name` (`BertForMaskedLM`); a ValueError naming close ones if none."""
    import transformers

    if not name.isidentifier() or not hasattr(transformers, name):
        known = [n for n in dir(transformers) if n.endswith(("Model", "LM", "Generation", "Classification"))]
        raise ValueError(f"transformers has no class {name!r}{suggest(name, known)}")
    model_class = getattr(transformers, name)
    if getattr(model_class, "config_class", None) is None:
        raise ValueError(f"transformers.{name} is not a model class with a config")
    return model_class


def resolve_import_path(path: str):
    """`package.module:attribute` -> the attribute; a one-line ValueError when it cannot be found."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{path!r} is not an import path; write it as package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # any import-time failure of user code is a bad-input problem
        raise ValueError(f"cannot import {module_name!r}: {type(err).__name__}: {err}") from None
    if not hasattr(module, attribute):
        names = [n for n in dir(module) if not n.startswith("_")]
        raise ValueError(f"module {module_name!r} has no {attribute!r}{suggest(attribute, names)}")
    return getattr(module, attribute)
