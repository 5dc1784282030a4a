"""A tokenizer trained on local text (`ckrun tokenizer`): byte-level BPE, as GPT-2's, trained by the
`tokenizers` library and saved as a transformers tokenizer directory, which `data.tokenizer`,
`AutoTokenizer.from_pretrained` and ckrun's export all read.

Byte-level BPE starts from the 256 byte values, so any text encodes (no unknown token is ever
needed); it merges the most frequent pairs until the vocabulary has `vocab_size` tokens. Two special
tokens come first: `<|endoftext|>` (id 0: GPT-2's end of text, also its bos and unk) and `<pad>`
(id 1, so padding is never confused with the end of text). ckrun's text data ends each document
(each line with `split: lines`) with the end token, so a causal LM learns where text ends and
`generate` stops there.
"""

from __future__ import annotations

import glob
import os
import stat
from pathlib import Path

from .resolve import BuildError
from .tokenizer_facts import TokenizerFacts, tokenizer_facts

END, PAD = "<|endoftext|>", "<pad>"
BYTES = 256
MAX_IDS = 2**31 - 1  # token ids are int32 in the tokenizers library and the models that read them


def text_files(patterns: list[str]) -> list[Path]:
    """The regular files `patterns` name or match. A path named outright that is a directory, and anything
    named or matched that is no regular file (a FIFO or a device would be read without end, /dev/zero for
    ever), is a one-line BuildError saying what it is; a directory a wildcard matches is passed over."""
    files: set[Path] = set()
    for pattern in patterns:
        matched = False
        for found in glob.glob(str(Path(pattern).expanduser()), recursive=True):
            kind = path_kind(Path(found))
            if kind == "file":
                files.add(Path(found))
                matched = True
            elif kind != "directory" or not glob.has_magic(pattern):
                raise BuildError("paths", f"{found} is {described(kind)}, not a text file; " + (
                    f"give the files in it ('{found}/*.txt', or '{found}/**/*.txt' with its folders)"
                    if kind == "directory" else "give regular files of text"))
        if not matched:  # one name mistyped among several would leave its file out unsaid
            others = f" (one of {len(patterns)} paths: fix or remove it)" if len(patterns) > 1 else ""
            raise BuildError("paths", f"no files match {pattern}{others}")
    return sorted(files)


def path_kind(path: Path) -> str:
    """"file", "directory", or what else `path` is, in words (its link followed)."""
    try:
        mode = path.stat().st_mode
    except OSError as err:
        return "a link to nothing" if path.is_symlink() else f"unreadable ({err.strerror or err})"
    kinds = [(stat.S_ISREG, "file"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def described(kind: str) -> str:
    return {"file": "a file", "directory": "a directory"}.get(kind, kind)


def train_tokenizer(patterns: list[str], directory: Path, vocab_size: int, min_frequency: int = 2) -> TokenizerFacts:
    """Train on the files `patterns` match and save to `directory`; what the saved tokenizer holds. A corpus
    that cannot give `vocab_size` tokens (too little text: an empty one gives the 258 it starts from) is a
    BuildError saying the size it can give, and nothing is written."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if not BYTES + 2 <= vocab_size <= MAX_IDS:
        raise BuildError("--vocab-size", f"a byte-level tokenizer needs at least {BYTES + 2} tokens (the 256 bytes "
                                         f"and 2 special tokens) and at most {MAX_IDS:,} but got {vocab_size}")
    if not 1 <= min_frequency <= MAX_IDS:
        raise BuildError("--min-frequency", f"a pair is merged when it occurs at least N times: give N from 1 to "
                                            f"{MAX_IDS:,}, not {min_frequency}")
    files = text_files(patterns)
    size = sum(f.stat().st_size for f in files)
    if size == 0:
        raise BuildError("paths", f"{_named(files, 'holds', 'hold')} no text (0 bytes); give files with the text to "
                                  "learn from")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[END, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    try:
        tokenizer.train([str(f) for f in files], trainer)
    except Exception as err:  # the library's own errors (a file that is not UTF-8) are one line here
        raise BuildError("paths", f"cannot train on {', '.join(str(f) for f in files[:3])}: {err}") from None
    _check_reached(tokenizer.get_vocab_size(), vocab_size, min_frequency, files, size)
    _save(tokenizer, directory)
    return tokenizer_facts(directory)


def _check_reached(reached: int, wanted: int, min_frequency: int, files: list[Path], size: int) -> None:
    """The tokenizer has every token asked for: BPE stops early when no pair occurs often enough to merge."""
    if reached >= wanted:
        return
    rarer = f", a lower --min-frequency (now {min_frequency})" if min_frequency > 1 else ""
    raise BuildError("--vocab-size", f"{_named(files, 'gives', 'give')} {reached} tokens, not {wanted} ({size:,} "
                     f"bytes of text, where no more pairs occur {min_frequency}+ times); give more text{rarer}, or "
                     f"--vocab-size {reached}")


def _named(files: list[Path], one: str, many: str) -> str:
    """The files as a sentence's subject, with its verb: `a.txt holds`, `the 3 files (a.txt, ...) hold`."""
    return f"{files[0]} {one}" if len(files) == 1 else f"the {len(files)} files ({files[0]}, ...) {many}"


def _save(tokenizer, directory: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=END, eos_token=END, unk_token=END,
                                      pad_token=PAD)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        wrapped.save_pretrained(str(directory))
    except OSError as err:  # the folder's checks passed: what is left is the machine's (a full disk, permissions)
        raise BuildError("--out", f"cannot write {directory}: {err.strerror or err}") from None


def check_out(directory: Path, force: bool) -> None:
    """A BuildError at --out unless `directory` can take the tokenizer, found before any training: an empty or
    absent folder (one holding files with `force`), under a folder that exists or can be made and written."""
    kind = path_kind(directory) if os.path.lexists(directory) else None
    if kind is not None and kind != "directory":
        raise BuildError("--out", f"{directory} is {described(kind)}, not a directory; give a directory to write the tokenizer "
                                  "into")
    if kind == "directory":
        if not force and any(directory.iterdir()):
            raise BuildError("--out", f"{directory} holds files already; give another directory or --force")
        writable = directory
    else:
        writable = next(parent for parent in directory.absolute().parents if os.path.lexists(parent))
        parent_kind = path_kind(writable)
        if parent_kind != "directory":
            raise BuildError("--out", f"cannot make {directory}: {writable} is {described(parent_kind)}, not a directory")
    if not os.access(writable, os.W_OK | os.X_OK):
        raise BuildError("--out", f"cannot write into {writable} (no permission); give another directory")
