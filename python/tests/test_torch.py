"""The ops on torch tensors through DLPack (skipped where torch is not installed): bf16 inputs, outputs written into
the caller's torch tensors (same data pointer), and CUDA tensors refused with a message naming the tensor."""
import numpy as np
import pytest

import dsacp

torch = pytest.importorskip("torch")


def case(dtype):
    g = torch.Generator().manual_seed(5)
    T, H, Dl, Dr, ps, K = 3, 4, 32, 8, 4, 5
    latent = torch.randn(6, ps, Dl, generator=g).to(dtype)
    rope = torch.randn(6, ps, Dr, generator=g).to(dtype)
    q_nope = torch.randn(T, H, Dl, generator=g).to(dtype)
    q_rope = torch.randn(T, H, Dr, generator=g).to(dtype)
    block_table = torch.tensor([[3, 1, 5, 0]], dtype=torch.int32)
    key_len = torch.tensor([16, 9, 2], dtype=torch.int32)
    topk = torch.tensor([[0, 4, 7, 12, 15], [1, 2, 8, -1, -1], [0, 1, -1, -1, -1]], dtype=torch.int32)
    return q_nope, q_rope, latent, rope, block_table, torch.zeros(T, dtype=torch.int32), key_len, topk


def test_bf16_inputs_and_torch_outputs_in_place():
    args = case(torch.bfloat16)
    out = torch.empty(3, 4, 32, dtype=torch.bfloat16)
    lse = torch.empty(3, 4, dtype=torch.float32)
    o, l = dsacp.sparse_mla(*args, 0.2, out=out, lse=lse)
    assert o is out and l is lse and o.data_ptr() == out.data_ptr()
    ref, ref_lse = dsacp.sparse_mla(*[a.float() if a.is_floating_point() else a for a in args], 0.2)
    rel = np.linalg.norm(out.float().numpy() - ref) / np.linalg.norm(ref)
    assert rel < 1e-2  # the contract's bf16 bound (inputs are the same bf16 values; out rounded to bf16)
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=1e-5, atol=1e-5)


def test_non_contiguous_torch_tensor_refused():
    args = list(case(torch.float32))
    args[0] = torch.randn(4, 3, 32).transpose(0, 1)  # [3, 4, 32], not contiguous
    with pytest.raises(ValueError, match="'q_nope' is not contiguous"):
        dsacp.sparse_mla(*args, 0.2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensor_refused_with_its_name():
    args = list(case(torch.float32))
    args[0] = args[0].cuda()
    with pytest.raises(ValueError, match="'q_nope' is on a device"):
        dsacp.sparse_mla(*args, 0.2)
