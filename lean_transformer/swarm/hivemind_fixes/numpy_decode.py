"""A fix for hivemind 1.1.12 under NumPy >= 2.4, installed on import of ``lean_transformer.swarm.hivemind_fixes``.

hivemind's 8-bit decompression (uniform, quantile and blockwise) reads its header with ``int(np.frombuffer(...,
count=1))``; NumPy 2.4 turned that conversion of a one-element array into an error. The error is raised inside the
all-reduce, which then goes on without the 8-bit parts ("Reducer: received 54.5% of input tensors"): averaging
silently uses partial results. The replacements below read the header as scalars and decode exactly the same wire
format; they are installed only where the running NumPy needs them.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from hivemind.compression import quantization
from hivemind.proto import runtime_pb2


def _header(buffer: bytes, count: int) -> list[int]:
    return np.frombuffer(buffer, count=count, dtype=np.int64).tolist()


def _extract_codebook_quantization(self: quantization.Quantization, serialized: runtime_pb2.Tensor) -> torch.Tensor:
    """Wire format: int64 codebook size, float32 codebook, uint8 indices."""
    (codebook_size,) = _header(serialized.buffer, 1)
    codebook = np.frombuffer(serialized.buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
    indices = np.frombuffer(serialized.buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
    indices = torch.as_tensor(indices, dtype=torch.int64).reshape(tuple(serialized.size))
    values = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized.dtype))[indices]
    return values.requires_grad_(serialized.requires_grad)


def _extract_blockwise_quantization(self: quantization.BlockwiseQuantization,
                                    serialized: runtime_pb2.Tensor) -> torch.Tensor:
    """Wire format: int64 absmax size, int64 codebook size, float32 absmax, float32 codebook, uint8 indices."""
    from bitsandbytes.functional import dequantize_blockwise

    absmax_size, codebook_size = _header(serialized.buffer, 2)
    absmax = np.frombuffer(serialized.buffer, offset=16, count=absmax_size, dtype=self.codebook_dtype)
    codebook = np.frombuffer(serialized.buffer, offset=16 + absmax.nbytes, count=codebook_size,
                             dtype=self.codebook_dtype)
    indices = np.frombuffer(serialized.buffer, offset=16 + absmax.nbytes + codebook.nbytes, dtype=self.indices_dtype)
    values = dequantize_blockwise(torch.as_tensor(indices).reshape(tuple(serialized.size)),
                                  absmax=torch.as_tensor(absmax), code=torch.as_tensor(codebook),
                                  blocksize=quantization._BLOCKWISE_QUANTIZATION_BLOCKSIZE, nested=False)
    return values.to(getattr(torch, serialized.dtype)).requires_grad_(serialized.requires_grad)


def numpy_rejects_one_element_int() -> bool:
    try:
        int(np.zeros(1))
    except TypeError:
        return True
    return False


def install() -> None:
    # hivemind's uniform 8-bit quantization uses torch.quantize_per_tensor, which torch now warns about on every call
    warnings.filterwarnings("ignore", message="torch.quantize_per_tensor", category=UserWarning)
    if numpy_rejects_one_element_int():
        quantization.Quantization.extract = _extract_codebook_quantization
        quantization.BlockwiseQuantization.extract = _extract_blockwise_quantization


install()
