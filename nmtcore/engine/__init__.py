"""Training: losses, optimiser, phases, warm starts, the model-agnostic trainer, one experiment end to end."""

from nmtcore.engine.experiment import (
           RunSummary,
           TestScore,
           WarmStartSummary,
           build_trainer,
           run_experiment,
           setup_torch,
)
from nmtcore.engine.shared_phases import PhaseShare, SharedStart
from nmtcore.engine.trainer import (
           Callback,
           FitResult,
           NonFiniteLossError,
           Trainer,
           TrainState,
)
from nmtcore.engine.warm_start import WarmStart, warm_start

__all__ = ["Callback", "FitResult", "NonFiniteLossError", "PhaseShare", "RunSummary", "SharedStart", "TestScore",
           "TrainState", "Trainer", "WarmStart", "WarmStartSummary", "build_trainer", "run_experiment", "setup_torch",
           "warm_start"]
