"""Library model checks that passed, kept in the user's cache ($XDG_CACHE_HOME/ckrun/model_checks.json),
so that checking the same model section again imports neither torch nor transformers.

Checking a transformers model means importing its modeling module (4-5 s: transformers pulls in
torch, dynamo and more), building it on the meta device and running a forward on fake tensors;
a torchvision name needs torchvision imported. What that finds depends on nothing but the model
section's source, name and config, the installed torch, transformers, torchvision and
huggingface_hub (whose validators check a config's fields), Python, and ckrun's own check code,
so a pass is kept under a hash of exactly those, with the position table's length that
`position_problems` reads and the vocabulary (size, width, special ids) that `vocab_problems` reads. Only a pass is kept: a config that fails is checked afresh each time,
so its message always comes from the code installed now. model.pretrained (files on disk) and
python models (the user's code) are not kept: they are checked every time.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..user_cache import file_digest, key_of, read_table, write_table

TABLE = "model_checks.json"
CACHED_SOURCES = ("transformers", "torchvision")
# ckrun's code that decides a pass: a change to it (a new check) must not meet passes it never made
_CHECK_CODE = ("checks.py", "model_config.py", "resolve.py", "check_cache.py", "vocab.py")
_PACKAGES = ("torch", "transformers", "torchvision", "huggingface_hub")


def passed_before(spec) -> dict | None:
    """What a pass of this model section recorded ({"max_positions": int | None, "vocab": dict | None});
    None if none is kept."""
    key = _key(spec)
    return read_table(TABLE, _is_pass).get(key) if key else None


def remember_pass(spec, max_positions: int | None, vocab: dict | None = None) -> None:
    key = _key(spec)
    if key:
        table = read_table(TABLE, _is_pass)
        table[key] = {"max_positions": max_positions, "vocab": vocab}
        write_table(TABLE, table)


def _key(spec) -> str | None:
    if spec.source not in CACHED_SOURCES:
        return None
    section = spec.model_dump(mode="json", include={"source", "name", "config"})
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
