"""The tracer's cost when it only counts (what a [program] trial runs under): the time of a micro-batch of the
example GPT loop (examples/audit/gpt_subject.py: forward, backward, and a step per window with a clip) with the
tracer in the process and without it, in alternating child processes, each timing its own training loop after a
warm-up. Prints each pair, `overhead_share_median=...` and, on the last line, `overhead=<share of a micro-batch>`
(the goal: at most 0.03).

    python benchmarks/tracer_overhead.py [--pairs 5] [--iters 30] [--batch-size 4] [--accum 4] [--noise]

--noise: with the noise scale's measurement too (a hook on each parameter), as a [program] trial at k >= 2 runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchsweep.sweeps.launch import observed  # noqa: E402

# The child: the example's model and batches, its loop body, timed after WARMUP windows.
CHILD = '''import sys, time, torch
sys.path.insert(0, sys.argv[1])
import gpt_subject as g
torch.set_default_dtype(torch.float64); torch.set_num_threads(1); torch.manual_seed(0)
b, k, iters = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
stream = torch.randint(0, g.VOCAB, (20000,))
model = g.TinyGPT()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
def batch():
    ix = torch.randint(len(stream) - g.BLOCK - 1, (b,))
    return torch.stack([stream[i:i + g.BLOCK] for i in ix]), torch.stack([stream[i + 1:i + 1 + g.BLOCK] for i in ix])
def window():
    for _ in range(k):
        loss = model(*batch())[1] / k
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
for _ in range(5):
    window()
start = time.perf_counter()
for _ in range(iters):
    window()
print((time.perf_counter() - start) / (iters * k))
'''


def micro_batch_s(traced: bool, args: argparse.Namespace, folder: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("BATCHSWEEP_TRACE", None)
    if traced:
        env.update(observed.environment(folder, noise=args.noise))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "examples" / "audit"), str(args.batch_size),
                           str(args.accum), str(args.iters)], env=env, capture_output=True, text=True, check=True)
    if traced and observed.read(folder) is None:
        raise SystemExit("the tracer saw nothing: no figure")
    return float(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--noise", action="store_true")
    args = parser.parse_args()
    shares = []
    with tempfile.TemporaryDirectory() as folder:
        for pair in range(args.pairs):
            plain = micro_batch_s(False, args, Path(folder))
            traces = Path(folder) / str(pair)  # each traced run's own, so that its trace is its alone
            traces.mkdir()
            traced = micro_batch_s(True, args, traces)
            shares.append(traced / plain - 1)
            print(f"pair {pair + 1}: {plain * 1e3:.2f} ms a micro-batch plain, {traced * 1e3:.2f} ms traced "
                  f"({shares[-1]:+.1%})", flush=True)
    if not shares:
        sys.exit("measured nothing")
    print(f"overhead_share_median={statistics.median(shares):.4f}")
    print(f"overhead={statistics.median(shares):.4f}")


if __name__ == "__main__":
    main()
