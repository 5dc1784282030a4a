"""What a recipe is checked for after its schema: what only its named classes, files and code can tell.

The schema (runner/recipe/) checks a recipe's shape and values without importing torch,
transformers or the user's code. The rest is checked here, once, by every verb that loads a
recipe to use it (`load_checked`: validate, show, run, estimate, tune): that a transformers class
exists, takes the config's keys and builds from them on the meta device (runner/builders/model_config.py,
one forward on fake tensors for token models), that a sequence fits its position table, that a
torchvision builder exists, that a python factory imports and takes model.config's arguments,
that eval.metrics name functions, that model.pretrained can hold the model's weights, that a
dataset's files, split and columns are there, and that a tensor-parallel plan fits the model
(runner/builders/tensor_plan.py). Every problem is one line at its key's line, all at
once, beside the schema's own: a section the schema refused is not checked deeper. A library
model's pass is kept in the user's cache (check_cache.py): checking it again imports nothing heavy.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from ..recipe.load import AcrossSections, read_document, validate_document
from ..problems import InputError, KeyedError, Problem, suggest
from ..recipe.recipe import ModelSpec, Recipe, infer_task
from ..recipe.eval import EvalSpec
from ..recipe.data import Data
from ..plan.strategies import TensorParallel
from ..recipe.yamlio import Document
from .check_cache import config_origin, passed_before, remember_pass
from .data_checks import local_data_problems
from .hub import in_hub_cache
from .resolve import check_factory, check_kwargs, not_a_module, resolve_import_path, transformers_class


def load_checked(path: str | Path, overrides: list[str] = (), user_code: bool = True,
                 build_own: bool = False) -> tuple[Recipe, Document]:
    """The recipe and its document, or an InputError with every problem of the schema and of the checks
    after it. `user_code=False` imports none of the user's code (a python model's factory, eval.metrics):
    `ckrun tune` has its model child check those (`user_code_problems`). `build_own`: call a python
    model's factory on the meta device too (`ckrun validate`; a run builds the model right after, and
    a factory's side effects would happen twice)."""
    doc = read_document(path, overrides)
    try:
        recipe = validate_document(doc)
    except InputError as err:
        deeper = _section_problems(doc, err.problems, user_code)
        if isinstance(err, AcrossSections) and deeper:  # as pydantic does: a section's own problems come first
            raise InputError(deeper) from None
        raise InputError(_ordered([*err.problems, *deeper])) from None
    problems = deep_problems(recipe, doc, user_code, build_own)
    if problems:
        raise InputError(problems)
    return recipe, doc


def deep_problems(recipe: Recipe, doc: Document | None = None, user_code: bool = True,
                  build_own: bool = False) -> list[Problem]:
    """Every problem the checks after the schema find, at its line in `doc` (the key alone without one)."""
    task = recipe.data.task or infer_task(recipe.model)
    found = [*_section_checks("model", recipe.model, user_code), *_section_checks("data", recipe.data, user_code, task)]
    if recipe.eval is not None:
        found += _section_checks("eval", recipe.eval, user_code, task)
    if not found and user_code and build_own:  # on the meta device, once its factory imports and takes its config
        found = own_model_problems(recipe)
    if not found:  # positions, vocabulary and a tensor-parallel plan: only once the model is known to build
        found = position_problems(recipe) + tokenizer_problems(recipe)
        if isinstance(recipe.distributed, TensorParallel):  # its check builds the model: torch only then
            from .tensor_plan import recipe_problems

            found += recipe_problems(recipe, user_code)
    return _placed(found, doc)


def user_code_problems(recipe: Recipe) -> list[KeyedError]:
    """What only importing the user's code tells: a python model's factory and arguments, eval.metrics."""
    return [*_factory_problems(recipe.model), *(metrics_problems(recipe.eval.metrics) if recipe.eval else [])]


def model_problems(spec: ModelSpec) -> list[KeyedError]:
    """A library model's class and config (a python model's code is `user_code_problems`), and model.pretrained:
    a Hub name is found in huggingface_hub's cache (fetched where the Hub is reachable: the config alone for a
    transformers model), and a transformers model is checked with that config under model.config's keys."""
    directory, located = _pretrained_located(spec)
    found = _library_model_problems(spec, directory)
    if directory is not None:
        from .pretrained import check_pretrained_dir

        name = None if any(p.key == "model.name" for p in found) else spec.name  # as far as the name is known
        located += _caught("model.pretrained", check_pretrained_dir, directory, spec.source, name)
    return found + located


def _pretrained_located(spec: ModelSpec) -> tuple[Path | None, list[KeyedError]]:
    """model.pretrained's directory (a Hub model's snapshot), or the line why there is none."""
    if spec.pretrained is None:
        return None, []
    from .pretrained import pretrained_directory  # torch: only for a recipe that reads weights

    try:
        directory = pretrained_directory(spec, weights=False)
    except ValueError as err:
        return None, [KeyedError("model.pretrained", str(err))]
    if spec.revision is not None and directory is not None and directory.exists() and not in_hub_cache(directory):
        return directory, [KeyedError("model.revision", f"{spec.pretrained} is a local directory, which has no Hub "
                                      "revisions; remove model.revision, or name a Hub model (org/name)")]
    return directory, []


def _library_model_problems(spec: ModelSpec, directory: Path | None = None) -> list[KeyedError]:
    """A transformers or torchvision model's problems; a pass is kept in the user's cache (check_cache.py),
    so the same model section is not imported and built again (seconds) by the next command. A
    transformers model with model.pretrained is checked with the directory's config.json under model.config,
    and kept under what identifies that config (a Hub model's commit, a local file's digest)."""
    checks = {"transformers": _transformers_fits, "torchvision": _torchvision_fits}
    origin = config_origin(directory) if spec.source == "transformers" else None
    if spec.source not in checks or passed_before(spec, origin) is not None:
        return []
    found = _caught("model.name", checks[spec.source], spec, directory)
    if not found:
        transformers = spec.source == "transformers"
        remember_pass(spec, _max_positions(spec, directory) if transformers else None,
                      _vocab(spec, directory) if transformers else None, origin)
    return found


def data_problems(data, key: str, task: str | None = None) -> list[KeyedError]:
    """A dataset's files, split and columns, read from their schemas (no torch, no rows read); text,
    records and image folders as far as their first lines tell (data_checks.py). `task`: the model's,
    when the data section does not name one."""
    task = getattr(data, "task", None) or task
    if not data.schema_checked:
        return local_data_problems(data, key, task)
    from .dataset_files import check_column, check_paths, check_split

    found = _caught(f"{key}.paths", check_paths, data.paths)
    if found:
        return found
    found = _caught(f"{key}.split", check_split, data.paths, data.split)
    split = None if found else data.split
    for field in ("input_field", "target_field"):
        if field == "input_field" or task in ("seq2seq", "sequence_classification"):
            found += _caught(f"{key}.{field}", check_column, data.paths, split, getattr(data, field))
    return found


def metrics_problems(paths: list[str]) -> list[KeyedError]:
    """The first of eval.metrics that is not a function of the user's: imported to tell."""
    for index, path in enumerate(paths):
        try:
            function = resolve_import_path(path)
        except ValueError as err:
            return [KeyedError(("eval", "metrics", index), str(err))]
        name = path.partition(":")[2]
        if not callable(function) or name in ("loss", "perplexity", "accuracy", "samples", "time_s"):
            why = "is not a function" if not callable(function) else "has the name of one of the evaluation's own"
            return [KeyedError(("eval", "metrics", index), f"{path} {why}; name a function "
                               "metric(predictions, labels) -> number or dict")]
    return []


def position_problems(recipe: Recipe) -> list[KeyedError]:
    """A sequence past a transformers model's position table would index out of range at the first step."""
    if recipe.model.source != "transformers":
        return []
    directory = _pretrained_located(recipe.model)[0]  # found before: model_problems passed
    kept = passed_before(recipe.model, config_origin(directory))  # kept with the pass that model_problems made
    limit = kept["max_positions"] if kept is not None else _max_positions(recipe.model, directory)
    for key, data in [("data", recipe.data), ("eval.data", recipe.eval.data if recipe.eval else None)]:
        seq_len = getattr(data, "seq_len", None)
        if limit is not None and seq_len is not None and seq_len > limit:
            return [KeyedError(f"{key}.seq_len", f"{seq_len} tokens exceed {recipe.model.name}'s {limit} "
                               f"positions (max_position_embeddings); give seq_len <= {limit}")]
    return []


def tokenizer_problems(recipe: Recipe) -> list[KeyedError]:
    """data.tokenizer against the model's vocabulary and special ids (runner/builders/vocab.py)."""
    if not any(getattr(d, "tokenizer", None) for d in (recipe.data, recipe.eval.data if recipe.eval else None)):
        return []
    from .vocab import vocab_problems

    vocab = None
    if recipe.model.source == "transformers":
        directory = _pretrained_located(recipe.model)[0]  # found before: model_problems passed
        kept = passed_before(recipe.model, config_origin(directory))
        vocab = kept["vocab"] if kept is not None else _vocab(recipe.model, directory)
    return vocab_problems(recipe, vocab)


def _vocab(spec: ModelSpec, directory: Path | None = None) -> dict | None:
    from .vocab import model_vocab

    return model_vocab(transformers_class(spec.name), {**_config_of(directory), **spec.config})


def _max_positions(spec: ModelSpec, directory: Path | None = None) -> int | None:
    from .model_config import max_positions

    return max_positions(transformers_class(spec.name), {**_config_of(directory), **spec.config})


# --- one check each --------------------------------------------------------------------------


def _config_of(directory: Path | None) -> dict:
    if directory is None:
        return {}
    from .pretrained import config_of

    return config_of(directory)


def _transformers_fits(spec: ModelSpec, directory: Path | None = None) -> None:
    model_class = transformers_class(spec.name)
    try:
        check_config_keys(model_class.config_class, spec.config)
        from .model_config import check_transformers_config

        check_transformers_config(model_class, spec.config, _config_of(directory))
    except KeyedError:
        raise
    except ValueError as err:
        raise KeyedError("model.config", str(err)) from None
    lora_fits(spec)


# transformers' public implementation switches, which every config takes (PreTrainedConfig pops them from
# its keyword arguments, so no signature or to_dict() names them); their values are checked as the model is built
IMPLEMENTATION_KEYWORDS = ("attn_implementation", "experts_implementation")


def check_config_keys(config_class, given: dict) -> None:
    # transformers configs keep unknown kwargs as attributes, so a typo would be silently ignored
    known = set(config_class().to_dict()) | set(IMPLEMENTATION_KEYWORDS)
    for base in config_class.__mro__:  # base-class settings such as num_labels reach __init__ via **kwargs
        if "__init__" in vars(base):
            known |= set(inspect.signature(base.__init__).parameters)
    known |= set(getattr(config_class, "attribute_map", {}))
    known |= {name for name, attr in inspect.getmembers(config_class) if isinstance(attr, property) and attr.fset}
    unknown = [key for key in given if key not in known]
    if unknown:
        raise KeyedError(("model", "config", unknown[0]),
                         f"{config_class.__name__} has no setting {unknown[0]!r}{suggest(unknown[0], known)}")


def _torchvision_fits(spec: ModelSpec, directory: Path | None = None) -> None:
    import torchvision

    known = torchvision.models.list_models()
    if spec.name not in known:
        raise ValueError(f"no torchvision model named {spec.name!r}{suggest(spec.name, known)}")
    lora_fits(spec)


def lora_fits(spec: ModelSpec) -> None:
    """model.lora's target lists against the model they adapt: the model built on the meta device (nothing
    allocated, no weights read) and wrapped by peft as the run wraps it, so a target_modules or
    modules_to_save entry that matches no layer, or an architecture peft has no default targets for, is
    the run's own line at validate. Kept with the model's pass (check_cache.py keys it on model.lora)."""
    if spec.lora is None:
        return
    from .model import build_model

    build_model(spec, "meta", weights=False)


def _factory_problems(spec: ModelSpec) -> list[KeyedError]:
    return _caught("model.name", _factory_fits, spec) if spec.source == "python" else []


def _factory_fits(spec: ModelSpec) -> None:
    """That a python factory imports and can be called with model.config, from its signature (it is not called)."""
    factory = resolve_import_path(spec.name)
    check_factory(factory, spec.name)
    check_kwargs(factory, spec.config)


def own_model_problems(recipe: Recipe) -> list[KeyedError]:
    """A python model's factory called on the meta device (nothing allocated), when its module imports
    torch itself (so validate imports nothing it did not): what it returns must be a module with
    something to train, and a language model needs a vocabulary (data.vocab_size, or a config or
    attribute of that name), as the run's build requires. What the factory raises there may be the
    meta device's doing (a .item()), so that is left to the run."""
    if recipe.model.source != "python" or "torch" not in sys.modules:
        return []
    import torch

    from .contract import adopt_user_model
    from .sources import describe_inputs
    from .user_code import Overdue, UserExit, bounded

    spec = recipe.model
    try:
        with torch.device("meta"), bounded(f"{spec.name} to build the model"):
            model = resolve_import_path(spec.name)(**spec.config)
    except Overdue as err:
        return [KeyedError("model.name", str(err))]
    except (Exception, SystemExit, UserExit):
        return []
    if not isinstance(model, torch.nn.Module):
        return [KeyedError("model.name", not_a_module(spec.name, model))]
    found = [*_caught("model.name", adopt_user_model, model, spec.name), *_caught("data.vocab_size", describe_inputs,
                                                                                   recipe, model)]
    return found or own_lora_problems(model, spec)


def own_lora_problems(model, spec: ModelSpec) -> list[KeyedError]:
    """A python model's model.lora target lists, on the model its factory built on the meta device (`lora_fits`)."""
    if spec.lora is None:
        return []
    from .adapters import apply_lora

    return _caught("model.lora", apply_lora, model, spec, False)


def _caught(key: str, check: Callable, *args) -> list[KeyedError]:
    """The problem `check(*args)` raises, at its own key or at `key`; none when it passes."""
    try:
        check(*args)
    except KeyedError as err:
        return [err]
    except ValueError as err:
        return [KeyedError(key, str(err))]
    return []


# --- the schema's problems and these together ------------------------------------------------

_SECTIONS = {"model": TypeAdapter(ModelSpec), "data": TypeAdapter(Data), "eval": TypeAdapter(EvalSpec)}


def _section_problems(doc: Document, known: list[Problem], user_code: bool) -> list[Problem]:
    """The checks after the schema for each section the schema found nothing wrong with, so a recipe's
    problems come at once even where the schema refused another section."""
    if not isinstance(doc.data, dict):
        return []
    found = []
    for key, adapter in _SECTIONS.items():
        if doc.data.get(key) is None or any(p.key == key or p.key.startswith(f"{key}.") for p in known):
            continue
        try:
            spec = adapter.validate_python(doc.data[key])
        except ValidationError:
            continue
        found += _section_checks(key, spec, user_code)
    return _placed(found, doc)


def _section_checks(key: str, spec, user_code: bool, task: str | None = None) -> list[KeyedError]:
    """The checks after the schema of one section: model, data or eval (`task`: the model's, when known)."""
    if key == "model":
        return [*model_problems(spec), *(_factory_problems(spec) if user_code else [])]
    if key == "data":
        return data_problems(spec, "data", task)
    held_out = data_problems(spec.data, "eval.data", task) if spec.data is not None else []
    return held_out + (metrics_problems(spec.metrics) if user_code else [])


def _placed(found: list[KeyedError], doc: Document | None) -> list[Problem]:
    if doc is None:
        return [problem for err in found for problem in err.problems]
    return _ordered(Problem(doc.place_of(err.path), err.key, err.message) for err in found)


def _ordered(problems) -> list[Problem]:
    return sorted(dict.fromkeys(problems), key=lambda p: (p.place.line, p.key))
