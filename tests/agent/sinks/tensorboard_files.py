"""Reading a TensorBoard log directory back with TensorBoard's own ``EventAccumulator``."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2


def events(logdir: Path) -> EventAccumulator:
    """Every event under ``logdir``, nothing sampled away."""
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def layout(acc: EventAccumulator) -> dict[str, dict[str, list[str]]]:
    """The newest custom-scalars layout: category -> chart title -> the multiline chart's tag regexes."""
    proto = layout_pb2.Layout()
    proto.ParseFromString(acc.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0])
    return {c.title: {ch.title: list(ch.multiline.tag) for ch in c.chart} for c in proto.category}


def image(acc: EventAccumulator, tag: str, index: int = -1) -> tuple[int, np.ndarray]:
    """The step and the RGB pixels of an image summary."""
    event = acc.Images(tag)[index]
    return event.step, np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
