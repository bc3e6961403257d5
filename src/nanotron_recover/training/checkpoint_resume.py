"""Which checkpoint a (re)launch resumes from: the newest *intact* one at or below ``latest.txt``, the same on every
rank.

**The pointer decides**, with one exception. The publisher writes a marker (:data:`PUBLISHING_MARKER`) into its
temporary folder before renaming it to ``N/`` and removes it once ``latest.txt`` names ``N``. A folder newer than the
pointer that still carries the marker is the writer's own unfinished publish (it died between the rename and the
pointer): it is adopted, verified first, instead of replaying its steps and never reaching the pointer. A folder
newer than the pointer without it means a person moved the pointer back (e.g. from 20 to 10 after a loss spike):
the pointer wins, and every folder newer than it (marked ones too) is set aside as ``N.rolled-back``, never deleted,
named in one line. With no ``latest.txt`` the newest intact folder is taken.

Each candidate is verified (:mod:`nanotron_recover.training.checkpoint_integrity`), the work shared among the ranks
and the findings gathered, so that every rank takes the same decision. A damaged one is reported with the files that
are wrong and set aside (renamed ``N.damaged``, kept for a person to look at) once an intact one was found; the next
one is tried. If a checkpoint existed and none is intact, no damaged one is moved and the caller ends the job for a
person (unless a newer node-local snapshot takes over): every later launch meets the same damage instead of silently
starting over.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from nanotron_recover.run import fence
from nanotron_recover.run.exit_codes import NeedsPerson
from nanotron_recover.run.run_folder import LATEST_FILE, fsync_dir, latest_step, write_atomically
from nanotron_recover.training.checkpoint_integrity import (
    PUBLISHING_MARKER,
    STATE_FILE,
    DamagedCheckpoint,
    is_verifiable,
    read_state,
    verify_share,
)

LATEST = LATEST_FILE
DAMAGED_SUFFIX = ".damaged"
ROLLED_BACK_SUFFIX = ".rolled-back"


class StartupPeers(Protocol):
    """The ranks that resume together (the strategy): who checks which share, and a gather of small objects."""

    def startup_share(self) -> tuple[int, int]: ...

    def gather_at_startup(self, obj: Any) -> list: ...


@dataclass
class ResumeChoice:
    """The checkpoint to load (None: none intact, or none at all), what was wrong with the newer ones, the folders
    past a pointer moved back by hand, and whether the choice carries no checksums (written before they existed)."""

    path: Path | None = None
    step: int | None = None
    damaged: list[str] = field(default_factory=list)
    set_aside: list[Path] = field(default_factory=list)
    rolled_back: list[Path] = field(default_factory=list)
    unverified: bool = False


def resolve_checkpoint(path: Path) -> Path | None:
    """A checkpoint folder, or a folder holding ``latest.txt`` -> the checkpoint it names (None if none).

    A ``latest.txt`` that names no complete checkpoint is an error: silently starting from step 0 would lose data.
    """
    if (path / LATEST).is_file():
        named = path / (path / LATEST).read_text().strip()
        if not (named / STATE_FILE).is_file():
            raise FileNotFoundError(f"{path / LATEST} names {named}, which is not a complete checkpoint")
        return named
    return path if (path / STATE_FILE).is_file() else None


def numbered_checkpoints(root: Path) -> list[Path]:
    """The published checkpoint folders under ``root`` (named by their step, holding a state file), newest first."""
    if not Path(root).is_dir():
        return []
    found = [p for p in Path(root).iterdir() if p.name.isdigit() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name), reverse=True)


def candidates(root: Path, resume_path: Path | None) -> tuple[list[Path], list[str], list[Path]]:
    """(checkpoint folders to try, newest first; problems of the pointer; folders past a pointer moved back by
    hand). An explicit ``resume_path`` is a checkpoint folder or a root holding numbered ones; the run's own
    ``root`` offers the folders at or below ``latest.txt``, and the newer ones only while they all carry the publish
    marker (see the module's doc)."""
    if resume_path is not None:
        found = numbered_checkpoints(resume_path)
        if (resume_path / STATE_FILE).is_file():
            return [resume_path], [], []
        if not found and resolve_checkpoint(resume_path) is None:
            raise FileNotFoundError(f"checkpoints.resume_checkpoint_path: no checkpoint at {resume_path}")
        return found, [], []
    found = numbered_checkpoints(root)
    pointer = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    problems = []
    if pointer is not None and not any(p.name == pointer for p in found):
        problems.append(f"{root / LATEST} names {root / pointer}, which is not a complete checkpoint")
    rolled_back = past_the_pointer(root, found)
    return [p for p in found if p not in rolled_back], problems, rolled_back


def past_the_pointer(root: Path, found: list[Path]) -> list[Path]:
    """The folders of ``found`` that a pointer moved back by hand dropped: every one newer than ``latest.txt`` once
    any of them lacks the publish marker (none: no pointer, or only the writer's own unfinished publish)."""
    pointer = latest_step(root)
    past = [p for p in found if pointer is not None and int(p.name) > pointer]
    return past if any(not is_publishing(p) for p in past) else []


def is_publishing(folder: Path) -> bool:
    return (folder / PUBLISHING_MARKER).exists()


def choose_intact(root: Path, resume_path: Path | None, peers: StartupPeers) -> ResumeChoice:
    """Collective: the newest candidate whose files all match their checksums on every rank's share.

    The ranks first agree on what they listed (one gather, whatever was found: every rank has listed the root before
    one of them settles it, renaming folders). Each rank reads its share of a candidate from its own view of the
    folder, so a candidate some rank does not see cannot be verified, nor loaded there: where the listings differ
    (a node-local ``checkpoints_path``, a file system's attribute cache, a writer still at work), no rank guesses:
    every rank raises the same :class:`NeedsPerson` (exit 2), naming the difference."""
    found, problems, rolled_back = candidates(root, resume_path)
    listings = peers.gather_at_startup(([str(p) for p in found], sorted(p.name for p in rolled_back), problems))
    differ = _differences([set(names) for names, _, _ in listings])
    if differ:
        raise NeedsPerson("checkpoint listings differ",
                          f"the ranks do not see the same checkpoints under {resume_path or root}: {differ} "
                          "(checkpoints_path must be one folder every node sees: a shared file system)")
    listed = {name for _, names, _ in listings for name in names}
    rolled_back = sorted((root / name for name in listed), key=lambda p: int(p.name), reverse=True)
    choice = ResumeChoice(damaged=sorted({line for _, _, lines in listings for line in lines}),
                          rolled_back=rolled_back)
    index, count = peers.startup_share()
    for folder in found:
        try:
            state = read_state(folder)
            mine = verify_share(folder, state, index, count)
        except DamagedCheckpoint as e:
            state, mine = {}, [str(e)]
        everyone = sorted({line for lines in peers.gather_at_startup(mine) for line in lines})
        if not everyone:
            choice.path, choice.step, choice.unverified = folder, int(state["step"]), not is_verifiable(state)
            return choice
        choice.damaged.extend(everyone)
        choice.set_aside.append(folder)
    return choice


def settle_root(root: Path, choice: ResumeChoice, say: Callable[[str], None]) -> None:
    """One rank, after the agreement: say what was found, set folders of the run's own root aside (rolled back by
    hand: always; damaged: once an intact one was found), point ``latest.txt`` at the choice (a folder adopted past
    the pointer, or an older intact one), and then clear the publish markers up to it."""
    fence.guard("the checkpoints' pointer")
    for line in choice.damaged:
        say(f"damaged checkpoint: {line}")
    _set_aside_rolled_back(root, choice.rolled_back, say)
    for folder in choice.set_aside if choice.path is not None else []:  # with no fallback they stay, for a person
        if folder.parent == root:
            target = set_aside(folder, DAMAGED_SUFFIX)
            say(f"set {folder} aside as {target.name} (kept for a person to look at)")
    if choice.path is None or choice.path.parent != root:
        return
    pointer = latest_step(root)
    if pointer != choice.step:
        write_atomically(root / LATEST, f"{choice.step}\n", durable=True)
        how = "adopted (its pointer was never written)" if pointer is None or pointer < int(choice.step or 0) \
            else "the newest intact one"
        say(f"latest.txt now names step {choice.step} ({how}; it named {pointer})")
    unmark_published(root, int(choice.step or 0))
    if choice.unverified:
        say(f"checkpoint {choice.path} has no checksums (saved by an older version): loaded without verification")


def _set_aside_rolled_back(root: Path, folders: list[Path], say: Callable[[str], None]) -> None:
    moved = [(folder, set_aside(folder, ROLLED_BACK_SUFFIX)) for folder in folders if folder.parent == root]
    if moved:
        say(f"{root / LATEST} names step {latest_step(root)}, moved back by hand: the newer checkpoints "
            f"{', '.join(f'{old} (now {new.name})' for old, new in moved)} are set aside, not resumed (kept)")


def set_aside(folder: Path, suffix: str) -> Path:
    """Rename ``folder`` to ``<name><suffix>`` (``2``, ``3``, ... appended if taken); never deletes anything."""
    target = _free_name(folder.with_name(folder.name + suffix))
    os.replace(folder, target)
    return target


def unmark_published(root: Path, step: int) -> None:
    """Once ``latest.txt`` names ``step``, the publishes of it and of every older folder are finished: their markers
    go (durably), so that a pointer moved back by hand later never mistakes one of them for an unfinished publish."""
    for folder in numbered_checkpoints(root):
        if int(folder.name) <= step and is_publishing(folder):
            (folder / PUBLISHING_MARKER).unlink(missing_ok=True)
            fsync_dir(folder)


def _free_name(path: Path) -> Path:
    n, candidate = 1, path
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}{n}")
    return candidate


def _differences(listings: list[set[str]]) -> str:
    """'' when every rank listed the same folders; else which ranks lack which folders (the first few)."""
    everywhere = set.intersection(*listings) if listings else set()
    missing = [(rank, sorted(set.union(*listings) - names)) for rank, names in enumerate(listings)
               if names != set.union(*listings)]
    if not missing:
        return ""
    shown = "; ".join(f"rank {rank} does not see {', '.join(Path(m).name for m in names[:3])}"
                      for rank, names in missing[:4])
    more = f" (and {len(missing) - 4} more ranks)" if len(missing) > 4 else ""
    return f"{shown}{more}; all of them see {len(everywhere)}"
