"""nanotron's mixed-precision recipe on the flat buckets: fp32 accumulation, fp32 masters, bf16 refreshed."""

from __future__ import annotations

import pytest
import torch
from nanotron.optim.named_optimizer import NamedOptimizer
from nanotron.optim.optimizer_from_gradient_accumulator import OptimizerFromGradientAccumulator

from nanotron_recover.nanotron_compat.fp32_accumulator import BucketFP32GradientAccumulator, has_low_precision_params
from nanotron_recover.training.buckets import GradBuckets


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(torch.bfloat16)


def _mixed_precision(model: torch.nn.Module):
    named = list(model.named_parameters())
    buckets = GradBuckets(named, bucket_cap_mb=0.001, device="cpu")
    optimizer = OptimizerFromGradientAccumulator(
        gradient_accumulator_builder=BucketFP32GradientAccumulator,
        named_params_or_groups=named,
        optimizer_builder=lambda groups: NamedOptimizer(
            named_params_or_groups=groups, optimizer_builder=lambda g: torch.optim.AdamW(g, lr=1e-2)
        ),
    )
    return named, buckets, optimizer


def _microbatch(model: torch.nn.Module, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    model(x).float().pow(2).mean().backward()


def test_gradients_accumulate_in_fp32_into_the_buckets_and_the_masters_read_them():
    model = _model()
    twin = _model()  # the same weights: its bf16 gradients, microbatch by microbatch
    named, buckets, optimizer = _mixed_precision(model)
    expected = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in twin.named_parameters()}
    for seed in (1, 2, 3):
        _microbatch(model, seed)
        _microbatch(twin, seed)
        for name, p in twin.named_parameters():
            expected[name] += p.grad.float()  # fp32 sum of each microbatch's bf16 gradient
            p.grad = None
    acc = optimizer.gradient_accumulator
    for name, p in named:
        assert p.grad is None, "the bf16 gradient is folded into main_grad and dropped"
        assert torch.equal(p.main_grad, expected[name])
        assert acc.get_parameter_for_optimizer(name).grad.data_ptr() == p.main_grad.data_ptr()  # no copy
    assert sum(v.numel() for v in buckets.bucket_views()) == sum(p.numel() for _, p in named)


def test_the_step_updates_fp32_masters_and_refreshes_the_bf16_parameters():
    model = _model()
    named, buckets, optimizer = _mixed_precision(model)
    reference = {name: p.detach().float().clone().requires_grad_(True) for name, p in named}
    reference_opt = torch.optim.AdamW(list(reference.values()), lr=1e-2)
    for step in range(3):
        _microbatch(model, 10 + step)
        for name, p in named:
            reference[name].grad = p.main_grad.clone()
        optimizer.step()
        reference_opt.step()
        acc = optimizer.gradient_accumulator
        for name, p in named:
            master = acc.get_parameter_for_optimizer(name)
            assert master.dtype == torch.float32
            assert torch.equal(master, reference[name])  # AdamW on fp32 masters, exactly
            assert torch.equal(p, master.to(torch.bfloat16))  # bf16 copy refreshed from the master
        buckets.zero_()
        acc.bind_master_grads()
        assert all(float(p.main_grad.abs().sum()) == 0.0 for _, p in named)
    # the masters moved by more than bf16 can hold: they are not a bf16 round trip
    assert any(not torch.equal(acc.get_parameter_for_optimizer(n), p.float()) for n, p in named)


def test_the_optimizer_state_carries_the_masters_and_restores_them():
    model = _model()
    named, _, optimizer = _mixed_precision(model)
    _microbatch(model, 5)
    optimizer.step()
    state = optimizer.state_dict()
    assert set(state["gradient_accumulator"]) == {name for name, _ in named}
    fresh_model = _model(seed=1)
    _, _, fresh = _mixed_precision(fresh_model)
    fresh.load_state_dict(state)
    for name, _ in named:
        assert torch.equal(
            fresh.gradient_accumulator.get_parameter_for_optimizer(name),
            optimizer.gradient_accumulator.get_parameter_for_optimizer(name),
        )


def test_optimizer_zero_grad_keeps_masters_bound_to_the_buckets():
    model = _model()
    named, _, optimizer = _mixed_precision(model)
    _microbatch(model, 7)
    optimizer.zero_grad()  # torch drops the masters' .grad; the accumulator binds them again, zeroed
    acc = optimizer.gradient_accumulator
    for name, p in named:
        master = acc.get_parameter_for_optimizer(name)
        assert master.grad is not None and master.grad.data_ptr() == p.main_grad.data_ptr()
        assert float(p.main_grad.abs().sum()) == 0.0


def test_masters_need_low_precision_parameters_laid_into_buckets():
    fp32 = torch.nn.Linear(2, 2)
    assert not has_low_precision_params(fp32.named_parameters())
    with pytest.raises(ValueError, match="already float32"):
        BucketFP32GradientAccumulator(fp32.named_parameters())
    with pytest.raises(ValueError, match="no main_grad"):
        BucketFP32GradientAccumulator(torch.nn.Linear(2, 2).to(torch.bfloat16).named_parameters())
