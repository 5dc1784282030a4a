"""A tokenizer held against the model it feeds: vocabulary size and special tokens (issue 36).

- A model vocabulary smaller than the tokenizer's is an error (one line, exit 2): the first id past
  it would index out of the embedding at the first step (`IndexError: index out of range in self`).
- A larger one trains, but the rows past the tokenizer's ids are never used: a warning names both
  sizes and what they cost (weights, gradients and AdamW state). The model is not resized: the
  config says its size outright, and a size padded up to a multiple of 64 or 128 is a deliberate
  speed-up (nanoGPT's 50304 for GPT-2's 50257), so only a vocabulary past that padding is named.
- Special tokens: an id the model config sets (bos, eos, pad) outside the tokenizer's vocabulary is
  an error; one that differs from the tokenizer's is a warning (generation would stop, or pad, at
  another token than the text has). Ids the config leaves out are taken from the tokenizer in the
  exported config.json (runner/train/output/export.py).

The model's side comes from its transformers config (kept with the check cache's pass, so a second
validate imports nothing), or for a python model from data.vocab_size when set; a python model that
gives its size only as an attribute is checked when the run builds it (`check_built_vocab`).
"""

from __future__ import annotations

import logging

from ..problems import KeyedError
from .tokenizer_facts import TokenizerFacts, tokenizer_facts

log = logging.getLogger(__name__)

PADDING = 128  # a vocabulary rounded up to this multiple is padding, not waste
ADAMW_BYTES = 16  # fp32 weight, gradient and AdamW's two moments, per parameter
MODEL_SPECIAL = ("bos", "eos", "pad")


def model_vocab(model_class, given: dict) -> dict | None:
    """What a transformers config says of its vocabulary: size, embedding width, tied head, special ids."""
    from .model_config import quiet_transformers

    with quiet_transformers():
        config = model_class.config_class(**given)
    size = getattr(config, "vocab_size", None)
    if not isinstance(size, int) or isinstance(size, bool):
        return None
    width = next((getattr(config, name) for name in ("hidden_size", "n_embd", "d_model", "dim")
                  if isinstance(getattr(config, name, None), int)), None)
    special = {name: getattr(config, f"{name}_token_id", None) for name in MODEL_SPECIAL}
    return {"size": size, "width": width, "tied": bool(getattr(config, "tie_word_embeddings", True)),
            "special": {name: value for name, value in special.items() if isinstance(value, int)}}


def vocab_problems(recipe, vocab: dict | None, warn: bool = True) -> list[KeyedError]:
    """The tokenizer of data (and eval.data) against the model's vocabulary `vocab` (`model_vocab`, or
    None: a python model's size comes from data.vocab_size when set); warnings are logged, each once (data and
    eval.data with the same tokenizer meet the same one)."""
    found, warnings = [], []
    for key, data in [("data", recipe.data), ("eval.data", recipe.eval.data if recipe.eval else None)]:
        directory = getattr(data, "tokenizer", None)
        if directory is None:
            continue
        try:
            tokens = tokenizer_facts(directory)
        except ValueError as err:
            found.append(KeyedError(f"{key}.tokenizer", str(err)))
            continue
        size_key, size = _model_size(recipe, data, key, vocab)
        if size is not None:
            found += _size_problems(tokens, size, size_key, key, directory, vocab, warnings)
        if vocab is not None:
            found += _special_problems(tokens, vocab, recipe.model.config, key, warnings)
    for warning in dict.fromkeys(warnings) if warn else ():
        log.warning(warning)
    return found


def _model_size(recipe, data, key: str, vocab: dict | None) -> tuple[str, int | None]:
    if getattr(data, "vocab_size", None) is not None:
        return f"{key}.vocab_size", data.vocab_size
    if vocab is not None:
        return "model.config.vocab_size", vocab["size"]
    return "", None  # a python model's own attribute: the run checks it (check_built_vocab)


def _size_problems(tokens: TokenizerFacts, size: int, size_key: str, key: str, directory: str, vocab: dict | None,
                   warnings: list[str]) -> list[KeyedError]:
    if size < tokens.size:
        where = size_key if size_key in ("model.config.vocab_size", f"{key}.vocab_size") else f"{key}.tokenizer"
        return [KeyedError(where, f"the model's vocabulary has {size} ids but the tokenizer {directory} has "
                                  f"{tokens.size} tokens: ids from {size} on would index past the embedding at the first "
                                  f"step; set {size_key} to {tokens.size} (or more)")]
    padded = -(-tokens.size // PADDING) * PADDING
    if size > padded:
        warnings.append(f"{size_key}: the model's vocabulary has {size} ids but the tokenizer {directory} has "
                        f"{tokens.size} tokens: {size - tokens.size} rows are never used{_cost(size - tokens.size, vocab)}; "
                        f"set {size_key}: {tokens.size} (or {padded}, padded to a multiple of {PADDING})")
    return []


def _cost(rows: int, vocab: dict | None) -> str:
    if not vocab or not vocab.get("width"):
        return ""
    from ..units import format_bytes

    parameters = rows * vocab["width"] * (1 if vocab["tied"] else 2)
    head = "" if vocab["tied"] else ", the embedding's and the untied head's"
    count = f"{parameters / 1e6:.1f}M" if parameters >= 100_000 else f"{parameters:,}"  # never "0.0M"
    return (f" ({count} parameters{head}: {format_bytes(parameters * ADAMW_BYTES)} of fp32 weights, "
            f"gradients and AdamW state, and logits {rows} wider for every token)")


def _special_problems(tokens: TokenizerFacts, vocab: dict, given: dict, key: str,
                      warnings: list[str]) -> list[KeyedError]:
    """Ids the recipe's model.config sets; the config class's defaults (GPT-2's 50256) are replaced at export."""
    found = []
    for name in MODEL_SPECIAL:
        setting = f"{name}_token_id"
        if setting not in given or not isinstance(given[setting], int):
            continue
        ours, theirs = given[setting], tokens.special.get(name)
        fix = f"set it to {theirs}, the tokenizer's {name} token" if theirs is not None else "leave it out"
        if not 0 <= ours < tokens.size:
            found.append(KeyedError(("model", "config", setting), f"{ours} is not a token of the tokenizer "
                                    f"({tokens.size} tokens, {key}.tokenizer); {fix}"))
        elif theirs is not None and ours != theirs:
            verb = "stop" if name == "eos" else "pad" if name == "pad" else "start"
            warnings.append(f"model.config.{setting}: {ours}, but the tokenizer's {name} token is {theirs}: generation "
                            f"would {verb} at another token than the text has; {fix}")
    return found


def check_built_vocab(data, vocab: int) -> None:
    """The run's check, once the model is built and its vocabulary known (a python model's attribute too)."""
    directory = getattr(data, "tokenizer", None)
    if directory is None:
        return
    from .resolve import BuildError

    try:
        size = tokenizer_facts(directory).size
    except ValueError as err:
        raise BuildError("data.tokenizer", str(err)) from None
    if vocab < size:
        where = "data.vocab_size" if getattr(data, "vocab_size", None) is not None else "data.tokenizer"
        raise BuildError(where, f"the model's vocabulary has {vocab} ids but the tokenizer {directory} has {size} "
                                f"tokens: ids from {vocab} on would index past the embedding; give the model a "
                                f"vocabulary of {size} (data.vocab_size, or its own vocab_size)")
