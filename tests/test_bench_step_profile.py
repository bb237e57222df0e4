"""bench/step_profile.py's arithmetic: a matrix product's operations from the shapes the profiler records, and
the profile's two tables (operators by own time, matrix products by shape with their rates)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def step_profile():
    spec = importlib.util.spec_from_file_location("bench_step_profile", BENCH / "step_profile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_a_matrix_products_operations_come_from_its_shapes(step_profile):
    assert step_profile.matmul_flops("aten::mm", [[4095, 256], [256, 8000]]) == 2 * 4095 * 256 * 8000
    assert step_profile.matmul_flops("aten::addmm", [[1024], [4095, 256], [256, 1024]]) == 2 * 4095 * 256 * 1024
    assert step_profile.matmul_flops("aten::bmm", [[64, 20, 64], [64, 64, 20]]) == 2 * 64 * 20 * 64 * 20
    with pytest.raises(ValueError, match="not a matrix product"):
        step_profile.matmul_flops("aten::add", [[2], [2]])


def test_the_profile_adds_each_operator_over_its_shapes_and_rates_each_product(step_profile):
    def event(key, us, count, shapes):
        return SimpleNamespace(key=key, self_cpu_time_total=us, count=count, input_shapes=shapes)

    events = [event("aten::mm", 2_000_000, 4, [[1000, 500], [500, 1000]]),  # 4 GFLOP in 2 s
              event("aten::mm", 1_000_000, 1, [[100, 100], [100, 100]]),
              event("aten::copy_", 1_500_000, 300, [[10], [10]]),
              event("aten::bmm", 0, 2, [[1, 2, 2], [1, 2, 2]])]  # no time: no rate
    ops, products = step_profile.summarize(events)
    assert [(r.name, r.seconds, r.calls) for r in ops] == [("aten::mm", 3.0, 5), ("aten::copy_", 1.5, 300),
                                                           ("aten::bmm", 0.0, 2)]
    assert [r.shapes for r in products] == ["[[1000, 500], [500, 1000]]", "[[100, 100], [100, 100]]"]
    assert products[0].gflops == pytest.approx(2.0)
    assert products[1].gflops == pytest.approx(0.002)


def test_the_loop_measurement_trains_the_same_updates_each_way(step_profile, tmp_path):
    """``--loop``: the fitted trainer (either prefetch depth) and the bare steps train the same number of updates,
    each from a new trainer; the time outside the steps is the loop's own (next to nothing for the bare steps)."""
    import math

    from nmtcore.data import prepare_data
    from nmtcore.testing.synthetic import tiny_experiment

    base = tiny_experiment(tmp_path / "tiny")
    fake = SimpleNamespace(experiment=lambda args, name, lr, warmup, updates, precision: base.with_overrides(
        {"train.max_updates": updates, "train.max_epochs": 100, "train.precision": precision}))
    args = SimpleNamespace(loop_updates=12)
    data = prepare_data(base.data)
    figures = {way: step_profile.loop_round(args, fake, "fp32", data, way, tmp_path / str(i))
               for i, way in enumerate(step_profile.LOOP_WAYS)}
    for way, fig in figures.items():
        assert fig["updates"] == 12 and fig["tgt_tok_per_s"] > 0 and math.isfinite(fig["step_ms_median"]), way
    assert 0.0 <= figures["bare steps"]["outside_steps_s"] < 0.05  # the loop around the steps only
    assert figures["fit, prefetch 1"]["outside_steps_s"] >= 0.0
