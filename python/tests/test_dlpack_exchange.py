"""torch tensors read through DLPack's C exchange table (skipped where torch is not installed). Stock torch 2.11
publishes no table; torch-c-dlpack-ext (loaded by tvm-ffi, so by FlashInfer) sets one on torch.Tensor. Here a
table made with ctypes stands in for it, in a fresh process (dsacp looks the table up once): the ops read their
tensors through it (its calls are counted), give what the capsule path gives (nn.Parameter, a subclass, goes
that way), write outputs in place, fall back to the capsule path where the table refuses a tensor, still refuse a
non-contiguous tensor by name, and on CUDA take the current stream from the table."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch", reason="torch is not installed (CI has no CPU-only torch wheel to install)")

SCRIPT = textwrap.dedent(r'''
    import ctypes
    import numpy as np
    import torch

    class DLDevice(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]

    class DLDataType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]

    class DLTensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                    ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                    ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]

    class Version(ctypes.Structure):
        _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]

    class Header(ctypes.Structure):
        _fields_ = [("version", Version), ("prev_api", ctypes.c_void_p)]

    FROM_PY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(DLTensor))
    STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p))

    class Api(ctypes.Structure):  # dlpack.h's DLPackExchangeAPI
        _fields_ = [("header", Header), ("managed_tensor_allocator", ctypes.c_void_p),
                    ("managed_tensor_from_py_object_no_sync", ctypes.c_void_p),
                    ("managed_tensor_to_py_object_no_sync", ctypes.c_void_p),
                    ("dltensor_from_py_object_no_sync", FROM_PY), ("current_work_stream", STREAM)]

    CODES = {torch.float32: (2, 32), torch.bfloat16: (4, 16), torch.int32: (0, 32), torch.int64: (0, 64),
             torch.uint8: (1, 8)}
    calls = {"tensor": 0, "stream": 0}
    keep = []  # the shape / stride arrays handed out (they must outlive the call)

    def from_py(t, out):
        try:
            if getattr(t, "_refuse", False) or t.dtype not in CODES:
                return -1
            calls["tensor"] += 1
            d = out.contents
            d.data = t.data_ptr()
            d.device = DLDevice(2, t.device.index or 0) if t.is_cuda else DLDevice(1, 0)
            d.ndim = t.dim()
            d.dtype = DLDataType(*CODES[t.dtype], 1)
            shape = (ctypes.c_int64 * max(1, t.dim()))(*t.shape)
            strides = (ctypes.c_int64 * max(1, t.dim()))(*t.stride())
            keep.append((shape, strides))
            d.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
            d.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
            d.byte_offset = 0
            return 0
        except Exception:
            return -1

    def stream(device_type, device_id, out):
        try:
            calls["stream"] += 1
            out[0] = torch.cuda.current_stream(device_id).cuda_stream
            return 0
        except Exception:
            return -1

    api = Api()
    api.header.version.major, api.header.version.minor = 1, 2
    api.dltensor_from_py_object_no_sync = FROM_PY(from_py)
    api.current_work_stream = STREAM(stream)
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    torch.Tensor.__dlpack_c_exchange_api__ = new_capsule(ctypes.addressof(api), b"dlpack_exchange_api", None)

    import dsacp  # noqa: E402
    assert dsacp._dsacp._torch_dlpack_exchange(), "the table was not taken"

    def case(device):
        g = torch.Generator().manual_seed(5)
        T, H, Dl, Dr, ps, K = 3, 4, 32, 8, 4, 5
        latent = torch.randn(6, ps, Dl, generator=g)
        rope = torch.randn(6, ps, Dr, generator=g)
        q_nope = torch.randn(T, H, Dl, generator=g)
        q_rope = torch.randn(T, H, Dr, generator=g)
        block_table = torch.tensor([[3, 1, 5, 0]], dtype=torch.int32)
        key_len = torch.tensor([16, 9, 2], dtype=torch.int32)
        topk = torch.tensor([[0, 4, 7, 12, 15], [1, 2, 8, -1, -1], [0, 1, -1, -1, -1]], dtype=torch.int32)
        args = q_nope, q_rope, latent, rope, block_table, torch.zeros(T, dtype=torch.int32), key_len, topk
        return [a.to(device) for a in args]

    args = case("cpu")
    before = calls["tensor"]
    want = dsacp.sparse_mla(torch.nn.Parameter(args[0], requires_grad=False), *args[1:], 0.2)  # capsule path
    assert calls["tensor"] - before >= 7, calls  # the 7 plain tensors went through the table
    got = dsacp.sparse_mla(*args, 0.2)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    out = torch.empty(3, 4, 32)
    lse = torch.empty(3, 4)
    o, l = dsacp.sparse_mla(*args, 0.2, out=out, lse=lse)
    assert o is out and l is lse
    np.testing.assert_array_equal(out.numpy(), np.asarray(want[0]))
    refused = args[0].clone()
    refused._refuse = True  # the table says no: the capsule path takes it
    got = dsacp.sparse_mla(refused, *args[1:], 0.2)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    try:
        dsacp.sparse_mla(torch.randn(4, 3, 32).transpose(0, 1), *args[1:], 0.2)
        raise AssertionError("a non-contiguous tensor was taken")
    except ValueError as e:
        assert "q_nope" in str(e) and "stride" in str(e), str(e)
    if torch.cuda.is_available():
        g = torch.Generator().manual_seed(7)
        part_out, part_lse = torch.randn(2, 6, 512, generator=g), torch.randn(2, 6, generator=g)
        want = dsacp.lse_merge(part_out, part_lse)
        n_stream, n_tensor = calls["stream"], calls["tensor"]
        cout, clse = dsacp.lse_merge(part_out.cuda(), part_lse.cuda())
        torch.cuda.synchronize()
        assert calls["stream"] > n_stream and calls["tensor"] - n_tensor >= 4, calls  # the stream from the table
        np.testing.assert_allclose(cout.cpu().numpy(), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(clse.cpu().numpy(), np.asarray(want[1]), rtol=1e-5, atol=1e-6)
    print("ok", calls)
''')


def test_ops_read_torch_tensors_through_a_published_exchange_table():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr
