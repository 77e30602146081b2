"""A small causal transformer whose attention is an AttentionEngine or SDPA, and its training
loop: what issue 20's compile tests train, on the CPU (reference executor, fp32, aot_eager) and
on a Hopper GPU (the kernels, bf16 autocast, inductor)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from engine import AttentionEngine, OnlineSoftmax, meta_tensor


class Block(nn.Module):
    """Pre-norm attention + MLP; causal attention by the engine or by SDPA."""

    def __init__(self, dim: int, heads: int, seqlen: int, batch: int, use_engine: bool,
                 attn_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.heads, self.dh = heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.attn = None
        if use_engine:
            meta = tuple(meta_tensor(batch, heads, seqlen, self.dh, dtype=attn_dtype)
                         for _ in range(3))
            self.attn = AttentionEngine(
                meta, score_mod=lambda s, b, h, q, kv: s * self.dh**-0.5,
                mask_mod=lambda b, h, q, kv: q >= kv, online_func=OnlineSoftmax())

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, self.dh).unbind(2)
        if self.attn is not None:
            a = self.attn(q, k, v)
        else:
            a = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                               is_causal=True).transpose(1, 2)
        x = x + self.proj(a.reshape(B, S, -1))
        return x + self.mlp(self.norm2(x))


def model(use_engine: bool, dim: int = 32, heads: int = 4, seqlen: int = 16, batch: int = 4,
          vocab: int = 50, layers: int = 2, attn_dtype: torch.dtype = torch.float32,
          device: str = "cpu") -> nn.Sequential:
    """The same initial weights for the engine's model and SDPA's (seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(vocab, dim),
        *(Block(dim, heads, seqlen, batch, use_engine, attn_dtype) for _ in range(layers)),
        nn.LayerNorm(dim), nn.Linear(dim, vocab)).to(device)


def batches(steps: int, batch: int, seqlen: int, vocab: int, counting: bool = False,
            device: str = "cpu") -> list[torch.Tensor]:
    """`steps` token batches of seqlen + 1 tokens: uniform random, or (`counting`) each row
    counting from a random start by a random stride of 1 to 3 (mod vocab), which the previous
    two tokens predict: a task attention learns in a few dozen steps."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        if counting:
            start = torch.randint(0, vocab, (batch, 1), generator=g)
            stride = torch.randint(1, 4, (batch, 1), generator=g)
            t = (start + stride * torch.arange(seqlen + 1)) % vocab
        else:
            t = torch.randint(0, vocab, (batch, seqlen + 1), generator=g)
        out.append(t.to(device))
    return out


def train(net: nn.Module, data: list[torch.Tensor], vocab: int, compiled: bool,
          backend: str = "inductor", optimizer: str = "sgd", lr: float = 0.1,
          autocast: torch.dtype | None = None) -> list[float]:
    """The loss of each step (next-token cross-entropy), the model `compiled` with
    fullgraph=True or eager; `autocast`: the mixed-precision dtype on the GPU."""
    opt = (torch.optim.SGD(net.parameters(), lr=lr) if optimizer == "sgd"
           else torch.optim.Adam(net.parameters(), lr=lr))
    fn = torch.compile(net, fullgraph=True, backend=backend) if compiled else net
    losses = []
    for tokens in data:
        ctx = (torch.autocast(tokens.device.type, dtype=autocast) if autocast is not None
               else contextlib.nullcontext())
        with ctx:
            logits = fn(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
