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

A report's weights are those its activations ran with: they are read when the step is armed
(``Agent.step(s)``, before step ``s``'s forward and after the optimizer step before it), never at
the report, which is packed after the step's own optimizer step. Plain weights are read there, every
owned layer in one batched call. Sharded ones (FSDP2's DTensors) are read in a forward pre-hook of
the attention module, where FSDP2 has them unsharded, so no extra all-gather is needed; a layer
whose pre-hook did not run at the last weight report (a compiled forward), and every layer at the
first, is gathered (``full_tensor()``) when the step is armed instead. Each rank measures only the
layers it owns (``layer % world == rank``), so a rank pays about 1/world of the cost. Activations
come from the site's tap, the queries and keys of the whole micro-batch and the mask the model
attended under; which rows are read, and how padding is left out, is ``agent.activations``.
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
from torch import Tensor, nn

from qkwatch.agent.activations import ACTIVATION_HEAD_METRICS, Inputs, Sampler
from qkwatch.agent.checks import SettingError, positive_ints
from qkwatch.agent.compiled_tap import register_tap, sink, unregister_tap
from qkwatch.agent.metrics.summary import weight_metrics
from qkwatch.agent.plan import Capture, Measured, Plan
from qkwatch.agent.sites import Scoring, Site, TapFn
from qkwatch.agent.weight_versions import version_key

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


class Probe:
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
        self.in_forward = any(_sharded(p) for site in sites for p in site.module.parameters())
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

    # --- hooks ------------------------------------------------------------------------------

    def _weights_hook(self, site: Site) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if torch.compiler.is_compiling():
                return  # traced as a no-op: no graph break, no guard, no recompile (see _read_weights)
            plan = self.plan
            if plan is None or not plan.weights or site.layer in self.capture.forward_seen:
                return  # not a report step (or a recomputation under activation checkpointing)
            self.capture.forward_seen.add(site.layer)
            if site.layer in self.owned and site.layer not in self.capture.weights_seen:  # not read at arm()
                self._guarded(site, "weights", lambda: self._measure_weights(site, plan))

        return hook

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

    def _read_weights(self, plan: Plan) -> None:
        """The weights of the armed step, before its forward: all owned layers batched (plain
        weights), or, sharded, the layers whose pre-hook did not run at the last weight report (a
        compiled forward; at the first report, not known yet, ``disarm`` reads them).

        Called at a step chosen by the step number alone, on every rank: a parameter sharded by
        FSDP2 (a DTensor) is gathered with ``full_tensor()``, a collective every rank joins for
        every such layer in the same order, though each measures only its own.
        """
        if not self.in_forward:
            self._guarded(self.sites[0], "weights", partial(self._weights_batched, plan))
            return
        if self._hooked is None:
            return  # the first report: the pre-hooks read them in the forward; any they miss, at disarm
        self._read_sharded([site for site in self.sites if site.layer not in self._hooked], plan)

    def _read_sharded(self, sites: list[Site], plan: Plan) -> None:
        """Sharded layers' weights gathered whole (``full_tensor()``: every rank joins, in layer order)."""
        for site in sites:
            wq, wk, rotation = site.weights()
            wq, wk, rotation = _full(wq), _full(wk), None if rotation is None else _full(rotation)
            if site.layer in self.owned:
                self._guarded(site, "weights", partial(self._weights_of, site, wq, wk, rotation, plan))

    # --- measurements -----------------------------------------------------------------------

    def _weights_batched(self, plan: Plan) -> None:
        """Every owned layer whose weights changed since they were last measured, in one
        ``weight_metrics`` call per shape (one, for a uniform model); on the CPU with
        ``measure_thread``, in the worker thread from the stacked copies, so that the optimizer step
        may update the weights meanwhile.

        A layer whose query and key weights are views of parameters that nothing has changed since
        (``weight_versions.version_key``: same storage, version counter, sum and norm; frozen layers,
        a step that did not update this layer) keeps the values measured then.
        """
        groups: dict[tuple[object, ...], list[tuple[Site, tuple[Tensor, Tensor, Tensor | None]]]] = {}
        versions: dict[int, tuple[object, ...] | None] = {}
        for site in self.sites:
            if site.layer not in self.owned:
                continue
            wq, wk, rotation = site.weights()
            version = versions[site.layer] = version_key((wq, wk, rotation), plan.spectra)
            cached = self._weights_cache.get(site.layer)
            if version is not None and cached is not None and cached[0] == version:
                self._store(site.layer, *cached[1])
                self.capture.weights_seen.add(site.layer)
                continue
            wq, wk, rotation = wq.detach(), wk.detach(), None if rotation is None else rotation.detach()
            key = (wq.shape, wk.shape, None if rotation is None else rotation.shape, wq.device, wq.dtype)
            groups.setdefault(key, []).append((site, (wq, wk, rotation)))
        for members in groups.values():
            sites = [site for site, _ in members]
            wq = torch.stack([w[0] for _, w in members])  # (L, H, D, hs); a copy
            wk = torch.stack([w[1] for _, w in members])
            rotations = [w[2] for _, w in members if w[2] is not None]  # all or none: the key says which
            rot = torch.stack(rotations) if rotations else None
            if self.measure_thread and wq.device.type == "cpu":
                self._weights_queued.update((site.layer, versions[site.layer]) for site in sites)
                self._pending.append((sites, "weights", self._submit(self._weight_batch, wq, wk, rot, plan.spectra)))
                continue
            for site, measured in zip(sites, self._weight_batch(wq, wk, rot, plan.spectra), strict=True):
                self._keep_weights(site, measured, versions[site.layer])

    def _weight_batch(self, wq: Tensor, wk: Tensor, rotation: Tensor | None, spectra: bool) -> list[Measured]:
        """Stacked layers' weight metrics, layer by layer (per head only with ``heads``); the worker
        thread's work, or the training thread's."""
        with torch.no_grad():  # grad mode is per thread
            per_layer, per_head = weight_metrics(wq, wk, rotation, spectra=spectra)
        return [
            ({k: v[i] for k, v in per_layer.items()}, {k: v[i] for k, v in per_head.items()} if self.heads else {})
            for i in range(wq.shape[0])
        ]

    def _keep_weights(self, site: Site, measured: Measured, version: tuple[object, ...] | None) -> None:
        """Store a layer's measured weights, remembered under their version key (None: not cached)."""
        self._store(site.layer, *measured)
        self.capture.weights_seen.add(site.layer)
        if version is None:
            self._weights_cache.pop(site.layer, None)
        else:
            self._weights_cache[site.layer] = (version, measured)

    def _measure_weights(self, site: Site, plan: Plan) -> None:
        """In the forward (FSDP2: the weights are whole only there): here, or in the worker thread
        from copies (the unsharded weights are freed after the forward)."""
        wq, wk, rotation = site.weights()
        if not (self.measure_thread and wq.device.type == "cpu"):
            self._weights_of(site, wq, wk, rotation, plan)
            return
        copies = [None if w is None else w.detach().clone() for w in (wq, wk, rotation)]
        assert copies[0] is not None and copies[1] is not None, "site.weights() gives both projections"
        self._pending.append(
            ([site], "weights", self._submit(self._weight_values, copies[0], copies[1], copies[2], plan.spectra))
        )

    def _weight_values(self, wq: Tensor, wk: Tensor, rotation: Tensor | None, spectra: bool) -> list[Measured]:
        """One layer's weight metrics (the worker thread's work), per head only with ``heads``."""
        with torch.no_grad():
            per_layer, per_head = weight_metrics(wq, wk, rotation, spectra=spectra)
        return [(per_layer, per_head if self.heads else {})]

    def _submit(self, fn: Callable[..., list[Measured]], *args: Any) -> Future[list[Measured]]:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qkwatch-measure")
        return self._worker.submit(fn, *args)

    def _weights_of(self, site: Site, wq: Tensor, wk: Tensor, rotation: Tensor | None, plan: Plan) -> None:
        rotation = None if rotation is None else rotation.detach()
        per_layer, per_head = weight_metrics(wq.detach(), wk.detach(), rotation, spectra=plan.spectra)
        self._store(site.layer, per_layer, per_head if self.heads else {})
        self.capture.weights_seen.add(site.layer)

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


def _sharded(t: Tensor) -> bool:
    return hasattr(t, "full_tensor")  # a DTensor (FSDP2, tensor parallelism)


def _full(t: Tensor) -> Tensor:
    """A plain tensor from a possibly sharded (DTensor) parameter."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
