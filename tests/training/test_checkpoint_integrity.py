"""Checksums of a checkpoint's files and the choice of the newest intact checkpoint, on files made here (one
process, one rank: the agreement's gather is the identity). The real jobs:
tests/training/test_verified_checkpoints.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanotron_recover.training.checkpoint_integrity import (
    FILES_KEY,
    PUBLISHING_MARKER,
    DamagedCheckpoint,
    manifest,
    read_state,
    sealed_state_text,
    verify_share,
)
from nanotron_recover.training.checkpoint_resume import LATEST, ROLLED_BACK_SUFFIX, choose_intact, settle_root


class OneRank:
    """The only resuming rank: it verifies every file and gathers its own findings."""

    def startup_share(self) -> tuple[int, int]:
        return 0, 1

    def gather_at_startup(self, obj):
        return [obj]


def _checkpoint(root: Path, step: int) -> Path:
    folder = root / str(step)
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "w.safetensors").write_bytes(bytes(range(256)) * 64)
    (folder / "optimizer.pt").write_bytes(b"adam" * 1000)
    state = {"step": step, FILES_KEY: manifest(folder)}
    (folder / "trainer_state.json").write_text(sealed_state_text(state))
    return folder


def _flip(path: Path, at: int, n: int = 16) -> None:
    data = bytearray(path.read_bytes())
    data[at:at + n] = bytes(b ^ 0xFF for b in data[at:at + n])
    path.write_bytes(bytes(data))


def test_an_intact_checkpoint_verifies_and_every_kind_of_damage_names_its_file(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, 4)
    state = read_state(folder)
    assert verify_share(folder, state) == []
    weights = folder / "model" / "w.safetensors"
    _flip(weights, 100)
    assert [p.split(":")[0] for p in verify_share(folder, state)] == [str(weights)]
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    assert "bytes, the save wrote" in verify_share(folder, state)[0]
    weights.unlink()
    assert "cannot be read" in verify_share(folder, state)[0]


def test_the_work_is_shared_and_every_file_is_checked_by_exactly_one_rank(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, 2)
    state = read_state(folder)
    for name in state[FILES_KEY]:
        _flip(folder / name, 10)
    found = [verify_share(folder, state, index, 3) for index in range(3)]
    assert sorted(p for share in found for p in share) == sorted(verify_share(folder, state))
    assert len(verify_share(folder, state)) == len(state[FILES_KEY]) == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_damaged_state_file_is_recognized(damage: str, tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, 2)
    path = folder / "trainer_state.json"
    text = path.read_text()
    if damage == "flip":  # still JSON, another step: the seal no longer matches
        path.write_text(text.replace('"step": 2', '"step": 3'))
    elif damage == "truncate":
        path.write_text(text[: len(text) // 2])
    else:
        path.write_bytes(b"\x00" * 64)
    with pytest.raises(DamagedCheckpoint):
        read_state(folder)


def test_the_newest_intact_checkpoint_is_chosen_and_the_damaged_set_aside(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step)
    (tmp_path / LATEST).write_text("6\n")
    _flip(tmp_path / "6" / "optimizer.pt", 2000)
    choice = choose_intact(tmp_path, None, OneRank())
    assert (choice.path, choice.step) == (tmp_path / "4", 4)
    assert len(choice.damaged) == 1 and "6/optimizer.pt" in choice.damaged[0]
    said: list[str] = []
    settle_root(tmp_path, choice, said.append)
    assert (tmp_path / LATEST).read_text().strip() == "4"
    assert not (tmp_path / "6").exists() and (tmp_path / "6.damaged" / "optimizer.pt").is_file()
    assert any("6/optimizer.pt" in line for line in said)


def test_a_published_folder_newer_than_its_pointer_is_adopted_while_it_carries_the_publish_marker(
        tmp_path: Path) -> None:
    """The writer died between renaming 6/ into place and the pointer: its own unfinished publish is adopted, the
    pointer follows and the marker goes (after the pointer: a later rollback by hand must not adopt it again)."""
    for step in (3, 6):
        _checkpoint(tmp_path, step)
    (tmp_path / "6" / PUBLISHING_MARKER).write_text("")
    (tmp_path / LATEST).write_text("3\n")
    choice = choose_intact(tmp_path, None, OneRank())
    assert choice.step == 6 and choice.damaged == [] and choice.rolled_back == []
    settle_root(tmp_path, choice, lambda line: None)
    assert (tmp_path / LATEST).read_text().strip() == "6"
    assert not (tmp_path / "6" / PUBLISHING_MARKER).exists()


def test_a_pointer_moved_back_by_hand_wins_and_the_newer_folders_are_set_aside(tmp_path: Path) -> None:
    """A person set ``latest.txt`` from 6 back to 2 (a loss spike): the run resumes from 2; 4/ and 6/ are renamed
    ``N.rolled-back`` (never deleted) and named in one line; the pointer stays where the person put it."""
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step)
    (tmp_path / LATEST).write_text("2\n")
    choice = choose_intact(tmp_path, None, OneRank())
    assert (choice.path, choice.step, choice.damaged) == (tmp_path / "2", 2, [])
    said: list[str] = []
    settle_root(tmp_path, choice, said.append)
    assert (tmp_path / LATEST).read_text().strip() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", f"4{ROLLED_BACK_SUFFIX}", f"6{ROLLED_BACK_SUFFIX}",
                                                          LATEST]
    named = [line for line in said if "rolled-back" in line]
    assert len(named) == 1 and str(tmp_path / "4") in named[0] and str(tmp_path / "6") in named[0], said


def test_a_rollback_past_an_unfinished_publish_sets_that_aside_too(tmp_path: Path) -> None:
    """6/ still carries the marker (its writer died before the pointer) but 4/ does not: the pointer was moved back
    by a person, past both; neither is adopted."""
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step)
    (tmp_path / "6" / PUBLISHING_MARKER).write_text("")
    (tmp_path / LATEST).write_text("2\n")
    choice = choose_intact(tmp_path, None, OneRank())
    assert choice.step == 2 and sorted(p.name for p in choice.rolled_back) == ["4", "6"]
    settle_root(tmp_path, choice, lambda line: None)
    assert (tmp_path / f"6{ROLLED_BACK_SUFFIX}").is_dir() and (tmp_path / LATEST).read_text().strip() == "2"


def test_with_no_pointer_the_newest_intact_folder_is_taken(tmp_path: Path) -> None:
    for step in (2, 4):
        _checkpoint(tmp_path, step)
    choice = choose_intact(tmp_path, None, OneRank())
    assert choice.step == 4 and choice.rolled_back == []
    settle_root(tmp_path, choice, lambda line: None)
    assert (tmp_path / LATEST).read_text().strip() == "4" and (tmp_path / "2").is_dir()


def test_with_nothing_intact_nothing_is_moved(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 2)
    (tmp_path / LATEST).write_text("2\n")
    (tmp_path / "2" / "model" / "w.safetensors").write_bytes(b"")
    choice = choose_intact(tmp_path, None, OneRank())
    assert choice.path is None and choice.damaged
    settle_root(tmp_path, choice, lambda line: None)
    assert (tmp_path / "2").is_dir() and (tmp_path / LATEST).read_text().strip() == "2"


def test_an_older_checkpoint_without_checksums_is_chosen_unverified(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, 2)
    (folder / "trainer_state.json").write_text(json.dumps({"step": 2}))
    choice = choose_intact(tmp_path, None, OneRank())
    assert choice.step == 2 and choice.unverified
    said: list[str] = []
    settle_root(tmp_path, choice, said.append)
    assert any("no checksums" in line for line in said)


def test_no_checkpoint_at_all_is_a_fresh_start(tmp_path: Path) -> None:
    choice = choose_intact(tmp_path / "checkpoints", None, OneRank())
    assert choice.path is None and choice.damaged == []


class RankBesideAnother:
    """Rank 0 of two; the other rank's listing (its first gather) is given: what it saw under its checkpoints_path."""

    def __init__(self, others_listing: tuple) -> None:
        self.others_listing, self.gathers = others_listing, 0

    def startup_share(self) -> tuple[int, int]:
        return 0, 2

    def gather_at_startup(self, obj):
        self.gathers += 1
        return [obj, self.others_listing if self.gathers == 1 else obj]


def test_ranks_that_list_different_checkpoints_end_the_run_for_a_person_naming_the_difference(tmp_path: Path) -> None:
    """A node-local checkpoints_path: rank 0's node holds 2/ and 4/, the other rank's only 2/. Neither may guess
    (rank 1 cannot read 4/; starting from 2 would drop work silently): exit 2, the difference named."""
    from nanotron_recover.run.exit_codes import EXIT_NEEDS_PERSON, NeedsPerson

    for step in (2, 4):
        _checkpoint(tmp_path, step)
    (tmp_path / LATEST).write_text("4\n")
    with pytest.raises(NeedsPerson, match="rank 1 does not see 4") as raised:
        choose_intact(tmp_path, None, RankBesideAnother(([str(tmp_path / "2")], [], [])))
    assert raised.value.what == "checkpoint listings differ" and EXIT_NEEDS_PERSON == 2
    same = choose_intact(tmp_path, None, RankBesideAnother(([str(tmp_path / "4"), str(tmp_path / "2")], [], [])))
    assert same.step == 4
