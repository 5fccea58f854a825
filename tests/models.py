"""Small models the compile and training tests share."""
import torch
import torch.nn.functional as F

import flash_metal


class Block(torch.nn.Module):
    """A small pre-norm transformer block with grouped-query attention."""

    def __init__(self, dim=64, heads=4, kv_heads=2, use_flash=True):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd)
        self.proj = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.use_flash = use_flash

    def forward(self, x):
        B, N, C = x.shape
        h = self.norm1(x)
        # (B, N, H, D) viewed as (B, H, N, D): strided, read in place by the op.
        q = self.q(h).view(B, N, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(B, N, 2, self.kv_heads, self.hd).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.use_flash:
            a = flash_metal.attention(q, k, v, causal=True)
        else:
            g = self.heads // self.kv_heads
            a = F.scaled_dot_product_attention(
                q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True
            )
        x = x + self.proj(a.transpose(1, 2).reshape(B, N, C))
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    """A two-block causal language model with grouped-query attention (4 query heads, 2 kv heads)."""

    def __init__(self, vocab=97, dim=64, blocks=2, use_flash=True):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, use_flash=use_flash) for _ in range(blocks))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)

    def set_flash(self, use_flash):
        for b in self.blocks:
            b.use_flash = use_flash

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))
