"""The hybrid targets' kernels: the gated delta rule and the Mamba2 (SSD) scan against transformers' torch paths
and each other (chunked vs token by token), the causal conv against its tree twin, and per-node tree states
against sequential paths."""

import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen3_next

from fastspec.models import gated_delta as gd
from fastspec.models import recurrent, ssd


def random_inputs(B=2, T=37, H=4, Dk=8, Dv=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, Dk, generator=gen), torch.randn(B, T, H, Dk, generator=gen)
    v = torch.randn(B, T, H, Dv, generator=gen)
    g, beta = -torch.rand(B, T, H, generator=gen), torch.rand(B, T, H, generator=gen)
    return q, k, v, g, beta, torch.randn(B, H, Dk, Dv, generator=gen)


def test_delta_rule_kernels_match_transformers_and_each_other():
    q, k, v, g, beta, state = random_inputs()
    expected, expected_state = hf_qwen3_next.torch_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn, kn = hf_qwen3_next.l2norm(q), hf_qwen3_next.l2norm(k)
    qn = qn * q.shape[-1] ** -0.5
    chain = torch.arange(q.shape[1]).expand(q.shape[0], -1) - 1
    for name, (o, s) in {"recurrent": gd.recurrent(qn, kn, v, g, beta, state),
                         "chunked": gd.chunked(qn, kn, v, g, beta, state, chunk=16),
                         "tree": gd.tree(qn, kn, v, g, beta, state, chain)}.items():
        s = s[:, -1] if name == "tree" else s  # the tree keeps every node's state: the chain's last is the final
        torch.testing.assert_close(o, expected, atol=1e-5, rtol=1e-4, msg=name)
        torch.testing.assert_close(s, expected_state, atol=1e-5, rtol=1e-4, msg=name)


def test_ssd_kernels_match_transformers_and_each_other():
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    gen = torch.Generator().manual_seed(2)
    B, T, H, P, N, G = 2, 37, 4, 6, 8, 2
    x, dt_raw = torch.randn(B, T, H, P, generator=gen), torch.randn(B, T, H, generator=gen)
    Bg, Cg = torch.randn(B, T, G, N, generator=gen), torch.randn(B, T, G, N, generator=gen)
    A, D, dt_bias = -2 * torch.rand(H, generator=gen), torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    state = torch.randn(B, H, P, N, generator=gen)
    expected, expected_state = mamba2_chunk_scan(x, dt_raw, A, Bg, Cg, chunk_size=16, D=D, dt_bias=dt_bias,
                                                 initial_states=state, dt_softplus=True, return_final_states=True)
    dt = torch.nn.functional.softplus(dt_raw + dt_bias)
    Bm, Cm = Bg.repeat_interleave(H // G, 2), Cg.repeat_interleave(H // G, 2)
    chain = torch.arange(T).expand(B, -1) - 1
    for name, (y, s) in {"recurrent": ssd.recurrent(x, dt, A, Bm, Cm, D, state),
                         "chunked": ssd.chunked(x, dt, A, Bm, Cm, D, state, chunk=16),
                         "tree": ssd.tree(x, dt, A, Bm, Cm, D, state, chain)}.items():
        s = s[:, -1] if name == "tree" else s
        torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4, msg=name)
        torch.testing.assert_close(s, expected_state, atol=1e-4, rtol=1e-4, msg=name)


def test_conv_matches_transformers_and_its_tree_twin():
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(2, 9, 6, generator=gen), torch.randn(6, 4, generator=gen)
    y, window = recurrent.conv(x, weight, None, torch.zeros(2, 6, 3))
    expected = hf_qwen3_next.causal_conv1d_fn(x.transpose(1, 2), weight, None, activation="silu").transpose(1, 2)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(window, x[:, -3:].transpose(1, 2))
    head, tail = recurrent.conv(x[:, :5], weight, None, torch.zeros(2, 6, 3))  # two chunks, the window between
    y_tree, windows = recurrent.conv_tree(x[:, 5:], weight, None, tail, torch.arange(4).expand(2, -1) - 1)
    torch.testing.assert_close(torch.cat([head, y_tree], 1), y)
    torch.testing.assert_close(windows[:, -1], window)


def test_a_conv_tree_node_rounds_as_its_decode_step_in_bfloat16():
    """Each node of a bfloat16 tree computes bit for bit the decode step of its token after its path (plain decoding
    runs the convolution one token at a time). Before, the tree rounded every tap's product to bfloat16 where the
    decode step's conv1d accumulates them exactly, so a bfloat16 Qwen3-Next / Bamba target's speculative output
    left its target-only output within 20 tokens in 4 of 7 requests."""
    gen = torch.Generator().manual_seed(2)
    x, weight, bias, window = (torch.randn(*shape, generator=gen).bfloat16()
                               for shape in ((3, 5, 16), (16, 4), (16,), (3, 16, 3)))
    parents = torch.tensor([-1, 0, 0, 1, 3]).expand(3, -1)  # a branch at the root's child
    y_tree, windows = recurrent.conv_tree(x, weight, bias, window, parents)
    for i, path in enumerate(([0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 3, 4])):
        w = window
        for node in path:  # decode steps along the path
            y, w = recurrent.conv(x[:, node:node + 1], weight, bias, w)
        assert torch.equal(y_tree[:, i], y[:, 0]) and torch.equal(windows[:, i], w), i


def test_a_conv_rows_output_does_not_depend_on_its_batch():
    """A request's decode-step convolution in float32 is the same alone and in a batch of any size: the SiLU is
    taken over channels padded to 64 values, since torch's CPU kernel rounds its scalar tail otherwise than its
    vector loop (20 channels: a row's bits followed its place in the flat [B, C] tensor)."""
    gen = torch.Generator().manual_seed(3)
    x, weight, window = (torch.randn(*shape, generator=gen) * 3 for shape in ((7, 1, 20), (20, 4), (7, 20, 3)))
    batched, _ = recurrent.conv(x, weight, None, window)
    alone = torch.cat([recurrent.conv(x[b:b + 1], weight, None, window[b:b + 1])[0] for b in range(7)])
    assert torch.equal(batched, alone)


def test_an_ssd_step_does_not_depend_on_its_batch():
    """A request's SSD decode step (or tree node) in float32 is the same alone and in a batch: S C as a batched
    matrix-vector product (torch's einsum contracted it another way for one request, at Bamba's d_state 128)."""
    gen = torch.Generator().manual_seed(4)
    B, H, P, N = 4, 16, 64, 128
    S, x, Bm, Cm = (torch.randn(*shape, generator=gen) for shape in ((B, H, P, N), (B, H, P), (B, H, N), (B, H, N)))
    dt, A, D = torch.rand(B, H, generator=gen), -torch.rand(H, generator=gen), torch.randn(H, generator=gen)
    state, y = ssd._step(S, x, dt, A, Bm, Cm, D)
    for b in range(B):
        one = ssd._step(S[b:b + 1], x[b:b + 1], dt[b:b + 1], A, Bm[b:b + 1], Cm[b:b + 1], D)
        assert torch.equal(one[0], state[b:b + 1]) and torch.equal(one[1], y[b:b + 1]), b


def test_tree_node_states_equal_their_paths():
    """Every node's output and state equal a sequential run over the root ... node path; parents from a mask."""
    parents = torch.tensor([[-1, 0, 0, 1, 2, 1, 4]])
    mask = torch.eye(7, dtype=torch.bool)[None].clone()
    for i in range(7):
        j = int(parents[0, i])
        while j >= 0:
            mask[0, i, j], j = True, int(parents[0, j])
    assert torch.equal(recurrent.tree_parents(mask), parents)
    q, k, v, g, beta, state = random_inputs(B=1, T=7)
    o, states = gd.tree(q, k, v, g, beta, state, parents)
    for i in range(7):
        path = mask[0, i].nonzero().flatten()  # ancestors in node order, then i
        o_path, s_path = gd.recurrent(q[:, path], k[:, path], v[:, path], g[:, path], beta[:, path], state)
        torch.testing.assert_close(o[:, i], o_path[:, -1])
        torch.testing.assert_close(states[:, i], s_path)
