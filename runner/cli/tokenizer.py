"""`ckrun tokenizer PATHS... --out DIR [--vocab-size N]`: train a byte-level BPE tokenizer (GPT-2's kind)
on local text and save it where `data.tokenizer: DIR` reads it (runner/builders/make_tokenizer.py)."""

from __future__ import annotations

from pathlib import Path

from . import Command


def add_arguments(parser):
    parser.add_argument("paths", nargs="+", help="text files or glob patterns (quote globs: 'corpus/*.txt')")
    parser.add_argument("--out", required=True, metavar="DIR", help="the tokenizer directory to write")
    parser.add_argument("--vocab-size", type=int, default=8192, metavar="N",
                        help="tokens in all: the 256 bytes, 2 special tokens and the merges learnt (default 8192; "
                             "GPT-2 has 50257); set the model's vocab_size to what it prints")
    parser.add_argument("--min-frequency", type=int, default=2, metavar="N",
                        help="a pair is merged only if it occurs at least N times (default 2)")
    parser.add_argument("--force", action="store_true", help="write into DIR even if it holds files")


def run(args) -> int:
    from ..builders.make_tokenizer import check_out, train_tokenizer
    from ..builders.resolve import BuildError
    from ..problems import InputError, Place, Problem

    out = Path(args.out).expanduser()
    try:
        check_out(out, args.force)
        facts = train_tokenizer(args.paths, out, args.vocab_size, args.min_frequency)
    except BuildError as err:  # its key is an argument here, not a recipe's
        raise InputError([Problem(Place("ckrun tokenizer"), err.key, err.message)]) from None
    special = ", ".join(f"{name} {i}" for name, i in facts.special.items())
    print(f"wrote {out}: {facts.size} tokens ({special}); use it with data.tokenizer: {out} and "
          f"model.config.vocab_size: {facts.size}")
    return 0


COMMAND = Command(
    "tokenizer", "train a byte-level BPE tokenizer (GPT-2's kind) on local text for data.tokenizer", add_arguments,
    run, epilog="examples:\n  ckrun tokenizer 'corpus/*.txt' --out tokenizers/mine --vocab-size 8192\n"
    "  then in the recipe:  data: {source: text, paths: [corpus/*.txt], tokenizer: tokenizers/mine}\n"
    "                      model: {config: {vocab_size: 8192, ...}}",
)
