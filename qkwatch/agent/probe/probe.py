"""Hooks that measure each layer on report steps, reducing at capture time.

Nothing is kept but per-layer (and optionally per-head) scalars, as device tensors: no
activation outlives its hook, and nothing is copied to the host here (the agent stacks every
scalar of a report and copies it once). Between report steps the hooks return at once: no
device work, no synchronisation.

On the CPU (``measure_thread``, default on) a hook copies only the rows it samples and hands them
to a worker thread, ``qkwatch-measure``; at the forward's last owned layer every layer's rows go
in one batched call (one per shape), computed while the step runs on, and the report collects the
results when it is packed. Weights go to the same thread as copies. The values are those the hook
would compute; on a GPU the hooks only queue kernels and compute in place.

Under ``torch.compile`` the hooks trace as no-ops except for one opaque custom op per layer
(``qkwatch::tap``): the graph keeps it without a break or a guard, and at run time it hands the
real queries and keys to the same measurement.

A report's weights are those its activations ran with: they are read when the step is armed,
before its forward (``agent.probe.weights``; sharded ones in a forward pre-hook, where FSDP2 has
them unsharded, so no extra all-gather is needed). Each rank measures only the layers it owns
(``layer % world == rank``), so a rank pays about 1/world of the cost. Activations come from the
site's tap, the queries and keys of the whole micro-batch and the mask the model attended under;
which rows are read, and how padding is left out, is ``agent.probe.activations``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from qkwatch.agent.checks import SettingError, positive_ints
from qkwatch.agent.models.sites import Scoring, Site, TapFn
from qkwatch.agent.probe.activations import ACTIVATION_HEAD_METRICS, Inputs, Sampler
from qkwatch.agent.probe.compiled_tap import register_tap, sink, unregister_tap
from qkwatch.agent.probe.plan import Capture, Measured, Plan
from qkwatch.agent.probe.weights import WeightReading, sharded

logger = logging.getLogger(__name__)

__all__ = ["ACTIVATION_HEAD_METRICS", "Capture", "Plan", "Probe", "ProbeConfig"]


@dataclass
class ProbeConfig:
    """What the probe samples on a report step (the cadence of report steps is the agent's)."""

    sample_rows: int = 64
    """Query rows per layer for the attention row statistics, spread over ``sample_seqs`` sequences
    (``qk_erank`` takes this many from the first sequence)."""
    sample_seqs: int = 4
    """Sequences of the micro-batch the row statistics average over (at most the batch). One
    sequence makes the entropy the schedule reads swing with what that sequence is (prose, code, a
    synthetic task): on the trained collapse_cpu model, over 40 batches, one sequence gives a
    healthy layer's entropy a standard deviation of 0.04-0.07 (jumps of up to 0.38 between two
    batches), four give 0.025-0.038 with 16 rows each and 0.023-0.030 with 64: the noise is in
    the sequence, not the row, so the rows are spread and the cost stays that of 64 rows."""
    spectrum_window: int = 256
    """W: ``attn_srank`` and ``attn_gap1`` are those of the attention matrix of the first W tokens
    of one sequence (``W x W`` per head; causal, it is exactly the leading block of the full one)."""
    pr_rows: int = 4096
    """Rows (positions of the whole micro-batch, evenly strided) for ``pr_q`` and ``pr_k``; at least
    2. Few rows bias the participation ratio low: isotropic width 256 reads about 50 from 64 rows,
    241 from 4,096."""
    heads: bool = False
    """Also ship per-head values of the per-head metrics."""
    measure_thread: bool = True
    """CPU tensors: the activation hook copies the rows it samples (a few hundred KiB a layer), the
    step's arming copies the W_Q, W_K of the layers whose weights changed (under FSDP2 the weight
    hook copies the layer's unsharded ones), and a worker thread (``qkwatch-measure``) computes the
    metrics while the step runs on; the report waits for them when it is packed (the next step's
    ``step()`` call). The values are those the training thread would compute. On a GPU the hooks
    only queue kernels and this setting changes nothing."""

    def __post_init__(self) -> None:
        positive_ints(self, "sample_rows", "sample_seqs", "spectrum_window")
        if not isinstance(self.pr_rows, int) or self.pr_rows < 2:
            raise SettingError("pr_rows", f"pr_rows must be an integer >= 2, got {self.pr_rows!r}")

    def build(self, sites: list[Site], owned: set[int]) -> Probe:
        """A probe hooked into ``sites``, measuring the layers in ``owned``."""
        return Probe(
            sites,
            owned,
            sample_rows=self.sample_rows,
            sample_seqs=self.sample_seqs,
            heads=self.heads,
            pr_rows=self.pr_rows,
            spectrum_window=self.spectrum_window,
            measure_thread=self.measure_thread,
        )


class Probe(WeightReading):
    """Hooks on the owned layers of ``sites`` that measure them on the steps a :class:`Plan` arms."""

    def __init__(
        self,
        sites: list[Site],
        owned: set[int],
        *,
        sample_rows: int,
        heads: bool,
        sample_seqs: int = 1,
        pr_rows: int = 4096,
        spectrum_window: int = 256,
        measure_thread: bool = False,
    ):
        self.sites = sites
        self.owned = owned
        self.sampler = Sampler(sample_rows, sample_seqs, spectrum_window, pr_rows, heads)
        self.heads = heads
        self.measure_thread = measure_thread
        self._worker: ThreadPoolExecutor | None = None
        self._pending: list[tuple[list[Site], str, Future[list[Measured]]]] = []
        self._queued: list[tuple[Site, Inputs]] = []  # activation rows not handed over yet
        self._tapped = sum(1 for site in sites if site.layer in owned)
        self.plan: Plan | None = None
        self.capture = Capture()
        self._removers: list[Callable[[], object]] = []  # what they return is ignored
        self._warned: set[str] = set()
        # layer -> (version key of its weights when they were measured, what was measured)
        self._weights_cache: dict[int, tuple[tuple[object, ...], Measured]] = {}
        self._weights_queued: dict[int, tuple[object, ...] | None] = {}  # layer -> its version, measuring
        self._hooked: set[int] | None = None
        """Layers whose weight pre-hook ran at the last weight report (sharded); None before the first."""
        # Sharded weights (FSDP2's DTensors) are whole only inside the forward: read them there.
        # Plain ones are read at the report, every layer in one batched call.
        self.in_forward = any(sharded(p) for site in sites for p in site.module.parameters())
        for site in sites:
            if self.in_forward:
                # every layer gets the pre-hook (it only notes that the forward ran there, unless
                # owned): whether a layer's forward was seen is then the same on every rank
                handle = site.module.register_forward_pre_hook(self._weights_hook(site))
                self._removers.append(handle.remove)
            if site.layer in owned:
                self._removers.append(site.install_tap(self._activation_hook(site)))

    def arm(self, plan: Plan) -> None:
        """Arm the hooks for ``plan``'s step and, when its weights are due, read them now.

        Called before the step's forward (``Agent.step``): the weights are those the forward will run
        with, the optimizer step before it applied and its own not yet.
        """
        self.plan = plan if plan.any else None
        self.capture = Capture()
        if plan.weights:
            self._read_weights(plan)

    def disarm(self) -> Capture:
        """The capture of the armed step, with the worker thread's measurements (waited for)."""
        if self.plan is not None and self.plan.weights and self.in_forward:
            if self._hooked is None:  # the first weight report: a layer no pre-hook read (a compiled
                # forward) is read now, after the update (once; later reports read it at arm)
                self._read_sharded([s for s in self.sites if s.layer not in self.capture.forward_seen], self.plan)
            self._hooked = set(self.capture.forward_seen)  # the same on every rank (see _weights_hook)
        self._collect()
        capture, self.capture, self.plan = self.capture, Capture(), None
        return capture

    def close(self) -> None:
        for remove in self._removers:
            remove()
        self._removers.clear()
        self.plan = None
        self._collect()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def _collect(self) -> None:
        """Store what the worker thread measured, in the order the layers were handed to it."""
        self._hand_over_activations()  # layers whose forward ran but not every layer's (a fast path)
        pending, self._pending = self._pending, []
        for sites, what, future in pending:
            try:
                results = future.result()
            except Exception as exc:
                if what == "activations":
                    self.capture.activations_seen.difference_update(s.layer for s in sites)  # added when handed over
                for site in sites:
                    self._weights_queued.pop(site.layer, None)
                self._warn(sites[0], what, exc)
                continue
            for site, measured in zip(sites, results, strict=True):
                if what == "weights":
                    self._keep_weights(site, measured, self._weights_queued.pop(site.layer, None))
                else:
                    self._store(site.layer, *measured)

    # --- the activation hook ------------------------------------------------------------------

    def _activation_hook(self, site: Site) -> TapFn:
        def wanted() -> bool:
            """A report armed for activations and this layer not measured yet (the adapter's tap asks
            before it cuts q and k out of a fused output; see adapters.TapFn)."""
            plan = self.plan
            return plan is not None and plan.activations and site.layer not in self.capture.activations_seen

        def measure(
            q: Tensor,
            k: Tensor,
            mask: Tensor | None = None,
            causal: bool | None = None,
            scoring: Scoring | None = None,
        ) -> None:
            if not wanted():
                return
            submit = self.measure_thread and q.device.type == "cpu"
            inputs = partial(self.sampler.inputs, site, q, k, mask, causal, scoring, copy=submit)
            if submit:
                self._guarded(site, "activations", lambda: self._submit_activations(site, inputs()))
            else:
                self._guarded(site, "activations", lambda: self._measure_activations(site, inputs()))

        token = register_tap(measure)
        self._removers.append(lambda: unregister_tap(token))

        def tap(
            q: Tensor,
            k: Tensor,
            mask: Tensor | None = None,
            causal: bool | None = None,
            scoring: Scoring | None = None,
        ) -> None:
            if torch.compiler.is_compiling():
                # one opaque op in the graph: no graph break, no guard on the plan; at run time it
                # calls ``measure`` with the real tensors, which returns at once off report steps
                mask = mask.detach() if isinstance(mask, Tensor) else None
                scale, cap = (scoring.scale, scoring.softcap) if scoring is not None else (None, None)
                torch.ops.qkwatch.tap(q.detach(), k.detach(), mask, causal, scale, cap, sink(q.device), token)
                return
            measure(q, k, mask, causal, scoring)

        tap.wanted = wanted  # type: ignore[attr-defined]  # see adapters.TapFn
        return tap

    def _guarded(self, site: Site, what: str, fn: Callable[[], None]) -> None:
        """A failing measurement is reported once and skipped; it never breaks the training step.

        Measured without autocast: a forward (or a report) run under ``torch.autocast`` would
        otherwise compute the metrics in bf16/fp16. The inputs keep the dtype the model gave them.
        """
        try:
            with torch.no_grad(), _no_autocast():
                fn()
        except Exception as exc:
            self._warn(site, what, exc)

    def _warn(self, site: Site, what: str, exc: Exception) -> None:
        key = f"{what}:{type(exc).__name__}"
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("qkwatch could not measure %s of layer %d (%s): %s", what, site.layer, site.name, exc)

    # --- measurements -----------------------------------------------------------------------

    def _submit(self, fn: Callable[..., list[Measured]], *args: Any) -> Future[list[Measured]]:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qkwatch-measure")
        return self._worker.submit(fn, *args)

    def _measure_activations(self, site: Site, inputs: Inputs) -> None:
        per_layer, heads = self.sampler.metrics(site, inputs)
        self._store(site.layer, per_layer, heads)
        self.capture.activations_seen.add(site.layer)

    def _submit_activations(self, site: Site, inputs: Inputs) -> None:
        """Queue the copied rows (taken here, in the training thread) for the worker thread."""
        self._queued.append((site, inputs))
        self.capture.activations_seen.add(site.layer)  # taken back by _collect if the measurement fails
        if len(self._queued) == self._tapped:  # the forward's last layer: every layer in one batch
            self._hand_over_activations()

    def _hand_over_activations(self) -> None:
        queued, self._queued = self._queued, []
        if queued:
            sites = [site for site, _ in queued]
            self._pending.append((sites, "activations", self._submit(self._activation_batch, queued)))

    def _activation_batch(self, queued: list[tuple[Site, Inputs]]) -> list[Measured]:
        """The worker thread's work: the layers' rows stacked, one call per shape (one, for a uniform
        model), so that each of the few dozen small operations runs once per report, not per layer."""
        groups: dict[tuple[object, ...], list[int]] = {}
        for i, (site, inputs) in enumerate(queued):
            key = (site.causal, site.remove_outlier, *((n, t.shape, t.dtype) for n, t in inputs.items()))
            groups.setdefault(key, []).append(i)
        results: list[Measured | None] = [None] * len(queued)
        with torch.no_grad():  # grad mode is per thread
            for members in groups.values():
                site, first = queued[members[0]]
                stacked = {n: torch.stack([queued[i][1][n] for i in members]) for n in first if n != "pos"}
                per_layer, heads = self.sampler.metrics(site, {**stacked, "pos": first["pos"]})
                for j, i in enumerate(members):
                    results[i] = ({n: v[j] for n, v in per_layer.items()}, {n: v[j] for n, v in heads.items()})
        return [r for r in results if r is not None]

    def _store(self, layer: int, per_layer: dict[str, Tensor], per_head: dict[str, Tensor]) -> None:
        self.capture.layers.setdefault(layer, {}).update(per_layer)
        if per_head:
            self.capture.heads.setdefault(layer, {}).update(per_head)


def _no_autocast() -> contextlib.ExitStack:
    """Autocast off for the CPU and, where there is one, the GPU (autocast is per thread and device)."""
    stack = contextlib.ExitStack()
    for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        stack.enter_context(torch.autocast(device, enabled=False))
    return stack
