"""The campaign's ``checkpoint-damage`` kind: one file of a finished run's final checkpoint flipped or cut short,
chosen from the trial's seed (the relaunch must fall back to the previous intact checkpoint)."""

from __future__ import annotations

import random
from pathlib import Path

from nanotron_recover.launcher.runs import final_checkpoint

DAMAGED = {  # one file of each kind a checkpoint holds
    "weights": lambda ckpt: sorted((ckpt / "model").rglob("*.safetensors")),
    "optimizer": lambda ckpt: sorted((ckpt / "optimizer").glob("optimizer_*.pt")),
    "lr_scheduler": lambda ckpt: [ckpt / "lr_scheduler" / "lr_scheduler.pt"],
    "trainer_state": lambda ckpt: [ckpt / "trainer_state.json"],
}


def damage_final_checkpoint(run_dir: Path, damage: dict) -> list[str]:
    """Flip 4 KB (or the middle half of a smaller file) or cut to half one file of the final checkpoint, chosen
    from the trial's seed. -> problems (the checkpoint or the file is missing)."""
    rng = random.Random(damage["seed"])
    try:
        files = [f for f in DAMAGED[damage["file"]](final_checkpoint(run_dir)) if f.is_file()]
    except FileNotFoundError as e:
        return [f"no final checkpoint to damage: {e}"]
    if not files:
        return [f"the final checkpoint holds no {damage['file']} file"]
    target = rng.choice(files)
    data = bytearray(target.read_bytes())
    if damage["how"] == "truncate":
        data = data[: len(data) // 2]
    else:
        n = min(4096, len(data) // 2)
        start = rng.randrange(0, len(data) - n + 1)
        data[start:start + n] = bytes(rng.randrange(256) for _ in range(n))
    target.write_bytes(bytes(data))
    return []
