"""Names in a recipe resolved to Python objects: a transformers class, a `package.module:factory`.

The checks after the schema (runner/builders/checks.py) resolve them, so `ckrun validate` catches a
typo, and build/ uses them: this module imports neither torch nor transformers until a name has to
be looked up.
"""

from __future__ import annotations

import importlib
import inspect
import os

from ..recipe.load import add_import_root, import_roots
from ..problems import KeyedError, suggest
from .user_code import check_import


def transformers_class(name: str):
    """The transformers model class called `name` (`BertForMaskedLM`); a ValueError naming close ones if none."""
    import transformers

    try:
        model_class = getattr(transformers, name) if name.isidentifier() else None
    except AttributeError:
        model_class = None
    except Exception as err:  # transformers' lazy import of the class failed (a missing extra, say)
        raise ValueError(f"transformers cannot load {name}: {type(err).__name__}: {err}") from None
    if model_class is None:
        known = [n for n in dir(transformers) if n.endswith(("Model", "LM", "Generation", "Classification"))]
        raise ValueError(f"transformers has no class {name!r}{suggest(name, known)}")
    if not isinstance(model_class, type) or getattr(model_class, "config_class", None) is None:
        raise ValueError(f"transformers.{name} is not a model class with a config")
    return model_class


def resolve_import_path(path: str):
    """`package.module:attribute` -> the attribute; a one-line ValueError when it cannot be found."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{path!r} is not an import path; write it as package.module:factory")
    add_import_root(os.getcwd())  # the `ckrun` script, unlike `python -m`, does not search it by itself
    problem = check_import(module_name)  # a hang, an os._exit or a crash at import, tried in a fork first
    if problem:
        raise ValueError(f"{problem}; ckrun did not import it here")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as err:  # any import-time failure of user code is a bad-input problem
        raise ValueError(f"cannot import {module_name!r}: {type(err).__name__}: {err}; ckrun looks in installed "
                         f"packages, PYTHONPATH, the recipe's folder and the working directory ({', '.join(import_roots())}): "
                         "check the name, or put the module's folder on PYTHONPATH") from None
    if not hasattr(module, attribute):
        names = [n for n in dir(module) if not n.startswith("_")]
        raise ValueError(f"module {module_name!r} has no {attribute!r}{suggest(attribute, names)}")
    return getattr(module, attribute)


class BuildError(KeyedError):
    """The model or data could not be built from the recipe; `key` names the recipe key to change."""


def not_a_module(name: str, value) -> str:
    """What a python factory that returned `value` (None, a tuple, ...) is told."""
    return f"{name} returned {type(value).__name__}, not a torch.nn.Module; return the model it builds"


def check_factory(factory, name: str) -> None:
    """A BuildError unless `factory` can be called (`math:pi` names a float)."""
    if not callable(factory):
        kind = type(factory).__name__
        raise BuildError("model.name", f"{name} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not a function or class; "
                                       "name a factory that returns a torch.nn.Module")


def check_kwargs(factory, given: dict) -> None:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return  # a builtin or C callable: let the call itself complain
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    for key in given:
        if key not in params:
            raise BuildError(f"model.config.{key}", f"{getattr(factory, '__name__', factory)} takes no argument {key!r}{suggest(key, params)}")
