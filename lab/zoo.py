"""Small models and deterministic data for rehearsals, tests, sample traces and the demo.

Everything here runs on a CPU in seconds and needs nothing from the network: the classification
tasks are drawn from a fixed random teacher, and the text corpus is the source code of Python's
own standard library, read as bytes.
"""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (ids, inputs, targets)


def mlp(d_in: int = 32, hidden: int = 64, depth: int = 3, n_classes: int = 10,
        activation: str = "relu") -> nn.Sequential:
    """A plain MLP: `depth` hidden Linear+activation pairs, then a Linear head."""
    act = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "gelu": nn.GELU}[activation]
    layers: list[nn.Module] = []
    width = d_in
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), act()]
        width = hidden
    layers.append(nn.Linear(width, n_classes))
    return nn.Sequential(*layers)


def cnn(channels: int = 8, n_classes: int = 10, size: int = 16, batchnorm: bool = False) -> nn.Sequential:
    """A small CNN for 1×size×size images: two conv+ReLU stages, pooling, a Linear head.

    `batchnorm`: conv → BatchNorm → ReLU stages (conv without bias), the ResNet pattern.
    """
    if batchnorm:
        return nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1, bias=False), nn.BatchNorm2d(2 * channels), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * channels * (size // 2) ** 2, n_classes),
        )
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * channels * (size // 2) ** 2, n_classes),
    )


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential()
        self.mlp.add_module("c_fc", nn.Linear(cfg.n_embd, 4 * cfg.n_embd))
        self.mlp.add_module("gelu", nn.GELU())
        self.mlp.add_module("c_proj", nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A GPT-2-shaped character model (pre-norm blocks, learned positions, untied head)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


class MLP(nn.Module):
    """nanoGPT's MLP: the activation and the dropout are modules of their own."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class ParallelBlock(nn.Module):
    """GPT-J's block layout: attention and MLP read one normalised input side by side."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return x + self.attn(h) + self.mlp(h)


class ParallelGPT(nn.Module):
    """A GPT of another layout than `TinyGPT`: parallel blocks, and the head tied to the token
    embedding (nanoGPT's weight tying: the head owns no parameter of its own)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(0.0)
        self.h = nn.ModuleList(ParallelBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


class RMSNorm(nn.Module):
    """Llama's normalisation: scale by the root mean square, no mean subtracted, no bias."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of (B, nh, T, hs) by the angles' cos and sin, (T, hs)."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.o_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = 8 * cfg.n_embd // 3
        self.gate_proj = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, cfg.n_embd, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(LlamaLayer(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd)


class TinyLlama(nn.Module):
    """A Llama-shaped model (RMSNorm, SwiGLU, rotary positions, no biases), with the module
    names of Hugging Face's `LlamaForCausalLM` (`model.layers.0.self_attn.k_proj`)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        hs = cfg.n_embd // cfg.n_head
        angles = torch.outer(torch.arange(cfg.block_size).float(),
                             10000.0 ** (-torch.arange(0, hs, 2).float() / hs))  # (T, hs/2)
        angles = torch.cat((angles, angles), dim=-1)  # (T, hs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.model.embed_tokens(idx)  # (B, T, C)
        for layer in self.model.layers:
            x = layer(x, self.cos[:T], self.sin[:T])
        return self.lm_head(self.model.norm(x))  # (B, T, vocab)


# --- data -------------------------------------------------------------------------------------

def teacher_classification(n: int = 4096, d_in: int = 32, n_classes: int = 10,
                           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian inputs labelled by a fixed random two-layer teacher: learnable, not trivial."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w1 = torch.randn(d_in, 64, generator=g) / math.sqrt(d_in)
    w2 = torch.randn(64, n_classes, generator=g) / 8.0
    return x, (torch.tanh(x @ w1) @ w2).argmax(1)


def blob_images(n: int = 2048, size: int = 16, n_classes: int = 10,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """1×size×size images: a Gaussian blob whose position encodes the class, plus noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, n_classes, (n,), generator=g)
    centres = torch.stack([torch.arange(n_classes) % 5, torch.arange(n_classes) // 5], 1).float()
    centres = 2.5 + centres * torch.tensor([(size - 5) / 4, size - 5.0])
    grid = torch.stack(torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij"), -1).float()
    d2 = ((grid[None] - centres[y][:, None, None, :]) ** 2).sum(-1)  # (n, size, size)
    x = torch.exp(-d2 / 6.0) + 0.3 * torch.randn(n, size, size, generator=g)
    return x[:, None], y


def stdlib_text(max_bytes: int = 400_000) -> bytes:
    """Source code of Python's standard library, concatenated in a fixed order, as a corpus."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def char_corpus(max_bytes: int = 400_000, vocab_size: int = 96) -> torch.Tensor:
    """The stdlib corpus as token ids: printable ASCII mapped to 1..95, everything else to 0."""
    raw = torch.frombuffer(bytearray(stdlib_text(max_bytes)), dtype=torch.uint8).long()
    ids = raw - 31
    return torch.where((ids >= 1) & (ids < vocab_size), ids, torch.zeros_like(ids))


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int = 0) -> Iterator[Batch]:
    """Endless shuffled minibatches of a fixed dataset, with the sample ids of each batch."""
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(x), generator=g)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            ids = order[i:i + batch_size]
            yield ids, x[ids], y[ids]


def text_batches(tokens: torch.Tensor, batch_size: int, block_size: int,
                 seed: int = 0) -> Iterator[Batch]:
    """Endless random windows of the corpus; a sample's id is its start offset."""
    g = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(0, len(tokens) - block_size - 1, (batch_size,), generator=g)
        offsets = ids[:, None] + torch.arange(block_size)
        yield ids, tokens[offsets], tokens[offsets + 1]
