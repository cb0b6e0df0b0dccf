"""transformers' own accumulation, as `batchsweep audit` checks it (docs/audit.md): a small GPT-2 built from a
config (random weights, no download, no dropout) trained by Trainer(gradient_accumulation_steps=k) in float64
with plain SGD and its default linear decay of the learning rate, on sequences of 4 to 16 tokens padded per batch (labels -100 on the
padding), so that micro-batches hold different numbers of tokens.

    batchsweep audit --study examples/audit/hf.toml --physical-batch 4 --accum-steps 4
"""
import argparse
import inspect
import json
import os
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

VOCAB = 32


def sequences(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(1234)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, 17, (1,), generator=g))
        start = int(torch.randint(1, VOCAB, (1,), generator=g))
        ids = [(start + 3 * i) % (VOCAB - 1) + 1 for i in range(length)]  # a rule worth learning
        rows.append({"input_ids": ids})
    return rows


def collate(rows: list[dict]) -> dict:
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class LossRows(TrainerCallback):
    """One {"step", "loss", "lr"} row per optimizer step: the loss and learning rate the Trainer logs."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            print(json.dumps({"step": state.global_step, "loss": logs["loss"], "lr": logs["learning_rate"]}),
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--accum", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--dropout", default="off", choices=["off", "default"],
                   help="default: GPT-2's config dropouts as transformers sets them (0.1 each)")
    p.add_argument("--train-size", type=int, default=200)
    p.add_argument("--average-tokens", default="yes", choices=["yes", "no"],
                   help="under torchrun: average_tokens_across_devices (the Trainer's default: yes)")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.set_default_dtype(torch.float64)  # (transformers before 4.46 builds GPT-2's masks in the default dtype)
    off = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if args.dropout == "off" else {}
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, **off)
    model = GPT2LMHeadModel(config).double()
    # (average_tokens_across_devices came in 4.46; the Trainer before it has no such argument)
    across = ({"average_tokens_across_devices": args.average_tokens == "yes"}
              if "average_tokens_across_devices" in inspect.signature(TrainingArguments).parameters else {})
    training = TrainingArguments(
        output_dir=os.path.join(tempfile.gettempdir(), "hf-audit-subject"), per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accum, learning_rate=args.lr, num_train_epochs=args.epochs,
        max_steps=args.max_steps or -1, seed=args.seed, optim="sgd", lr_scheduler_type="linear", weight_decay=0.0,
        max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, **across)
    trainer = Trainer(model=model, args=training, train_dataset=sequences(args.train_size), data_collator=collate,
                      callbacks=[LossRows()])
    trainer.train()
    torch.save(model.state_dict(), os.environ["BATCHSWEEP_STATE"])


if __name__ == "__main__":
    main()
