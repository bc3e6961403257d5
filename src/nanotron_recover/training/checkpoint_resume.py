"""Which checkpoint a (re)launch resumes from: the newest *intact* one, the same on every rank.

Candidates are the published folders of the run's checkpoint root, newest first, whatever ``latest.txt`` says: a
writer that died between publishing ``N/`` and writing the pointer left a complete checkpoint that the relaunch
adopts (verified first) instead of replaying its steps and never reaching the pointer. Each candidate is verified
(:mod:`nanotron_recover.training.checkpoint_integrity`), the work shared among the ranks and the findings gathered, so
that every rank takes the same decision. A damaged one is reported with the files that are wrong and set aside
(renamed ``N.damaged``, kept for a person to look at) once an intact one was found; the next one is tried. If a
checkpoint existed and none is intact, nothing is moved and the caller ends the job for a person (unless a newer
node-local snapshot takes over): every later launch meets the same damage instead of silently starting over.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from nanotron_recover.run.run_folder import LATEST_FILE, latest_step, write_atomically
from nanotron_recover.training.checkpoint_integrity import (
    STATE_FILE,
    DamagedCheckpoint,
    is_verifiable,
    read_state,
    verify_share,
)

LATEST = LATEST_FILE
DAMAGED_SUFFIX = ".damaged"


class StartupPeers(Protocol):
    """The ranks that resume together (the strategy): who checks which share, and a gather of small objects."""

    def startup_share(self) -> tuple[int, int]: ...

    def gather_at_startup(self, obj: Any) -> list: ...


@dataclass
class ResumeChoice:
    """The checkpoint to load (None: none intact, or none at all), what was wrong with the newer ones, and
    whether the choice carries no checksums (written before they existed)."""

    path: Path | None = None
    step: int | None = None
    damaged: list[str] = field(default_factory=list)
    set_aside: list[Path] = field(default_factory=list)
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


def candidates(root: Path, resume_path: Path | None) -> tuple[list[Path], list[str]]:
    """(checkpoint folders to try, newest first; problems of the pointer). An explicit ``resume_path`` is a
    checkpoint folder or a root holding numbered ones; the run's own ``root`` offers every published folder."""
    if resume_path is not None:
        found = numbered_checkpoints(resume_path)
        if (resume_path / STATE_FILE).is_file():
            return [resume_path], []
        if not found and resolve_checkpoint(resume_path) is None:
            raise FileNotFoundError(f"checkpoints.resume_checkpoint_path: no checkpoint at {resume_path}")
        return found, []
    found = numbered_checkpoints(root)
    pointer = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    problems = []
    if pointer is not None and not any(p.name == pointer for p in found):
        problems.append(f"{root / LATEST} names {root / pointer}, which is not a complete checkpoint")
    return found, problems


def choose_intact(root: Path, resume_path: Path | None, peers: StartupPeers) -> ResumeChoice:
    """Collective: the newest candidate whose files all match their checksums on every rank's share."""
    found, problems = candidates(root, resume_path)
    choice = ResumeChoice(damaged=list(problems))
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
    """One rank, after the agreement: say what was found, set damaged folders of the run's own root aside, and
    point ``latest.txt`` at the choice (a folder adopted past the pointer, or an older intact one)."""
    for line in choice.damaged:
        say(f"damaged checkpoint: {line}")
    for folder in choice.set_aside if choice.path is not None else []:  # with no fallback they stay, for a person
        if folder.parent == root:
            target = _free_name(folder.with_name(folder.name + DAMAGED_SUFFIX))
            os.replace(folder, target)
            say(f"set {folder} aside as {target.name} (kept for a person to look at)")
    if choice.path is None or choice.path.parent != root:
        return
    pointer = latest_step(root)
    if pointer != choice.step:
        write_atomically(root / LATEST, f"{choice.step}\n", durable=True)
        how = "adopted (its pointer was never written)" if pointer is None or pointer < int(choice.step or 0) \
            else "the newest intact one"
        say(f"latest.txt now names step {choice.step} ({how}; it named {pointer})")
    if choice.unverified:
        say(f"checkpoint {choice.path} has no checksums (saved by an older version): loaded without verification")


def _free_name(path: Path) -> Path:
    n, candidate = 1, path
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}{n}")
    return candidate
