"""What a local tokenizer directory holds, for the checks that hold it against the model: its size
(`len(tokenizer)`: the ids it can emit) and its special tokens' ids (bos, eos, pad, unk).

A `tokenizer.json` (every fast tokenizer, and what `ckrun tokenizer` writes) is read as JSON, which
takes milliseconds, so `ckrun validate` stays fast; any other directory (a slow tokenizer's
vocab.txt or sentencepiece model) is loaded with transformers' AutoTokenizer, as the run loads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SPECIAL = ("bos", "eos", "pad", "unk")


@dataclass(frozen=True)
class TokenizerFacts:
    size: int
    """`len(tokenizer)`: its vocabulary with the tokens added to it; ids run from 0 to size - 1."""
    special: dict[str, int] = field(default_factory=dict)
    """bos/eos/pad/unk -> id, for those the tokenizer has."""


def tokenizer_facts(directory: str | Path) -> TokenizerFacts:
    """The size and special ids of the tokenizer saved in `directory`; a ValueError when none loads."""
    folder = Path(directory).expanduser()
    if not any(folder.glob("*")):
        raise ValueError(f"{directory} is empty; give a directory saved by tokenizer.save_pretrained, or made by "
                         "`ckrun tokenizer`")
    facts = _from_json(folder)
    return facts if facts is not None else _from_transformers(folder)


def _from_json(folder: Path) -> TokenizerFacts | None:
    """From tokenizer.json and tokenizer_config.json; None when they do not say it plainly."""
    try:
        whole = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        config = _read_json(folder / "tokenizer_config.json") | _read_json(folder / "special_tokens_map.json")
    except (OSError, ValueError):
        return None
    vocab = (whole.get("model") or {}).get("vocab")
    if isinstance(vocab, list):  # Unigram: [piece, score] pairs, the id is the position
        ids = {piece[0]: i for i, piece in enumerate(vocab) if isinstance(piece, list) and piece}
    elif isinstance(vocab, dict):
        ids = dict(vocab)
    else:
        return None
    for added in whole.get("added_tokens") or []:
        ids[added.get("content")] = added.get("id")
    if not ids or not all(isinstance(i, int) for i in ids.values()):
        return None
    special = {}
    for name in SPECIAL:
        token = config.get(f"{name}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token is not None:
            if token not in ids:
                return None  # a special token that is not in the vocabulary: transformers adds it; ask it
            special[name] = ids[token]
    return TokenizerFacts(max(ids.values()) + 1, special)


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}


def _from_transformers(folder: Path) -> TokenizerFacts:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{folder} holds no tokenizer transformers can load ({str(err).splitlines()[0][:160]}); "
                         "give a directory saved by tokenizer.save_pretrained, or made by `ckrun tokenizer`") from None
    special = {name: getattr(tokenizer, f"{name}_token_id") for name in SPECIAL}
    return TokenizerFacts(len(tokenizer), {k: int(v) for k, v in special.items() if isinstance(v, int)})
