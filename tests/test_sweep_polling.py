"""A sweep trial's Ray Train run starts no helper actor it does not use, and its Tune trial polls less often
than Ray's default (``ray_backend.TrialTrainer``, ``ray_backend._private.poll_less``).

Both reach into private parts of the installed Ray: if an upgrade renames or moves them, these tests fail
instead of trials silently going back to paying for them."""

from __future__ import annotations

import inspect

import pytest

ray = pytest.importorskip("ray")

import ray.train  # noqa: E402
from ray.train._internal import session as train_session  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback  # noqa: E402
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback  # noqa: E402

from nmtcore.sweep import ray_backend  # noqa: E402
from nmtcore.sweep.ray_backend import _private as rb_private  # noqa: E402


def _callbacks(trainer_cls: type, **kwargs: object) -> set[type]:
    trainer = trainer_cls(lambda: None, scaling_config=ray.train.ScalingConfig(num_workers=1), **kwargs)
    return {type(c) for c in trainer._create_default_callbacks()}


def test_a_trial_trainer_drops_the_dataset_manager_and_cleaner_and_keeps_the_rest() -> None:
    ray_default = _callbacks(TorchTrainer)
    assert {DatasetsCallback, PlacementGroupCleanerCallback} <= ray_default  # what there is to drop
    trial = _callbacks(ray_backend.TrialTrainer)
    assert trial == ray_default - {DatasetsCallback, PlacementGroupCleanerCallback}
    # A trainer given Ray datasets keeps the dataset manager that serves them.
    with_data = _callbacks(ray_backend.TrialTrainer, datasets={"train": lambda: None})
    assert with_data == ray_default - {PlacementGroupCleanerCallback}
    # Without Ray's cleaner, the sweep's own cleanup frees a dead controller's reservation: that is
    # tests/test_sweep_recovery.py::test_leaked_worker_reservation_is_removed (slow suite).


@pytest.fixture
def ray_default_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Restore Ray's value after the test (``_poll_less`` changes it for the whole process)."""
    monkeypatch.setattr(train_session, "_RESULT_FETCH_TIMEOUT", train_session._RESULT_FETCH_TIMEOUT)


def test_a_tune_trial_waits_longer_for_each_result(ray_default_wait: None) -> None:
    assert train_session._RESULT_FETCH_TIMEOUT < rb_private.RESULT_POLL_S  # Ray's default: 0.2 s
    rb_private.poll_less()
    assert train_session._RESULT_FETCH_TIMEOUT == rb_private.RESULT_POLL_S
    # Tune's function trainable waits in this method, which reads the module's value at call time.
    assert "_RESULT_FETCH_TIMEOUT" in inspect.getsource(train_session._TrainSession._get_result_from_queues)
