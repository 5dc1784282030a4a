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
from pathlib import Path

from .resolve import BuildError
from .tokenizer_facts import TokenizerFacts, tokenizer_facts

END, PAD = "<|endoftext|>", "<pad>"
BYTES = 256


def text_files(patterns: list[str]) -> list[Path]:
    files = sorted({Path(f) for pattern in patterns for f in glob.glob(str(Path(pattern).expanduser()), recursive=True)})
    files = [f for f in files if f.is_file()]
    if not files:
        raise BuildError("paths", f"no files match {', '.join(patterns)}")
    return files


def train_tokenizer(patterns: list[str], directory: Path, vocab_size: int, min_frequency: int = 2) -> TokenizerFacts:
    """Train on the files `patterns` match and save to `directory`; what the saved tokenizer holds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < BYTES + 2:
        raise BuildError("--vocab-size", f"a byte-level tokenizer needs at least {BYTES + 2} tokens (the 256 bytes "
                                         f"and 2 special tokens) but got {vocab_size}")
    files = text_files(patterns)
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
    _save(tokenizer, directory)
    return tokenizer_facts(directory)


def _save(tokenizer, directory: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=END, eos_token=END, unk_token=END,
                                      pad_token=PAD)
    directory.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(directory))
