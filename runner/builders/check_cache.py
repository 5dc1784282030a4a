"""Library model checks that passed, kept in the user's cache ($XDG_CACHE_HOME/ckrun/model_checks.json),
so that checking the same model section again imports neither torch nor transformers.

Checking a transformers model means importing its modeling module (4-5 s: transformers pulls in
torch, dynamo and more), building it on the meta device and running a forward on fake tensors;
a torchvision name needs torchvision imported. What that finds depends on nothing but the model
section's source, name and config, the installed torch, transformers, torchvision and
huggingface_hub (whose validators check a config's fields), Python, and ckrun's own check code,
so a pass is kept under a hash of exactly those, with the position table's length that
`position_problems` reads and the vocabulary (size, width, special ids) that `vocab_problems` reads.
A transformers model with model.pretrained is checked with that directory's config.json under
model.config's keys, so its pass is kept under what identifies that config too (`config_origin`): a
Hub model's resolved commit (immutable), a local file's digest. Only a pass is kept: a config that
fails is checked afresh each time, so its message always comes from the code installed now. That
model.pretrained holds weights (files on disk) and python models (the user's code) are not kept:
they are checked every time.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..disk.user_cache import file_digest, key_of, read_table, write_table
from .hub import in_hub_cache

TABLE = "model_checks.json"
CACHED_SOURCES = ("transformers", "torchvision")
# ckrun's code that decides a pass: a change to it (a new check) must not meet passes it never made
_CHECK_CODE = ("checks.py", "model_config.py", "resolve.py", "check_cache.py", "vocab.py", "pretrained.py",
               "adapters.py")
_PACKAGES = ("torch", "transformers", "torchvision", "huggingface_hub")


def passed_before(spec, origin: str | None = None) -> dict | None:
    """What a pass of this model section (with the pretrained config `origin` names) recorded
    ({"max_positions": int | None, "vocab": dict | None}); None if none is kept."""
    key = _key(spec, origin)
    return read_table(TABLE, _is_pass).get(key) if key else None


def remember_pass(spec, max_positions: int | None, vocab: dict | None = None, origin: str | None = None) -> None:
    key = _key(spec, origin)
    if key:
        table = read_table(TABLE, _is_pass)
        table[key] = {"max_positions": max_positions, "vocab": vocab}
        write_table(TABLE, table)


def config_origin(directory: Path | None) -> str | None:
    """What identifies the config.json a transformers model is checked with: `hub <commit>` for a snapshot
    in huggingface_hub's cache (a commit never changes), the file's digest for any other directory; None
    when there is none (no model.pretrained, a checkpoint, a state dict)."""
    config = directory / "config.json" if directory is not None else None
    if config is None or not config.is_file():
        return None
    if in_hub_cache(directory):
        return f"hub {directory.parent.parent.name} {directory.name}"
    try:
        return f"file {file_digest(config)}"
    except OSError:
        return None


def _key(spec, origin: str | None = None) -> str | None:
    if spec.source not in CACHED_SOURCES:
        return None
    section = spec.model_dump(mode="json", include={"source", "name", "config"})
    if spec.lora is not None:  # its target lists are checked against the model with it (checks.py's lora_fits)
        section["lora"] = spec.lora.model_dump(mode="json")
    if origin is not None:
        section["pretrained config"] = origin
    here = Path(__file__).parent
    try:
        code = [file_digest(here / name) for name in _CHECK_CODE]
    except OSError:  # installed without its sources: nothing says which checks a kept pass passed
        return None
    return key_of([json.dumps(section, sort_keys=True), *code], _PACKAGES)


def _is_pass(value) -> bool:
    if not isinstance(value, dict) or set(value) != {"max_positions", "vocab"}:
        return False
    limit, vocab = value["max_positions"], value["vocab"]
    if vocab is not None and not (isinstance(vocab, dict) and isinstance(vocab.get("size"), int)
                                  and isinstance(vocab.get("special"), dict)):
        return False
    return limit is None or (isinstance(limit, int) and not isinstance(limit, bool))
