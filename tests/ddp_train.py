"""Run under torchrun by tests/test_distributed.py: train each job of a JSON list ({"config": ...,
"no_sync": ...}) in turn, and have rank 0 save every result's weights and metrics to the path given."""
import json
import os
import sys

import torch
import torch.distributed as dist

from trainers import TrainConfig, train

jobs, out = json.loads(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")  # once: train() then leaves the group to its owner
results = []
for job in jobs:
    result = train(TrainConfig(**job["config"]), no_sync=job["no_sync"])
    results.append({"state": result.model.state_dict(), "metrics": result.metrics})
if os.environ["RANK"] == "0":
    torch.save(results, out)
dist.destroy_process_group()
