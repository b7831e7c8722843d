"""Token rounding on a CUDA device against the CPU path."""

import pytest
import torch

import sonic

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rounding", ["nearest", "up", "down"])
def test_token_rounding_cuda_matches_cpu(rounding):
    g = torch.Generator().manual_seed(5)
    for quantum in (None, 0.5, None):
        logits = torch.randn(700, 48, generator=g)
        if quantum:
            logits = (logits / quantum).round() * quantum
        cpu_logits = logits.double().requires_grad_()
        cuda_logits = logits.double().cuda().requires_grad_()
        # backend="torch": the same token choice as the CPU (the top-K kernel treats logits
        # within 2**-17 relative as tied).
        mine = sonic.token_rounding_routing(cuda_logits.float(), 4, tile=32, rounding=rounding,
                                            backend="torch")
        ref = sonic.token_rounding_routing(cpu_logits.float(), 4, tile=32, rounding=rounding)
        assert torch.equal(mine.token_idx.cpu(), ref.token_idx)
        assert torch.equal(mine.expert_idx.cpu(), ref.expert_idx)
        torch.testing.assert_close(mine.scores.cpu(), ref.scores)
        weights = torch.randn(ref.num_pairs, generator=g)
        (mine.scores * weights.cuda()).sum().backward()
        (ref.scores * weights).sum().backward()
        # fp32 scores: the gradients agree to fp32 rounding, summed in another order.
        torch.testing.assert_close(cuda_logits.grad.cpu(), cpu_logits.grad, rtol=1e-5, atol=1e-6)
