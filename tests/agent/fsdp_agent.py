"""Run by ``torchrun --nproc_per_node 2``: the agent on a TinyGPT sharded by FSDP2 (gloo, CPU mesh).

Rank 1's collector URL refuses connections (a collector that refuses one rank). Rank 0 also
attaches an offline agent to an unsharded copy (the reference) for the first step and writes
both to ``OUT/reference.json``.

    python -m torch.distributed.run --nproc_per_node 2 -m tests.agent.fsdp_agent URL SPOOL OUT STEPS
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from qkwatch import agent
from qkwatch.agent.disk_spool import Spool
from tests.agent.tiny import TinyGPT, batch


def main() -> None:
    url, spool, out, steps = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    a = agent.attach(
        model,
        url=url if rank == 0 else "http://127.0.0.1:9",
        project="tests",
        run="fsdp",
        spool=str(spool),
        every=1,
        spectra_every=0,
        lambda_sync_every=2,
        flush_seconds=0.05,
        backoff_base=0.05,
        backoff_cap=0.2,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    applied = []
    for step in range(steps):
        a.step(step)
        applied.append(a.lambdas())
        x = batch(step)  # the same batch on every rank: the trajectory equals the unsharded one
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, 64), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        a.log(step, loss=loss.detach())
    a.close(timeout=20)
    every_rank = [None] * world
    dist.all_gather_object(every_rank, applied)  # what each rank applied, step by step
    if rank == 0:
        ref = agent.attach(
            reference,
            url=None,
            project="tests",
            run="reference",
            spool=str(spool / "reference"),
            every=1,
            spectra_every=0,
            distributed=False,
        )
        ref.step(0)
        with torch.no_grad():
            reference(batch(0)[:, :-1])
        ref.close(timeout=0.1, status=None)  # a measurement, not a run: no status record
        s = Spool(ref.spool_path)
        (record,) = s.pending(10)
        out.write_text(json.dumps({"reference": record.payload["report"], "applied": every_rank}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
