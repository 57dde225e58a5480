"""Run by ``torchrun --nproc_per_node 2``: the agent on a TinyGPT sharded by FSDP2 (gloo, CPU mesh).

Rank 1's collector URL refuses connections (a collector that refuses one rank). Rank 0 also
attaches an offline agent to an unsharded copy (the reference) for the first step and writes
both to ``OUT``, with every layer's QKAI (the closed form) of the weights each step's forward ran
with (gathered just before it) and of those after its update.

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
from qkwatch.agent.shipping.disk_spool import Spool
from tests.agent.test_weight_timing import qkai_closed_form
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
    applied, before, after = [], [], []
    for step in range(steps):
        a.step(step)
        applied.append(a.lambdas())
        before.append(qkai_now(model))  # the weights this step's forward runs with
        x = batch(step)  # the same batch on every rank: the trajectory equals the unsharded one
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, 64), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        after.append(qkai_now(model))
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
        result = {"reference": record.payload["report"], "applied": every_rank, "before": before, "after": after}
        out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def qkai_now(model: torch.nn.Module) -> list[float]:
    """Every layer's QKAI now, from its gathered weights (a collective: every rank calls it)."""
    out = []
    for block in model.h:
        w = block.attn.c_attn.weight.full_tensor().detach().double().numpy()  # (3 d, d): rows q, k, v
        d = w.shape[1]
        out.append(qkai_closed_form(w[:d].T, w[d : 2 * d].T, block.attn.n_head))
    return out


if __name__ == "__main__":
    main()
