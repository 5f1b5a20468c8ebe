"""A third-party-shaped GPT for the overhead benches: Karpathy's nanoGPT layout and training loop,
written fresh here, so the recorder is timed on a model it was not written against.

The layout a user's nanoGPT has, module path for module path: `transformer.wte/wpe/drop`,
`transformer.h[i].ln_1/attn.c_attn/attn.c_proj/ln_2/mlp.c_fc/mlp.gelu/mlp.c_proj` (dropouts
beside them), `transformer.ln_f`, a `LayerNorm` of its own with an optional bias, and `lm_head`
tied to `wte` (so `lm_head` owns no parameter). The forward takes the targets and returns
`(logits, loss)`. Its loop (`train_step`) is train.py's: two AdamW param groups (decay for the
matrices only), the lr set on every group each step, gradient accumulation, `clip_grad_norm_`,
`zero_grad(set_to_none=True)`, and, with `eval_interval`, train.py's `estimate_loss`: every so
many steps, `eval_iters` batches of each split in eval() mode under no_grad.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class NanoConfig:
    block_size: int = 64
    vocab_size: int = 65
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (torch's has none to turn off before 2.1)."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: NanoConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: NanoConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: NanoConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, cfg: NanoConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = idx.shape[1]
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay: float, lr: float) -> torch.optim.AdamW:
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.99))


def nanogpt_case(batch: int = 12, accum: int = 1, grad_clip: float = 1.0, dropout: float = 0.0,
                 n_layer: int = 4, n_embd: int = 128, block: int = 64, vocab: int = 96,
                 compiled: bool = False, ddp: bool = False, eval_interval: int = 0, eval_iters: int = 0
                 ) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], torch.Tensor]]:
    """The model, its optimizer and one training step as train.py makes it (lr schedule, micro-
    batches, clipping; `compiled`: the forward through `torch.compile(model)`, train.py's default;
    `eval_interval`: `estimate_loss` before every such step, the first included); the step returns
    the last micro-batch's loss. `vocab`: the head's width (the text's characters use the first 96
    ids)."""
    from warninglight.lab import zoo

    cfg = NanoConfig(block_size=block, vocab_size=vocab, n_layer=n_layer, n_head=4, n_embd=n_embd,
                     dropout=dropout)
    model = NanoGPT(cfg)
    if compiled:  # the two copies' graphs apart, whichever is compiled first (tracer/graphops.py)
        torch._dynamo.config.skip_nnmodule_hook_guards = False
    forward = torch.compile(model) if compiled else model
    opt = model.configure_optimizers(weight_decay=0.1, lr=1e-3)
    if ddp:  # inside DistributedDataParallel, in the process group there is (the model returned
        # is the wrapper, for the recorder to watch)
        forward = model = nn.parallel.DistributedDataParallel(forward)
    data = zoo.char_corpus(200_000)
    g = torch.Generator().manual_seed(0)
    it = [0]

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - block - 1, (batch,), generator=g)
        x = torch.stack([data[i:i + block] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + block] for i in ix])
        return x, y

    def lr_at(i: int, warmup: int = 20, max_lr: float = 1e-3, min_lr: float = 1e-4, decay: int = 2000) -> float:
        if i < warmup:
            return max_lr * (i + 1) / (warmup + 1)
        ratio = min(1.0, (i - warmup) / (decay - warmup))
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)

    @torch.no_grad()
    def estimate_loss(iters: int = eval_iters) -> list[float]:
        forward.eval()
        losses = [statistics.mean(forward(*get_batch())[1].item() for _ in range(iters))
                  for _split in ("train", "val")]  # one corpus here: two samples of it
        forward.train()
        return losses

    def train_step() -> torch.Tensor:
        if eval_interval and it[0] % eval_interval == 0:
            estimate_loss()
        lr = lr_at(it[0])
        it[0] += 1
        for group in opt.param_groups:
            group["lr"] = lr
        loss = torch.zeros(())
        for _ in range(accum):
            x, y = get_batch()
            _, loss = forward(x, y)
            (loss / accum).backward()
        if grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    train_step.evaluate = estimate_loss  # type: ignore[attr-defined]  # (bench/overhead.py --evaluations)
    train_step.get_batch = get_batch  # type: ignore[attr-defined]  # (bench/overhead_breakdown.py --phases)
    return model, opt, train_step
