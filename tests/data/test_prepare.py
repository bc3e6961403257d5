"""prepare-data: datatrove tokenization must equal plain `tokenizers` output, and bad input must fail clearly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from nanotron_recover.data import DatatroveTokenDataset
from nanotron_recover.data.corpus import iter_kjv_documents, kjv_source_path, write_kjv_jsonl
from nanotron_recover.data.prepare import DataPreparationError, prepare_data
from nanotron_recover.data.prepare_cli import main

DOCS = [
    "In the beginning was the word, and the word was with the model.",
    "Fault tolerance means the loss curve does not care which replica died.",
    "Ünïcödé text survives byte-level BPE: naïve café, 東京, emoji 🙂.",
    "Short.",
    "Every iteration commits exactly M microbatches, whoever computes them. " * 5,
]


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def _expected_tokens(tokenizer_file: Path, texts: list[str], eos: str) -> list[list[int]]:
    tok = Tokenizer.from_file(str(tokenizer_file))
    eos_id = tok.token_to_id(eos)
    return [tok.encode(t).ids + [eos_id] for t in texts]


def _read_docs(out: Path) -> list[list[int]]:
    """Split the merged token file back into documents with datatrove's index (uint64 cumulative ends)."""
    (ds,) = sorted(out.glob("*.ds"))
    tokens = np.fromfile(ds, dtype="<u2")
    ends = np.fromfile(str(ds) + ".index", dtype="<u8").astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    return [tokens[s:e].tolist() for s, e in zip(starts, ends)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("prep")
    src = _write_jsonl(root / "corpus.jsonl", [{"text": t, "id": str(i)} for i, t in enumerate(DOCS)])
    out = root / "out"
    prepare_data(src, out, vocab_size=300, shuffle=False, log=None)
    return src, out


def test_tokens_match_tokenizers_and_read_back(prepared: tuple[Path, Path]) -> None:
    _src, out = prepared
    manifest = json.loads((out / "dataset.json").read_text())
    assert manifest["tokenizer_path"] == "tokenizer.json" and (out / "tokenizer.json").is_file()
    assert manifest["dtype"] == "uint16" and manifest["token_size"] == 2
    assert manifest["vocab_size"] == 300 and manifest["num_documents"] == len(DOCS)
    expected = _expected_tokens(out / "tokenizer.json", DOCS, manifest["eos_token"])
    assert _read_docs(out) == expected
    flat = [t for doc in expected for t in doc]
    assert manifest["num_tokens"] == len(flat)

    # read back through the training dataset (file order, no shuffle): windows of seq_len + 1 tokens
    seq = 16
    ds = DatatroveTokenDataset(out, seq, micro_batch_size=1, microbatches_per_step=1, seed=0, shuffle=False)
    assert ds.num_samples == len(flat) // (seq + 1) and ds.vocab_size == 300
    for k in range(ds.num_samples):
        assert ds.sample(k).tolist() == flat[k * (seq + 1) : (k + 1) * (seq + 1)]
        batch = ds.microbatch(k, 0)
        assert batch["input_ids"][0].tolist() == flat[k * (seq + 1) : (k + 1) * (seq + 1) - 1]
        assert batch["label_ids"][0].tolist() == flat[k * (seq + 1) + 1 : (k + 1) * (seq + 1)]


def test_same_layout_as_datatrove_folder_dataset(prepared: tuple[Path, Path]) -> None:
    from datatrove.utils.dataset import DatatroveFolderDataset

    _src, out = prepared
    seq = 8
    ours = DatatroveTokenDataset(out, seq, 1, 1, seed=0, shuffle=False)
    theirs = DatatroveFolderDataset(str(out), seq, filename_pattern="*.ds", token_size=2)
    assert len(theirs) == ours.num_samples
    for k in range(ours.num_samples):
        assert theirs[k]["input_ids"].tolist() == ours.sample(k).tolist()


def test_given_tokenizer_and_shuffle(prepared: tuple[Path, Path], tmp_path: Path) -> None:
    src, out = prepared
    out2 = tmp_path / "out2"
    result = prepare_data(src, out2, tokenizer_path=out / "tokenizer.json", shuffle=True, seed=3, log=None)
    assert not result.tokenizer_trained
    assert (out2 / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    expected = _expected_tokens(out2 / "tokenizer.json", DOCS, result.eos_token or "")
    got = _read_docs(out2)
    assert sorted(got) == sorted(expected)  # same documents, seeded order
    out3 = tmp_path / "out3"
    prepare_data(src, out3, tokenizer_path=out / "tokenizer.json", shuffle=True, seed=3, log=None)
    assert (out3 / "000_tokens.ds").read_bytes() == (out2 / "000_tokens.ds").read_bytes()


def test_txt_folder_and_jsonl_folder(tmp_path: Path) -> None:
    txt = tmp_path / "txt"
    (txt / "sub").mkdir(parents=True)
    (txt / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (txt / "sub" / "b.txt").write_text(DOCS[1], encoding="utf-8")
    lines: list[str] = []
    r = prepare_data(txt, tmp_path / "o1", vocab_size=280, shuffle=False, log=lines.append)
    assert r.num_documents == 2
    assert _read_docs(tmp_path / "o1") == _expected_tokens(tmp_path / "o1" / "tokenizer.json", DOCS[:2], r.eos_token)
    assert [line.split(":")[0] for line in lines] == ["[prepare-data] " + s for s in
                                                      ("source", "tokenizer", "tokenize", "merge", "done")]

    folder = tmp_path / "jsonl"
    folder.mkdir()
    _write_jsonl(folder / "part-0.jsonl", [{"text": DOCS[2]}])
    _write_jsonl(folder / "part-1.jsonl", [{"text": DOCS[3]}, {"text": ""}])
    r = prepare_data(folder, tmp_path / "o2", vocab_size=280, shuffle=False, log=None)
    assert r.num_documents == 2  # the empty document is skipped
    assert _read_docs(tmp_path / "o2") == _expected_tokens(tmp_path / "o2" / "tokenizer.json", DOCS[2:4], r.eos_token)


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "empty corpus"),
        ('{"text": ""}\n\n', "empty corpus"),
        ('{"body": "hello"}\n', "no 'text' field"),
        ('{"text": 3}\n', "not a string"),
        ("not json\n", "not valid JSON"),
        ('["text"]\n', "expected a JSON object"),
    ],
)
def test_bad_input_is_explained(tmp_path: Path, content: str, message: str) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_text(content, encoding="utf-8")
    with pytest.raises(DataPreparationError, match=message):
        prepare_data(src, tmp_path / "out", log=None)
    assert not list((tmp_path / "out").glob("*.ds")) and not (tmp_path / "out" / "_prepare_work").exists()


def test_missing_paths_and_overwrite(prepared: tuple[Path, Path], tmp_path: Path,
                                     capsys: pytest.CaptureFixture) -> None:
    src, out = prepared
    with pytest.raises(DataPreparationError, match="does not exist"):
        prepare_data(tmp_path / "nope.jsonl", tmp_path / "o", log=None)
    with pytest.raises(DataPreparationError, match="tokenizer file .* does not exist"):
        prepare_data(src, tmp_path / "o", tokenizer_path=tmp_path / "missing.json", log=None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataPreparationError, match="no JSONL"):
        prepare_data(tmp_path / "empty", tmp_path / "o", log=None)
    with pytest.raises(DataPreparationError, match="--overwrite"):
        prepare_data(src, out, log=None)
    # the CLI turns bad input into exit code 2 and one clear line
    assert main(["--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o")]) == 2
    assert "prepare-data: error:" in capsys.readouterr().out


def test_default_corpus_kjv(tmp_path: Path) -> None:
    assert kjv_source_path().name == "kjv.jsonl"
    docs = list(iter_kjv_documents())
    assert len(docs) == 1189 and docs[0].startswith("Genesis 1\n\nIn the beginning God created")
    assert write_kjv_jsonl(tmp_path / "kjv.jsonl", group="book") == 66
    assert main(["--output", str(tmp_path / "kjv"), "--vocab-size", "1024"]) == 0
    manifest = json.loads((tmp_path / "kjv" / "dataset.json").read_text())
    assert manifest["vocab_size"] == 1024 and manifest["num_documents"] == 1189
    assert manifest["num_tokens"] > 1_000_000
    ds = DatatroveTokenDataset(tmp_path / "kjv", 128, 2, 4, seed=0)
    ds.check_vocab(1024)
