"""Run by ``torchrun --nproc_per_node 2``: a HuggingFace Llama (GQA) held by a plain module, its decoder
layers sharded by FSDP2 (gloo, CPU mesh), attached offline on each rank. Rank 0 also attaches to an
unsharded copy and writes both reports to OUT.

    python -m torch.distributed.run --nproc_per_node 2 -m tests.agent.fsdp_hf SPOOL OUT
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from qkwatch import agent
from qkwatch.agent.shipping.disk_spool import Spool
from tests.agent.test_invisible import CASES


class Holder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def reports(spool: Path) -> list[dict]:
    s = Spool(spool)
    try:
        return [r.payload["report"] for r in s.pending(1000) if "report" in r.payload]
    finally:
        s.close()


def main() -> None:
    spool, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = CASES["llama-sdpa"].build().eval()
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randint(1, 50, (2, 12), generator=torch.Generator().manual_seed(4))
    a = agent.attach(Holder(model), project="tests", run="fsdp-hf", spool=str(spool), every=1, spectra_every=0)
    a.step(0)
    with torch.no_grad():
        model(input_ids=x)
    a.close(timeout=0.1, status=None)
    names = [s.name for s in a.sites]
    if rank == 0:
        ref = agent.attach(
            reference, project="tests", run="ref", spool=str(spool / "ref"), every=1, spectra_every=0, distributed=False
        )
        ref.step(0)
        with torch.no_grad():
            reference(input_ids=x)
        ref.close(timeout=0.1, status=None)
        (sharded,) = [r for r in reports(spool / "tests" / "fsdp-hf" / "rank-0") if r["layers"]]
        (unsharded,) = [r for r in reports(spool / "ref" / "tests" / "ref" / "rank-0") if r["layers"]]
        out.write_text(json.dumps({"names": names, "sharded": sharded["layers"], "unsharded": unsharded["layers"]}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
