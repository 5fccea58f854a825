"""flash_metal inside torch.compile(fullgraph=True) models."""
import torch

from models import Block


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
