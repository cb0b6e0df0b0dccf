"""gpt: a small causal transformer language model (about 0.1-1 M parameters), for token workloads such as
the `pytext` dataset. Inputs are token ids (N, T) padded on the right, targets the next tokens with
IGNORE_INDEX at the padding: causal attention never lets padding reach an earlier position, so no mask is
needed beyond the causal one."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, t, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(n, t, width))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, width: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (N, T, vocab) for token ids (N, T)."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.norm(self.blocks(self.tokens(idx) + self.positions(positions))))


def gpt(input_shape, num_classes, **_) -> nn.Module:
    """Two layers of width 64 with 4 heads; the vocabulary is the dataset's class count."""
    (context,) = input_shape
    return GPT(num_classes, context)
