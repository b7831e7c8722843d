import pytest
import torch

import sonic

from _reference import naive_moe, random_problem

LAYOUTS = ["concat", "interleaved"]


def _ragged_pairs(T, E):
    """Tokens 0..2 get no expert, experts 0 and E-1 get no token, the rest ragged."""
    def make(g):
        tok, exp = [], []
        for t in range(3, T):
            k = int(torch.randint(1, 4, (1,), generator=g))
            choices = torch.randperm(E - 2, generator=g)[:k] + 1
            tok += [t] * len(choices)
            exp += choices.tolist()
        perm = torch.randperm(len(tok), generator=g)  # pairs in arbitrary order
        return torch.tensor(tok)[perm], torch.tensor(exp)[perm]
    return make


@pytest.mark.parametrize("gate_up", LAYOUTS)
@pytest.mark.parametrize("pairs", ["topk", "ragged"])
def test_gradcheck_float64(gate_up, pairs):
    gen = None if pairs == "topk" else _ragged_pairs(11, 6)
    x, w1, w2, s, tok, exp = random_problem(11, 8, 4, 6, K=2, dtype=torch.float64, seed=1,
                                            generator_pairs=gen)
    inputs = [t.requires_grad_() for t in (x, w1, w2, s)]

    def fn(x, w1, w2, s):
        return sonic.moe_experts(x, w1, w2, s, tok, exp, gate_up=gate_up, backend="torch")

    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("gate_up", LAYOUTS)
@pytest.mark.parametrize("shape", [(1, 16, 8, 4, 1), (67, 32, 16, 8, 2), (50, 16, 8, 16, 16)])
def test_matches_naive_float32(gate_up, shape):
    T, d, n, E, K = shape
    x, w1, w2, s, tok, exp = random_problem(T, d, n, E, K=K, seed=2)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, s)]
    naive = [t.clone().requires_grad_() for t in (x, w1, w2, s)]
    out = sonic.moe_experts(*leaves, tok, exp, gate_up=gate_up, backend="torch")
    ref = naive_moe(*naive, tok, exp, gate_up=gate_up)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for mine, theirs in zip(leaves, naive):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-5)


def test_one_expert_takes_all_tokens():
    T, d, n, E = 40, 16, 8, 8
    x, w1, w2, s, _, _ = random_problem(T, d, n, E, K=1, seed=3)
    tok = torch.arange(T, dtype=torch.int32)
    exp = torch.full((T,), 5, dtype=torch.int32)
    out = sonic.moe_experts(x, w1, w2, s, tok, exp, backend="torch")
    torch.testing.assert_close(out, naive_moe(x, w1, w2, s, tok, exp), rtol=1e-4, atol=1e-5)


def test_bfloat16_close_to_float32():
    x, w1, w2, s, tok, exp = random_problem(64, 32, 16, 8, K=2, seed=4)
    ref = naive_moe(x, w1, w2, s, tok, exp)
    out = sonic.moe_experts(x.bfloat16(), w1.bfloat16(), w2.bfloat16(), s, tok, exp, backend="torch")
    assert out.dtype == torch.bfloat16
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 1e-2


def test_empty_inputs():
    _, w1, w2, _, _, _ = random_problem(4, 8, 4, 3, seed=5)
    x = torch.randn(0, 8, requires_grad=True)
    empty_idx = torch.zeros(0, dtype=torch.int32)
    out = sonic.moe_experts(x, w1, w2, torch.zeros(0), empty_idx, empty_idx, backend="torch")
    assert out.shape == (0, 8)
    out.sum().backward()
    assert x.grad.shape == (0, 8)
    # tokens present but no pairs at all: zeros
    x = torch.randn(5, 8)
    out = sonic.moe_experts(x, w1, w2, torch.zeros(0), empty_idx, empty_idx, backend="torch")
    assert torch.equal(out, torch.zeros(5, 8))


def test_saved_tensors_are_x_h_and_metadata():
    T, d, n, E, K = 96, 64, 16, 8, 4
    x, w1, w2, s, tok, exp = random_problem(T, d, n, E, K=K, seed=6)
    leaves = [t.requires_grad_() for t in (x, w1, w2, s)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        sonic.moe_experts(*leaves, tok, exp, backend="torch")
    P = T * K
    caller = {t.untyped_storage().data_ptr() for t in leaves}
    new = [t for t in saved if t.untyped_storage().data_ptr() not in caller]
    assert any(t is x for t in saved), "x must be saved by reference, not copied"
    assert all(t.numel() < P * d for t in saved if t is not x), "nothing of size P·d may be kept"
    h_bytes = P * 2 * n * x.element_size()
    new_bytes = sum(t.numel() * t.element_size() for t in new)
    big = [t for t in new if t.numel() >= P * 2 * n]
    assert [tuple(t.shape) for t in big] == [(P, 2 * n)]           # H and nothing else large
    metadata_bytes = new_bytes - h_bytes
    assert 0 < metadata_bytes <= 6 * P * 4 + 2 * (T + E + 2) * 4     # O(P) int32 metadata


def test_deterministic():
    x, w1, w2, s, tok, exp = random_problem(80, 32, 16, 8, K=3, seed=7)

    def run():
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, s)]
        out = sonic.moe_experts(*leaves, tok, exp, backend="torch")
        out.backward(torch.ones_like(out))
        return [out] + [t.grad for t in leaves]

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


def test_inputs_not_modified():
    x, w1, w2, s, tok, exp = random_problem(20, 16, 8, 4, K=2, seed=8)
    copies = [t.clone() for t in (x, w1, w2, s, tok, exp)]
    leaves = [t.requires_grad_() for t in (x, w1, w2, s)]
    sonic.moe_experts(*leaves, tok, exp, backend="torch").sum().backward()
    for before, after in zip(copies, (x, w1, w2, s, tok, exp)):
        assert torch.equal(before, after.detach())


def test_auto_backend_falls_back_on_cpu():
    assert sonic.explain_backend("auto", "cpu").startswith("torch:")
    with pytest.raises(RuntimeError, match="cute"):
        x, w1, w2, s, tok, exp = random_problem(4, 8, 4, 2, K=1)
        sonic.moe_experts(x, w1, w2, s, tok, exp, backend="cute")
