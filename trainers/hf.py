"""`hf:NAME` or `hf:PATH`: a transformers model built from a config, with random initial weights and no download
(the optional `hf` extra). NAME is one of the tiny configs below; PATH a config.json, or a folder holding one.

The model class is the config's first `architectures` entry, else a causal language model. A named config's
vocabulary is the dataset's class count (its tokens); a config of the user's keeps its own, which must cover
them. The loss is the built-in (sum, count) over the labels the causal shift keeps (trainers/batches.py),
divided by their count over the whole window."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from torch import nn

from .errors import ConfigError

# Two layers of width 64: a few hundred thousand parameters with a byte vocabulary. No dropout (nanoGPT's
# default), so that (b, k) and (b*k, 1) from the same start can be compared step for step.
TINY = {
    "gpt2-tiny": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 128,
                  "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": None,
                  "eos_token_id": None},  # (GPT-2's are token 50256: outside a small vocabulary)
    "llama-tiny": {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128},
}


def _config_file(name: str) -> Path:
    path = Path(name).expanduser()
    return path / "config.json" if path.is_dir() else path


def check(spec: str) -> None:
    """One line for an `hf:` model that cannot be built, before anything runs."""
    name = spec[len("hf:"):]
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(f"model {spec!r} needs the transformers package: pip install -e '.[hf]'")
    if name not in TINY and not _config_file(name).is_file():
        raise ConfigError(f"model {spec!r}: {name!r} is neither a named config ({', '.join(TINY)}) nor a "
                          f"config.json or a folder holding one")


def build(spec: str, num_classes: int) -> nn.Module:
    import transformers

    name = spec[len("hf:"):]
    if name in TINY:
        values = dict(TINY[name])
        config = transformers.AutoConfig.for_model(values.pop("model_type"), vocab_size=num_classes, **values)
    else:
        config = transformers.AutoConfig.from_pretrained(str(_config_file(name)))
        if getattr(config, "vocab_size", num_classes) < num_classes:
            raise ConfigError(f"model {spec!r} has a vocabulary of {config.vocab_size} and the dataset "
                              f"{num_classes} tokens: give a config with vocab_size >= {num_classes}")
    architecture = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, architecture, None) if architecture else None
    if cls is None:
        return transformers.AutoModelForCausalLM.from_config(config)
    return cls(config)
