"""One report, packed on the training thread and encoded on the host into the wire's shape.

Packing lays every device value of a report (per-layer and per-head metrics, logged tensors) end
to end in one float32 tensor, with a key saying what each slice is, so a report costs one
device-to-host copy and one synchronisation, wherever and whenever the copy is waited for.
Encoding reads the host copy back into a :class:`qkwatch.contract.wire.Report`'s fields: ``layers``
(metric -> one value per layer, None where not measured), ``heads`` (metric -> per layer, the
per-head values), ``scalars`` and ``events``; non-finite values become "nan", "inf", "-inf".

Scalars logged at steps without a report (the loss of every step, say) ride in the same tensor
and come out as reports of their own steps holding only ``scalars``: every logged value is
stored at its step, and the device is still synchronised once per report.

Pure: no hooks, threads, I/O or globals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor

from qkwatch.contract.values import encode_value

Key: TypeAlias = (
    tuple[Literal["layer"], str, int]
    | tuple[Literal["heads"], str, int, int]
    | tuple[Literal["layers"], str, int]
    | tuple[Literal["scalar"], str]
    | tuple[Literal["logged"], str, int]
)
"""What a slice of the packed values is: ``("layer", metric, layer)`` (one value),
``("heads", metric, layer, n)`` (n values), ``("layers", metric, n)`` (one per layer),
``("scalar", name)`` (one value) or ``("logged", name, step)`` (one value logged at another step)."""


@dataclass
class Packed:
    """A report on its way to the host."""

    step: int
    time: float
    keys: list[Key]
    values: Tensor
    """Every device value, laid end to end as ``keys`` say (float32, 1-d)."""
    floats: dict[str, float]
    """Run-level scalars already on the host."""
    events: list[dict[str, Any]]
    ready: Any = None
    """Something whose ``synchronize()`` returns once ``values`` is on the host (a CUDA event),
    or None when it is there already."""
    host_layers: dict[str, list[float]] = field(default_factory=dict)
    """Per-layer values given as host numbers (the applied lambdas, say)."""
    logged_floats: dict[int, dict[str, float]] = field(default_factory=dict)
    """Scalars logged at other steps, already on the host: step -> name -> value."""
    logged_times: dict[int, float] = field(default_factory=dict)
    """When each of those other steps was logged (epoch seconds)."""
    main: bool = True
    """False for a pack of logged scalars alone (flushed between reports): no report of ``step``."""


class Packer:
    """Collects one report's values; :meth:`pack` stacks the device ones into a single tensor."""

    def __init__(self) -> None:
        self.keys: list[Key] = []
        self.tensors: list[Tensor] = []
        self.floats: dict[str, float] = {}
        self.host_layers: dict[str, list[float]] = {}
        self.logged_floats: dict[int, dict[str, float]] = {}
        self.logged_times: dict[int, float] = {}

    def metrics(self, layers: dict[int, dict[str, Tensor]], heads: dict[int, dict[str, Tensor]]) -> None:
        """A capture's per-layer values (0-d tensors) and per-head values (1-d)."""
        for layer, metrics in layers.items():
            for name, value in metrics.items():
                self.keys.append(("layer", name, layer))
                self.tensors.append(value.reshape(1))
        for layer, metrics in heads.items():
            for name, value in metrics.items():
                self.keys.append(("heads", name, layer, value.numel()))
                self.tensors.append(value.reshape(-1))

    def scalar(self, name: str, value: float | Tensor) -> None:
        """A run-level value: a tensor travels with the report's copy, a number as it is."""
        if isinstance(value, Tensor):
            self.keys.append(("scalar", name))
            self.tensors.append(value.reshape(1))
        else:
            self.floats[name] = float(value)

    def logged(self, step: int, when: float, scalars: dict[str, float | Tensor]) -> None:
        """Scalars logged at ``step`` (not the report's): each becomes a value of a report of ``step``."""
        self.logged_times[step] = when
        for name, value in scalars.items():
            if isinstance(value, Tensor):
                self.keys.append(("logged", name, step))
                self.tensors.append(value.reshape(1))
            else:
                self.logged_floats.setdefault(step, {})[name] = float(value)

    def layer_values(self, name: str, values: Sequence[float] | Tensor) -> None:
        """One value per layer, as a tensor (``(n_layers,)``) or host numbers."""
        if isinstance(values, Tensor):
            self.keys.append(("layers", name, values.numel()))
            self.tensors.append(values.reshape(-1))
        else:
            self.host_layers[name] = [float(v) for v in values]

    def has_layer_values(self, name: str) -> bool:
        return name in self.host_layers or any(k[:2] == ("layers", name) for k in self.keys)

    def pack(self, step: int, time: float, events: list[dict[str, Any]], *, main: bool = True) -> Packed:
        """The report, its device values stacked where they live (the copy to the host is the caller's).

        ``main=False``: only the logged scalars of other steps (a flush between reports).
        """
        return Packed(
            step,
            time,
            self.keys,
            _stack(self.tensors),
            self.floats,
            events,
            None,
            self.host_layers,
            self.logged_floats,
            self.logged_times,
            main,
        )


def encode_logged(packed: Packed) -> list[dict[str, Any]]:
    """The scalar-only reports of the steps logged between reports (``values`` on the host)."""
    host = packed.values.tolist()
    scalars: dict[int, dict[str, Any]] = {
        s: {k: encode_value(v) for k, v in f.items()} for s, f in packed.logged_floats.items()
    }
    pos = 0
    for key in packed.keys:
        if key[0] == "logged":
            scalars.setdefault(key[2], {})[key[1]] = encode_value(host[pos])
        pos += _width(key)
    return [
        {"step": step, "time": packed.logged_times.get(step, packed.time), "layers": {}, "scalars": values}
        for step, values in sorted(scalars.items())
    ]


def _width(key: Key) -> int:
    """How many packed values a key's slice holds."""
    if key[0] == "heads":
        return key[3]
    if key[0] == "layers":
        return key[2]
    return 1


def encode(packed: Packed, n_layers: int) -> dict[str, Any]:
    """The report as the wire carries it (a :class:`qkwatch.contract.wire.Report`'s fields); ``values`` on the host."""
    host = packed.values.tolist()  # on the host already: no synchronisation
    layers: dict[str, list[Any]] = {}
    heads: dict[str, list[Any]] = {}
    scalars: dict[str, Any] = {}
    pos = 0
    for key in packed.keys:
        if key[0] == "layer":
            layers.setdefault(key[1], [None] * n_layers)[key[2]] = encode_value(host[pos])
            pos += 1
        elif key[0] == "heads":
            heads.setdefault(key[1], [None] * n_layers)[key[2]] = [encode_value(v) for v in host[pos : pos + key[3]]]
            pos += key[3]
        elif key[0] == "layers":
            layers[key[1]] = [encode_value(v) for v in host[pos : pos + key[2]]]
            pos += key[2]
        elif key[0] == "scalar":
            scalars[key[1]] = encode_value(host[pos])
            pos += 1
        else:  # a value logged at another step: encode_logged's
            pos += _width(key)
    for name, values in packed.host_layers.items():
        layers[name] = [encode_value(v) for v in values]
    scalars.update({k: encode_value(v) for k, v in packed.floats.items()})
    report: dict[str, Any] = {"step": packed.step, "time": packed.time, "layers": layers, "scalars": scalars}
    if heads:
        report["heads"] = heads
    if packed.events:
        report["events"] = packed.events
    return report


def missing_layers_event(missing: list[int], names: list[str], rank: int, world: int, step: int) -> dict[str, Any]:
    """Layers that produced no values on the first report: their forward bypassed the hooked modules."""
    message = (
        f"layers {missing} produced no values on rank {rank} at step {step}: their "
        "forward did not run through the hooked modules (a fused fast path?)"
    )
    return {
        "kind": "missing_layers" if world == 1 else f"missing_layers_rank{rank}",
        "message": message,
        "data": {"layers": missing, "modules": names},
    }


def _stack(tensors: list[Tensor]) -> Tensor:
    if not tensors:
        return torch.zeros(0)
    device = tensors[0].device
    return torch.cat([t.detach().to(device=device, dtype=torch.float32) for t in tensors])
