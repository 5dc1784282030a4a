"""What `ckrun validate` checks of a transformers model beyond its keys: that transformers accepts
the config, and that the model can be built from it.

transformers checks types when the config is made (a string for an int), but most shape rules
(`num_attention_heads` must divide `hidden_size`) only when a layer is made. So validation also
builds the model on the meta device and, for token models, runs one forward on fake tensors: no
memory, a fraction of a second for the bundled recipes, once per config. A forward that needs
tensor values (which fake tensors lack) is not held against the config. Layer counts are bounded first, since building a million layers would hang.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
import warnings

import torch

from ..problems import KeyedError

MAX_LAYERS = 1024  # the deepest published models have a few hundred; building is ~5 ms a layer
_LAYER_COUNT = re.compile(r"(^|_)(n_layers?|num_layers|layers|n_layer)$|^num_.*layers$|_layers$")


def check_transformers_config(model_class, given: dict, base: dict | None = None) -> None:
    """A KeyedError naming the model.config key (or model.name) that transformers rejects. `base`: the
    config.json of model.pretrained, which model.config's keys (`given`) change, as from_pretrained does."""
    merged = {**(base or {}), **given}
    config = _make_config(model_class.config_class, merged, given)
    _check_layer_counts(model_class.config_class, config, given)
    problem = _trial_build(model_class, json.dumps(merged, sort_keys=True, default=str))
    if problem:
        verb = "does not run with" if problem.startswith("a forward pass") else "cannot be built from"
        raise KeyedError(("model", *_key_named_in(problem, given)), f"{model_class.__name__} {verb} "
                              f"this config: {problem}")


def max_positions(model_class, given: dict) -> int | None:
    """The longest sequence a transformers model's position table holds (GPT-2's n_positions is
    max_position_embeddings by its attribute_map); None for relative positions such as T5's."""
    with quiet_transformers():
        limit = getattr(model_class.config_class(**given), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def _make_config(config_class, merged: dict, given: dict):
    try:
        return _serialisable_config(config_class, merged)
    except Exception as err:  # transformers raises what it likes: strict-field errors, ValueError, TypeError
        text = " ".join(str(err).split())
        field = re.match(r"Validation error for field '([^']+)': \w+: (.*)", text)
        if field and field.group(1) in given:  # "Field 'hidden_size' expected int, got str (value: '128')"
            detail = re.sub(r"^Field '[^']+' ", "", field.group(2))
            raise KeyedError(("model", "config", field.group(1)), f"{config_class.__name__} {detail}") from None
        text = re.sub(r"^Class validation error for validator '[^']+': \w+: ", "", text)
        key = _key_named_in(text, given)
        if key == ("config",):
            key = _key_failing_alone(config_class, given) or key
        raise KeyedError(("model", *key), f"{config_class.__name__}: {type(err).__name__}: {text}") from None


def _serialisable_config(config_class, given: dict):
    """The config, once transformers can also write it out: some values pass __init__ and fail only in
    to_dict (a dtype of [] raised IndexError there), which every save and fingerprint calls."""
    with quiet_transformers():
        config = config_class(**given)
        config.to_dict()
    return config


def _key_failing_alone(config_class, given: dict) -> tuple[str, str] | None:
    """The first given key whose value alone makes the config fail, for a message that names none."""
    for key, value in given.items():
        try:
            _serialisable_config(config_class, {key: value})
        except Exception:  # noqa: BLE001 -- any failure of this one key is the one to name
            return ("config", key)
    return None


def _check_layer_counts(config_class, config, given: dict) -> None:
    renamed = {value: key for key, value in getattr(config_class, "attribute_map", {}).items()}
    for name, value in config.to_dict().items():
        if isinstance(value, int) and not isinstance(value, bool) and _LAYER_COUNT.search(name):
            if not 0 <= value <= MAX_LAYERS:
                key = name if name in given else renamed.get(name, name)
                raise KeyedError(("model", "config", key), f"{value} is not a layer count ckrun builds; "
                                      f"give 0 to {MAX_LAYERS}")


@functools.lru_cache(maxsize=64)
def _trial_build(model_class, given_json: str) -> str | None:
    """The one-line reason building `model_class` from this config fails, or None when it builds."""
    given = json.loads(given_json)
    try:
        with quiet_transformers(), warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")  # e.g. torch's "zero-element tensors" for a size of 0
            model = model_class(model_class.config_class(**given))
    except Exception as err:  # whatever a model's __init__ trips over is still the config's to fix
        return _one_line(err)
    from .experts import settle_experts

    try:
        settle_experts(model, given, say=False)  # the experts' kernel the run picks: eager where grouped_mm cannot run
    except ValueError as err:  # grouped_mm asked for by name where it cannot run
        return str(err)
    try:
        with quiet_transformers(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _trial_forward(model)
    except _values_unknown():
        return None  # the forward reads tensor values, which the check does not have: training will tell
    except Exception as err:
        return f"a forward pass of 8 tokens fails: {_one_line(err)}"
    return None


def _one_line(err: Exception) -> str:
    text = " ".join(str(err).split())
    return text if isinstance(err, ValueError) else f"{type(err).__name__}: {text}"  # transformers' own checks say it all


def _trial_forward(model) -> None:
    """One forward of 8 tokens on fake tensors: shape rules that only a forward meets (grouped query
    attention whose key/value heads do not divide the heads) fail here rather than at step 1. Only
    for token-input models, whose inputs need nothing from the recipe.

    Fake tensors rather than the meta device: transformers skips its value checks (`pad_token_id in
    input_ids`, an all-ones padding mask) for fake tensors, which it knows as traced ones, but calls
    `.item()` on meta tensors, which have no values (DeBERTa-v2, BART). A mixture-of-experts model's
    grouped expert kernel runs in fp32 as it trains (experts.py: torch's fake kernel alone refuses it)."""
    if getattr(model, "main_input_name", None) != "input_ids":
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .experts import GroupedMmOnFake, experts_modules

    grouped = GroupedMmOnFake() if experts_modules(model) else contextlib.nullcontext()
    with _quiet_fake_kernels(), FakeTensorMode(allow_non_fake_inputs=True) as fake_mode, grouped:
        model = model.to_empty(device="cpu")  # the meta-built weights as fake CPU tensors: nothing allocated
        tokens = fake_mode.from_tensor(torch.zeros(1, 8, dtype=torch.long))
        decoder = {"decoder_input_ids": tokens} if getattr(model.config, "is_encoder_decoder", False) else {}
        model(input_ids=tokens, **decoder)


@contextlib.contextmanager
def _quiet_fake_kernels():
    """torch logs a failing fake kernel with its traceback (ERROR, to stderr) before raising it; the
    check reports the error in one line instead (a position table of 0 printed 30 lines of torch's)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _values_unknown() -> tuple[type[BaseException], ...]:
    """What a forward on fake tensors raises where it needs a value: not the config's fault."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    return (DataDependentOutputException, DynamicOutputShapeException)


def _key_named_in(message: str, given: dict) -> tuple[str, ...]:
    """The given config key a message is about: by name ("The hidden size (130) ..." -> hidden_size,
    longest first), else the one key whose value it quotes ("KeyError: 'gelu2'" -> hidden_act);
    ("config",) when it is none of them, ("name",) when nothing was given."""
    text = message.lower()
    for key in sorted(given, key=len, reverse=True):
        if key.lower() in text or key.lower().replace("_", " ") in text:
            return ("config", key)
    quoting = [key for key, value in given.items() if isinstance(value, (str, int, float)) and not isinstance(value, bool)
               and re.search(rf"(?<![\w.-]){re.escape(str(value).lower())}(?![\w.])", text)]
    if len(quoting) == 1:
        return ("config", quoting[0])
    return ("config",) if given else ("name",)


@contextlib.contextmanager
def quiet_transformers():
    """transformers' warnings about the config go to stderr as multi-line log records; validation
    reports its own one-line problems instead."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
