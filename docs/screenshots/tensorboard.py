"""The TensorBoard screenshot of docs/integrations.md, made again with ``python -m docs.screenshots.tensorboard``.

1. Trains ``qkwatch.nanogpt.NanoGPT`` (6 layers of d_model 128, 4 heads) on the CPU for ``--steps``
   steps of byte-level text (Python's own pydoc topics, batch 8 x 128 bytes, AdamW 3e-3), with
   ``qkwatch.attach(model, url=None, every=10, sinks=[TensorBoardSink(logdir)])``: no collector,
   a report every 10 steps, the loss logged at every step.
2. Serves ``logdir`` with ``tensorboard --logdir`` on a free loopback port and waits until its
   custom-scalars layout and every layer's QKAI are loaded.
3. Takes a headless Chromium screenshot (``/usr/bin/chromium``, 1400 x 1000) of the tab named by
   ``--tab`` (default ``custom_scalars``: one chart per metric, every layer in it) into ``--out``.

Takes about 2-5 minutes on 2 cores. Needs ``pip install 'qkwatch[tensorboard]'`` and Chromium.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch
from torch.nn import functional as F

import qkwatch
from qkwatch.agent.sinks.tensorboard_sink import TensorBoardSink
from qkwatch.launch import free_port
from qkwatch.nanogpt import NanoGPT
from qkwatch.trainer.run.data import load_corpus

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
OUT = ROOT / "docs" / "img" / "tensorboard-custom-scalars.png"
PROJECT, RUN = "docs", "tensorboard"
"""The qkwatch project and run: TensorBoard shows the run as ``docs/tensorboard``."""

logger = logging.getLogger("docs.screenshots.tensorboard")


def train(logdir: Path, steps: int, spool: Path) -> None:
    """The run, its reports written as TensorBoard event files under ``logdir/docs/tensorboard``."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = torch.from_numpy(load_corpus("pydoc").astype("int64"))
    model = NanoGPT(vocab=256, d_model=128, n_head=4, n_layer=6, block=128)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    sink = TensorBoardSink(logdir / PROJECT / RUN, flush_secs=5)
    agent = qkwatch.attach(model, url=None, project=PROJECT, run=RUN, spool=str(spool), every=10, sinks=[sink])
    started = time.monotonic()
    for step in range(steps):
        starts = torch.randint(0, len(data) - 129, (8,), generator=gen)
        x = torch.stack([data[s : s + 129] for s in starts.tolist()])  # (B, T + 1)
        agent.step(step)
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        agent.log(step, loss=loss.detach())
        if step % 100 == 0:
            logger.info("step %d, loss %.3f, %.0f s", step, loss.item(), time.monotonic() - started)
    agent.close(timeout=30, status="finished")


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def wait_loaded(base: str, layers: int, timeout: float = 120) -> None:
    """Until TensorBoard serves the custom-scalars layout and the QKAI of every layer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            layout = get_json(f"{base}/data/plugin/custom_scalars/layout")
            tags = get_json(f"{base}/data/plugin/scalars/tags")
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            time.sleep(1)
            continue
        run_tags: dict[str, object] = next(iter(tags.values()), {}) if isinstance(tags, dict) else {}
        qkai = [t for t in run_tags if t.startswith("qkwatch/qkai/layer_")]
        if layout and len(qkai) == layers:
            return
        time.sleep(1)
    raise TimeoutError(f"TensorBoard at {base} had not loaded the run within {timeout} s")


def screenshot(url: str, out: Path, profile: Path, budget_ms: int) -> None:
    """Headless Chromium, offline but for the loopback address, 1400 x 1000."""
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--hide-scrollbars",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        f"--user-data-dir={profile}",
        "--window-size=1400,1000",
        f"--virtual-time-budget={budget_ms}",
        f"--screenshot={out}",
        url,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"chromium failed ({done.returncode}): {done.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m docs.screenshots.tensorboard", description=__doc__)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--logdir", type=Path, help="keep the event files here (default: a temporary folder)")
    parser.add_argument("--tab", default="custom_scalars", help="TensorBoard's tab: custom_scalars, scalars, images")
    parser.add_argument("--budget-ms", type=int, default=20000, help="Chromium's virtual time for the page")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    work = Path(tempfile.mkdtemp(prefix="qkwatch-tb-shot-"))
    logdir = args.logdir or work / "logs"
    if not (logdir / PROJECT / RUN).exists():
        train(logdir, args.steps, work / "spool")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_loaded(base, layers=6)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        screenshot(f"{base}/#{args.tab}", args.out, work / "chromium", args.budget_ms)
        logger.info("%s: %d bytes", args.out, args.out.stat().st_size)
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
