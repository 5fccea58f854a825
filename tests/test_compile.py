"""flash_metal inside torch.compile(fullgraph=True) models."""
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


def test_compiled_block_matches_eager_and_sdpa():
    torch.manual_seed(0)
    block = Block().eval()
    x = torch.randn(2, 37, 64)
    with torch.inference_mode():
        eager = block(x)
        compiled = torch.compile(block, fullgraph=True, backend="inductor")(x)
        block.use_flash = False
        sdpa = block(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager, sdpa, rtol=1e-4, atol=1e-4)


def test_compile_dynamic_shapes_no_graph_break():
    torch.manual_seed(1)
    block = Block().eval()
    counts = torch._dynamo.utils.counters
    counts.clear()
    fn = torch.compile(block, fullgraph=True, dynamic=True)
    with torch.inference_mode():
        for n in (5, 19, 64):
            x = torch.randn(1, n, 64)
            torch.testing.assert_close(fn(x), block(x), rtol=1e-5, atol=1e-5)
    assert not counts["graph_break"], dict(counts["graph_break"])
