"""Checkpoints never execute, and a damaged one is one line naming the file, exit 2 (issue 42, findings 1 and 9).

Every crafted checkpoint here is real: a pickle whose ``__reduce__`` calls ``os.system`` to create a
marker file, in ``.metadata`` or as ``train.step`` inside a DCP data file, with ``checksums.json``
rewritten to match (an attacker controls the whole folder). The commands run in-process through
``qkwatch.cli.main`` (what ``qkwatch eval`` and ``qkwatch train --resume`` run); one runs the real
``qkwatch`` executable.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qkwatch.cli import main
from qkwatch.trainer.cli import resolve_config
from qkwatch.trainer.run.train import run

SETS = [
    "model.n_layers=2",
    "model.d_model=32",
    "model.max_seq_len=32",
    "init.qk_layers=[1]",
    "data.task_mix=0.0",
    "train.steps=3",
    "train.global_batch_size=4",
    "train.val_batches=1",
]
STEP = "step-0000002"
CHECKSUMS = "checksums.json"  # the file name is part of the checkpoint format


class Evil:
    """Unpickling it runs ``touch MARKER``: what a crafted checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder stopped after step 2 of 3 (a checkpoint to resume), made once for the module."""
    out = tmp_path_factory.mktemp("trained") / "run"
    os.environ.pop("QKWATCH_URL", None)
    run(resolve_config("debug_cpu", SETS), out, stop_after=2)
    return out


@pytest.fixture
def out(trained: Path, tmp_path: Path) -> Path:
    """A fresh copy of the trained run folder for one test to damage."""
    copy = tmp_path / "run"
    shutil.copytree(trained, copy, ignore=shutil.ignore_patterns("spool"))
    return copy


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "pwned"


def _rehash(step_dir: Path) -> None:
    """Rewrite checksums.json to match the folder, as an attacker would."""
    sums = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in step_dir.iterdir() if p.name != CHECKSUMS}
    (step_dir / CHECKSUMS).write_text(json.dumps({"format": "qkwatch-checkpoint-sha256", "sha256": sums}))


def _eval(path: Path) -> list[str]:
    return ["eval", str(path), "--task", "perplexity", "--lengths", "16", "--samples", "1"]


def _resume(out: Path) -> list[str]:
    return ["train", "--recipe", "debug_cpu", "--out", str(out), "--resume"] + [x for s in SETS for x in ("--set", s)]


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *names: str) -> str:
    """Runs the command: exit 2, and stderr is one line naming the file (each of ``names``)."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for name in names:
        assert name in err[0], err[0]
    return err[0]


def _craft_metadata(step_dir: Path, marker: Path) -> None:
    (step_dir / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    _rehash(step_dir)


def _craft_train_step(step_dir: Path, marker: Path) -> None:
    """A real DCP checkpoint whose ``train.step`` is the crafted object (DCP saves it with torch.save)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    dcp_to_torch_save(step_dir, step_dir.parent / "whole.pt")  # our own checkpoint: trusted here
    state = torch.load(step_dir.parent / "whole.pt", weights_only=False)
    (step_dir.parent / "whole.pt").unlink()
    state["train"]["step"] = Evil(marker)
    for p in step_dir.glob("*.distcp"):
        p.unlink()
    (step_dir / ".metadata").unlink()
    dcp_save(state, checkpoint_id=str(step_dir), no_dist=True)
    _rehash(step_dir)


CRAFTS = {"metadata": (_craft_metadata, ".metadata"), "train_step": (_craft_train_step, "__0_0.distcp")}


@pytest.mark.parametrize("craft", sorted(CRAFTS))
def test_a_crafted_checkpoint_never_runs_under_eval_and_the_user_is_told(out, marker, capsys, craft):
    make, file = CRAFTS[craft]
    step_dir = out / "checkpoints" / STEP
    make(step_dir, marker)
    line = _refused(capsys, _eval(step_dir), str(step_dir / file))
    assert not marker.exists()
    assert "nothing" in line


@pytest.mark.parametrize("craft", sorted(CRAFTS))
def test_a_crafted_checkpoint_never_runs_under_train_resume_and_the_user_is_told(out, marker, capsys, craft):
    make, file = CRAFTS[craft]
    step_dir = out / "checkpoints" / STEP
    make(step_dir, marker)
    _refused(capsys, _resume(out), str(step_dir / file))
    assert not marker.exists()


def test_a_crafted_checkpoint_without_checksums_is_refused_the_same_way(out, marker, capsys):
    """Deleting checksums.json (an older checkpoint's shape) gets a crafted pickle no further."""
    step_dir = out / "checkpoints" / STEP
    _craft_train_step(step_dir, marker)
    (step_dir / CHECKSUMS).unlink()
    _refused(capsys, _eval(step_dir), str(step_dir / "__0_0.distcp"), "not plain data")
    assert not marker.exists()


def test_the_qkwatch_executable_refuses_a_crafted_metadata_in_one_line(out, marker):
    step_dir = out / "checkpoints" / STEP
    _craft_metadata(step_dir, marker)
    done = subprocess.run(
        [str(Path(sys.executable).parent / "qkwatch"), *_eval(step_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "QKWATCH_URL"},
    )
    assert done.returncode == 2
    assert not marker.exists()
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"qkwatch eval: {step_dir / '.metadata'}: refers to ")


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x40  # the middle of a DCP data file is weights
    file.write_bytes(bytes(data))


DAMAGE = {
    "truncated data file": ("__0_0.distcp", _truncate),
    "flipped weight bytes": ("__0_0.distcp", _flip),
    "bad .metadata": (".metadata", lambda f: f.write_bytes(b"\x80\x04garbage")),
    "truncated .metadata": (".metadata", _truncate),
    "bad local-rank0.json": ("local-rank0.json", lambda f: f.write_text("{not json")),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("command", ["eval", "train --resume"])
def test_a_damaged_checkpoint_is_one_line_naming_the_file_and_exit_2(out, capsys, damage, command):
    name, spoil = DAMAGE[damage]
    step_dir = out / "checkpoints" / STEP
    spoil(step_dir / name)
    line = _refused(capsys, _eval(step_dir) if command == "eval" else _resume(out), str(step_dir / name))
    assert "sha256 differs" in line


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_without_checksums_is_still_one_line_and_exit_2(out, capsys, damage):
    """An older checkpoint (no checksums.json): what can be caught is named in one line; flipped weights cannot be."""
    name, spoil = DAMAGE[damage]
    step_dir = out / "checkpoints" / STEP
    (step_dir / CHECKSUMS).unlink()
    spoil(step_dir / name)
    if damage == "flipped weight bytes":
        capsys.readouterr()
        assert main(_resume(out)) == 0  # nothing to check against: the documented limit of old checkpoints
        return
    _refused(capsys, _resume(out), str(step_dir if damage == "truncated data file" else step_dir / name))


@pytest.mark.parametrize(
    "text",
    ["[1]", "{not json", '{"format": "qkwatch-checkpoint-sha256", "sha256": {".metadata": "0", "../run.json": "0"}}'],
    ids=["not an object", "not JSON", "a name outside the folder"],
)
def test_a_bad_checksum_list_is_one_line_naming_it(out, capsys, text):
    step_dir = out / "checkpoints" / STEP
    (step_dir / CHECKSUMS).write_text(text)
    _refused(capsys, _eval(step_dir), str(step_dir / CHECKSUMS))


@pytest.mark.parametrize(
    "state", ["[1]", '{"lambdas": {"entropy": 5}}'], ids=["not an object", "not the monitor's state"]
)
def test_a_local_state_that_does_not_fit_names_its_file(out, capsys, state):
    step_dir = out / "checkpoints" / STEP
    (step_dir / "local-rank0.json").write_text(state)
    _rehash(step_dir)
    _refused(capsys, _resume(out), str(step_dir / "local-rank0"))


def test_an_export_with_flipped_weight_bytes_is_refused(out, capsys):
    """model.pt (the qkwatch-gpt export) carries a sha256 per tensor: torch.load alone reads flipped bytes silently."""
    import zipfile

    run(resolve_config("debug_cpu", SETS), out, resume=True)
    export = out / "model.pt"
    with zipfile.ZipFile(export) as z:
        biggest = max(z.infolist(), key=lambda i: i.file_size)
    data = bytearray(export.read_bytes())
    data[biggest.header_offset + 30 + len(biggest.filename) + len(biggest.extra) + 100] ^= 0x40
    export.write_bytes(bytes(data))
    _refused(capsys, _eval(out), str(export), "differs from its sha256")
    _refused(capsys, ["analyze", str(export)], str(export), "differs from its sha256")  # analyze checks them too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_the_export_digest_is_the_sha256_of_the_tensor_bytes(dtype):
    """The one digest the export is written with (the trainer) and checked with (``qkwatch eval`` and
    ``qkwatch analyze``): the sha256 of the row-major bytes, whatever the tensor's strides."""
    import hashlib

    from qkwatch.agent.metrics import tensor_sha256

    tensor = (torch.randn(5, 7) * 3).to(dtype).t()  # not contiguous
    digest = tensor_sha256(tensor)
    row_major = bytes(tensor.contiguous().view(-1).view(torch.uint8).tolist())
    assert digest == hashlib.sha256(row_major).hexdigest() == tensor_sha256(tensor.contiguous())
    assert digest != tensor_sha256(tensor.flip(0)) or dtype is torch.bool


def test_an_intact_checkpoint_resumes_and_evaluates(out, capsys):
    """The safe reader loads what DCP saved: the optimizer's hyperparameters, the step, every weight."""
    assert main(_eval(out / "checkpoints" / STEP)) == 0
    assert main(_resume(out)) == 0
    assert (out / "checkpoints" / "step-0000003" / CHECKSUMS).is_file()
    sums = json.loads((out / "checkpoints" / "step-0000003" / CHECKSUMS).read_text())["sha256"]
    assert sorted(sums) == [".metadata", "__0_0.distcp", "local-rank0.json"]


def test_analyze_reads_a_crafted_pytorch_model_bin_without_running_it(tmp_path, marker):
    """qkwatch analyze's reader loads torch files with weights_only=True: a pickle with code is refused."""
    from qkwatch.agent.offline.checkpoint import CheckpointError, open_checkpoint

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_head": 2}))
    torch.save({"w": torch.zeros(2), "x": Evil(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin"):
        open_checkpoint(folder)
    with pytest.raises(CheckpointError, match=r"evil\.pt"):
        torch.save(Evil(marker), tmp_path / "evil.pt")
        open_checkpoint(tmp_path / "evil.pt")
    assert not marker.exists()


@pytest.mark.slow
def test_a_damaged_shard_of_a_two_rank_checkpoint_is_one_line_from_rank_0(tmp_path):
    """Under torchrun the ranks check the files together: every rank stops with exit 2, and rank 0 alone says why."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    env.pop("QKWATCH_URL", None)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    train = [*launch, "-m", "qkwatch.trainer", "--recipe", "debug_cpu", "--out", str(tmp_path / "run")]
    train += [x for s in SETS for x in ("--set", s)]
    first = subprocess.run([*train, "--set", "train.steps=2"], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    shard = tmp_path / "run" / "checkpoints" / STEP / "__1_0.distcp"
    _flip(shard)
    resumed = subprocess.run([*train, "--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode != 0
    said = [line for line in resumed.stderr.splitlines() if line.startswith("qkwatch train:")]
    assert said == [f"qkwatch train: {shard}: sha256 differs from {CHECKSUMS} (the file is corrupted or was changed)"]
    assert "exitcode: 2" in resumed.stderr
