"""qkwatch in the Hugging Face ``Trainer``: a callback that watches the run, a Trainer that adds RAA's PAR.

    from transformers import Trainer
    from qkwatch.integrations.huggingface import QKWatchCallback, RAATrainer

    with QKWatchCallback(project="llama", run="r1") as qk:       # a train() that raises: crashed, with the reason
        Trainer(model=model, args=args, train_dataset=data, callbacks=[qk]).train()

``RAATrainer`` in place of ``Trainer`` also adds ``sum_l lambda_l PAR_l`` with the collector's
lambdas to the loss (``qkwatch.raa``). Install with ``pip install 'qkwatch[huggingface]'``.

The parts: ``callback`` (:class:`QKWatchCallback`, and how it follows the Trainer's events),
``tracker_logs`` (qkwatch's per-layer values in the Trainer's logs, for every ``report_to`` target),
``process_hooks`` (what closes a run left open by an uncaught exception or the process's exit),
``raa_trainer`` (:class:`RAATrainer`), ``config_fields`` (:func:`run_config`: the run's config from
``TrainingArguments`` and the model's config) and ``logs`` (:func:`scalars`: the numbers of the
Trainer's logs by :func:`metric_name`).
"""

from __future__ import annotations

try:  # here, before any part loads, so that a missing extra is named whichever part is imported
    import accelerate.utils  # type: ignore[import-untyped]  # noqa: F401  # no py.typed
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError as exc:
    raise ImportError(
        f"qkwatch.integrations.huggingface needs transformers and accelerate ({exc}); "
        "install them with: pip install 'qkwatch[huggingface]'"
    ) from exc

from qkwatch.integrations.huggingface.callback import QKWatchCallback
from qkwatch.integrations.huggingface.config_fields import run_config
from qkwatch.integrations.huggingface.logs import metric_name, scalars
from qkwatch.integrations.huggingface.raa_trainer import RAATrainer

__all__ = ["QKWatchCallback", "RAATrainer", "metric_name", "run_config", "scalars"]
