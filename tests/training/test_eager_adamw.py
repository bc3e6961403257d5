"""EagerAdamW: torch's AdamW, bit for bit, without importing torch's compiler (each check in a fresh interpreter:
this test process may have imported it already)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHECK = textwrap.dedent("""
    import sys, torch
    from nanotron_recover.training.eager_adamw import EagerAdamW
    if {dynamo_first}:
        import torch._dynamo
    torch.manual_seed(0)
    start = [torch.randn(7, 3) for _ in range(3)]
    grads = [[torch.randn(7, 3) * (i + 1) for _ in start] for i in range(6)]

    def train(cls, **kw):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = cls(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, **kw)
        for i, g in enumerate(grads):
            if i == 3:  # through a checkpoint: the state saved, loaded into a fresh optimizer over the same params
                state = opt.state_dict()
                opt = cls(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, **kw)
                opt.load_state_dict(state)
            for p, x in zip(params, g):
                p.grad = x.clone()
            opt.step()
            opt.zero_grad()
        return params

    for kw in ({{}}, {{"foreach": False}}):
        eager = train(EagerAdamW, **kw)
        imported = "torch._dynamo" in sys.modules
        reference = train(torch.optim.AdamW, **kw)
        same = all(torch.equal(a, b) for a, b in zip(eager, reference))
        print(f"imported={{imported}} same={{same}}")
""")


@pytest.mark.parametrize("dynamo_first", [False, True])
def test_eager_adamw_steps_as_torchs_and_imports_no_compiler(dynamo_first: bool) -> None:
    out = subprocess.run([sys.executable, "-c", CHECK.format(dynamo_first=dynamo_first)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split()
    # multi-tensor and single-tensor paths alike: the same parameters as torch's AdamW after 6 steps and a reload
    assert lines.count("same=True") == 2, out.stdout
    # the compiler is imported only where somebody imported it first (then EagerAdamW leaves torch as it is)
    assert lines[0] == f"imported={dynamo_first}", out.stdout
