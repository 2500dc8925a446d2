"""`meshplan ops MODULE:FACTORY` and `meshplan.list_ops`: every op with its rule source and FLOP share."""

from __future__ import annotations

import warnings

import pytest
import torch

import meshplan
from meshplan.cli import main
from meshplan.models import gpt_small


def test_ops_lists_every_op_with_source_and_share(capsys):
    assert main(["ops", "meshplan.models:gpt_small", "--mesh", "2x2", "--views"]) == 0
    out = capsys.readouterr().out
    model, inputs = gpt_small()
    report = meshplan.list_ops(model, inputs, mesh_shape=(2, 2))
    assert out.startswith(f"GPT: {len(report.ops)} ops on mesh 2x2")
    assert len(out.strip().splitlines()) == len(report.ops) + 3  # title, header, one line per op, totals
    assert "scaled_dot_product_attention" in out and " meshplan " in out and " dtensor " in out
    assert abs(sum(o.share for o in report.ops) - 1.0) < 1e-9
    assert report.fallbacks() == [] and "fallback" not in report.by_source()


def test_ops_min_share_keeps_the_heavy_ops(capsys):
    assert main(["ops", "meshplan.models:gpt_small", "--min-share", "0.05"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()[2:-1]
    assert lines and all(float(line.split()[3]) >= 5.0 for line in lines)


@torch.library.custom_op("meshplan_test::ops_square", mutates_args=())
def square(x: torch.Tensor) -> torch.Tensor:
    """An op no sharding rule knows."""
    return x * x


@square.register_fake
def _(x):
    return torch.empty_like(x)


class NoRule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return square(self.fc(x))


def test_a_fallback_is_named_with_its_share():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = meshplan.list_ops(NoRule(), (torch.randn(4, 8),), mesh_shape=(2,))
    falls = report.fallbacks()
    assert [o.target for o in falls] == ["meshplan_test.ops_square.default"] and not falls[0].sharded
    assert falls[0].share == 32 / (2 * 4 * 8 * 8 + 32)  # numel of [4, 8] next to the linear's 2*M*K*N
    assert report.replicated_over(0.01) == falls and "fallback" in report.format()


def test_bad_mesh_is_a_value_error():
    model, inputs = gpt_small()
    with pytest.raises(ValueError, match=r"mesh_shape must be a tuple of positive ints .* got \(0,\)"):
        meshplan.list_ops(model, inputs, mesh_shape=(0,))
    assert main(["ops", "meshplan.models:gpt_small", "--min-share", "2"]) == 2
