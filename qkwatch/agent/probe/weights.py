"""The probe's weight pass: a report's weights read when its step is armed, and not measured twice
while unchanged.

A report's weights are those its activations ran with: they are read when the step is armed
(``Agent.step(s)``, before step ``s``'s forward and after the optimizer step before it), never at
the report, which is packed after the step's own optimizer step. Plain weights are read there, every
owned layer in one batched ``weight_metrics`` call; on the CPU with ``measure_thread``, in the
``qkwatch-measure`` thread from stacked copies. A layer whose weights nothing changed since they
were last measured (``weight_versions.version_key``) keeps the values measured then. Sharded ones
(FSDP2's DTensors) are read in a forward pre-hook of the attention module, where FSDP2 has them
unsharded; a layer whose pre-hook did not run at the last weight report (a compiled forward), and
every layer at the first, is gathered (``full_tensor()``) when the step is armed instead.

:class:`WeightReading` is the part of :class:`qkwatch.agent.probe.probe.Probe` that does this; the
probe's constructor sets the state it uses.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from qkwatch.agent.metrics.summary import weight_metrics
from qkwatch.agent.models.sites import Site
from qkwatch.agent.probe.plan import Capture, Measured, Plan
from qkwatch.agent.probe.weight_versions import version_key


class WeightReading:
    """Reads and measures the weights of a report step (a base of ``Probe``)."""

    # set by Probe.__init__
    sites: list[Site]
    owned: set[int]
    heads: bool
    measure_thread: bool
    in_forward: bool
    plan: Plan | None
    capture: Capture
    _pending: list[tuple[list[Site], str, Future[list[Measured]]]]
    _weights_cache: dict[int, tuple[tuple[object, ...], Measured]]
    _weights_queued: dict[int, tuple[object, ...] | None]
    _hooked: set[int] | None
    # defined by Probe: a measurement that cannot break the step, the worker thread, the capture
    _guarded: Callable[[Site, str, Callable[[], None]], None]
    _submit: Callable[..., Future[list[Measured]]]
    _store: Callable[[int, dict[str, Tensor], dict[str, Tensor]], None]

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

    def _weights_of(self, site: Site, wq: Tensor, wk: Tensor, rotation: Tensor | None, plan: Plan) -> None:
        rotation = None if rotation is None else rotation.detach()
        per_layer, per_head = weight_metrics(wq.detach(), wk.detach(), rotation, spectra=plan.spectra)
        self._store(site.layer, per_layer, per_head if self.heads else {})
        self.capture.weights_seen.add(site.layer)


def sharded(t: Tensor) -> bool:
    """Whether ``t`` is sharded: a DTensor (FSDP2, tensor parallelism)."""
    return hasattr(t, "full_tensor")


def _full(t: Tensor) -> Tensor:
    """A plain tensor from a possibly sharded (DTensor) parameter."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
