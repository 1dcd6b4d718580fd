"""polar as TRL's asynchronous rollout worker: ``AsyncGRPOTrainer(rollout_worker=..., weight_transfer=...)``.

``PolarRolloutWorker`` runs ``polar rollout`` batches and hands TRL the captured tokens; ``PolarWeightTransfer`` turns
each weight sync into a checkpoint the worker's engine serves next. ``run_trainer_on_cpu`` lets TRL's trainer run
without a GPU (tests, the CPU example). See ``examples/trl_async_grpo.py`` and docs/how-to/trl-async.md.
"""

from polar_cli.trl_async.cpu_attention import run_trainer_on_cpu
from polar_cli.trl_async.weights import PolarWeightTransfer
from polar_cli.trl_async.worker import PolarRolloutWorker, PolarWorkerConfig

__all__ = ["PolarRolloutWorker", "PolarWeightTransfer", "PolarWorkerConfig", "run_trainer_on_cpu"]
