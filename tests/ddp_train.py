"""Run under torchrun by tests/test_distributed.py: train each job of a JSON list ({"config": ...,
"no_sync": ..., and optionally "checkpoint": a folder and "stop_after": an epoch}) in turn, and have rank 0 save
every result's weights and metrics (None for a job stopped early) to the path given."""
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

from batchsweep.trainers import TrainConfig, train
from batchsweep.trainers.checkpoint import Checkpointing


class Stop(Exception):
    pass


def stop_after(epoch):
    def on_epoch(row):
        if row["epoch"] == epoch:  # on every rank at once, as a kill between two epochs
            raise Stop

    return on_epoch


jobs, out = json.loads(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")  # once: train() then leaves the group to its owner
results = []
for job in jobs:
    checkpoint = Checkpointing(job["checkpoint"]) if "checkpoint" in job else None
    on_epoch = stop_after(job["stop_after"]) if "stop_after" in job else None
    try:
        result = train(TrainConfig(**job["config"]), no_sync=job["no_sync"], checkpoint=checkpoint,
                       on_epoch=on_epoch)
    except Stop:
        results.append(None)
        continue
    results.append({"state": result.model.state_dict(), "metrics": result.metrics, "history": result.history})
if os.environ["RANK"] == "0":
    torch.save(results, out)
dist.barrier()  # torn down together (gloo can abort a rank whose peer has gone first)
gc.collect()  # DDP's reducer, in a cycle, freed while torch is whole: at exit it can abort the rank
dist.destroy_process_group()
