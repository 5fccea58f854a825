"""Training through flash_metal: a small GQA language model, eager, compiled and against SDPA."""
import copy

import pytest
import torch
import torch.nn.functional as F

from models import TinyLM

STEPS = 6


def _train(model, tokens, compiled=False):
    """Loss after each of STEPS AdamW steps of next-token prediction, and the final weights."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def step(tokens):
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    fn = torch.compile(step, fullgraph=True) if compiled else step
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = fn(tokens)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


@pytest.fixture(scope="module")
def runs():
    torch.manual_seed(0)
    base = TinyLM()
    tokens = torch.randint(0, 97, (3, 41), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, flash, compiled in (("flash", True, False), ("compiled", True, True), ("sdpa", False, False)):
        model = copy.deepcopy(base)
        model.set_flash(flash)
        out[name] = _train(model, tokens, compiled)
    return out


def test_loss_curves_match(runs):
    flash, compiled, sdpa = (runs[n][0] for n in ("flash", "compiled", "sdpa"))
    # It learns (the loss falls), and all three curves agree: float32 end to
    # end, so differences are rounding amplified by six optimizer steps.
    assert flash[-1] < flash[0] - 0.1
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(flash), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.tensor(flash), torch.tensor(sdpa), rtol=1e-4, atol=1e-4)


def test_first_step_gradients_match_sdpa():
    # Every parameter's gradient of one step, flash vs SDPA (after AdamW
    # steps the weights are no test: Adam divides by sqrt of the squared
    # gradient, so a near-zero bias gradient's rounding moves it by ~lr).
    torch.manual_seed(3)
    flash = TinyLM()
    sdpa = copy.deepcopy(flash)
    sdpa.set_flash(False)
    tokens = torch.randint(0, 97, (2, 29), generator=torch.Generator().manual_seed(4))
    for model in (flash, sdpa):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    for (name, a), (_, b) in zip(flash.named_parameters(), sdpa.named_parameters()):
        scale = b.grad.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_compiled_training_has_no_graph_break():
    torch.manual_seed(2)
    model = TinyLM()
    counts = torch._dynamo.utils.counters
    counts.clear()
    tokens = torch.randint(0, 97, (2, 17))
    loss = torch.compile(lambda t: model(t).square().mean(), fullgraph=True)(tokens)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert not counts["graph_break"], dict(counts["graph_break"])
