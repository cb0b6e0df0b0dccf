"""A Hugging Face Trainer script as people write them, swept by batchsweep's [program] (study.toml here).

A small BERT classifier built from a config (random weights, no download) learns whether a sequence's first
token is smaller than its last, on sequences of varying length padded per batch. The only lines for batchsweep are in
JsonLines: the Trainer's evaluation and training logs printed as JSON lines. `model` and `datasets` are the same
model and data as factories that batchsweep's own trainer takes (noise_trainer.toml here), so the two can be compared.

    python train.py --batch-size 16 --accum 2 --lr 2e-3 --seed 0 --epochs 3
"""
import argparse
import json
import os
import tempfile

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments


def make_data(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(8, 25, (1,), generator=g))
        ids = torch.randint(1, 16, (length,), generator=g)
        rows.append({"input_ids": ids.tolist(), "labels": int(ids[0] < ids[-1])})
    return rows


def collate(rows: list[dict]) -> dict:
    """Pad to the longest sequence of the batch; the mask says which tokens are real."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([r["labels"] for r in rows])}


class JsonLines(TrainerCallback):
    """What batchsweep reads: {"step": ..., "loss": ...} per logging step, {"epoch": ..., "val_acc": ...} per
    evaluation."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            print(json.dumps({"step": state.global_step, "loss": logs["loss"]}), flush=True)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        print(json.dumps({"epoch": round(state.epoch), "val_acc": metrics["eval_accuracy"],
                          "val_loss": metrics["eval_loss"]}), flush=True)


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def model(**_) -> BertForSequenceClassification:
    config = BertConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2)
    return BertForSequenceClassification(config)


def datasets(seed: int = 0, train_size: int = 512, **_) -> tuple:
    """(train, test, collate) for batchsweep's trainer: `--dataset examples.hf_trainer.train:datasets`."""
    return Rows(make_data(train_size, seed)), Rows(make_data(512, 10_000)), collate


def noise_datasets(seed: int = 0, **_) -> tuple:
    """The data of noise.toml's runs (`--train-size 4096`), for noise_trainer.toml."""
    return datasets(seed, 4096)


def accuracy(prediction) -> dict:
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--train-size", type=int, default=512)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    training = TrainingArguments(
        output_dir=os.path.join(tempfile.gettempdir(), "hf-trainer-example"),
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.accum, learning_rate=args.lr,
        num_train_epochs=args.epochs, seed=args.seed, eval_strategy="epoch", logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, disable_tqdm=True, per_device_eval_batch_size=256)
    train, test, _ = datasets(args.seed, args.train_size)
    trainer = Trainer(model=model(), args=training, train_dataset=train, eval_dataset=test, data_collator=collate,
                      compute_metrics=accuracy, callbacks=[JsonLines()])
    trainer.train()


if __name__ == "__main__":
    main()
