"""The compressions a peer can choose, as they go over the wire (serialize, then deserialize through hivemind's
registry, like the receiving peer does)."""
from __future__ import annotations

import pytest
import torch
from hivemind.compression import CompressionInfo, TensorRole, deserialize_torch_tensor

from lean_transformer.swarm.hivemind_fixes.numpy_decode import numpy_rejects_one_element_int
from lean_transformer.swarm.averaging.optimizer import ParametersOnly, make_compression

# choice -> (bytes per value of a large float32 tensor, largest error relative to the tensor's std)
EXPECTED = {"none": (4, 0.0), "float16": (2, 1e-3), "scaled_float16": (2, 1e-3), "uniform8bit": (1, 0.25),
            "quantile8bit": (1, 0.4), "blockwise8bit": (1, 0.05), "size_adaptive": (1, 0.25)}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_compression_round_trip(name):
    torch.manual_seed(0)
    tensor = torch.randn(2**17)
    serialized = make_compression(name).compress(tensor, CompressionInfo.from_tensor(tensor))
    restored = deserialize_torch_tensor(serialized)  # 8-bit codecs need lean_transformer.swarm.hivemind_fixes.numpy_decode on NumPy 2.4
    bytes_per_value, max_error = EXPECTED[name]
    assert len(serialized.buffer) / tensor.numel() == pytest.approx(bytes_per_value, rel=0.02)
    assert restored.dtype == tensor.dtype and restored.shape == tensor.shape
    errors = (restored - tensor).abs()
    assert errors.mean() <= max_error / 4  # typical error well below the worst case
    assert torch.quantile(errors, 0.999) <= max_error + 1e-7


def test_size_adaptive_sends_small_tensors_in_float16():
    small = torch.randn(100)
    serialized = make_compression("size_adaptive", size_adaptive_threshold=1000).compress(
        small, CompressionInfo.from_tensor(small))
    assert len(serialized.buffer) == 2 * small.numel()


def test_unknown_compression_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown compression 'zip'"):
        make_compression("zip")


@pytest.mark.parametrize("name", ["float16", "uniform8bit", "blockwise8bit"])
def test_state_compression_passes_8_bit_optimizer_statistics_through(name):
    """A newcomer downloads uint8 LAMB statistics too; the float codecs refuse them or mangle them, ParametersOnly
    sends them as they are."""
    statistics = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    try:
        mangled = deserialize_torch_tensor(make_compression(name).compress(statistics,
                                                                            CompressionInfo.from_tensor(statistics)))
        assert not torch.equal(mangled, statistics)
    except ValueError:
        pass  # refused
    compression = ParametersOnly(make_compression(name))
    assert torch.equal(deserialize_torch_tensor(compression.compress(statistics, CompressionInfo.from_tensor(
        statistics, role=TensorRole.OPTIMIZER))), statistics)
    weights = torch.randn(5000)
    compressed = compression.compress(weights, CompressionInfo.from_tensor(weights, role=TensorRole.PARAMETER))
    assert len(compressed.buffer) < 4 * weights.numel()


@pytest.mark.parametrize("name", ["float16", "uniform8bit", "blockwise8bit", "size_adaptive"])
def test_state_compression_sends_float_optimizer_statistics_exactly(name):
    """float32 second moments of small tensors (LAMB keeps them below min_8bit_size) are ~1e-10: float16 flushes
    them to zero, which a newcomer's first step would divide by."""
    second_moments = torch.rand(5000) * 1e-9
    plain = deserialize_torch_tensor(make_compression(name).compress(
        second_moments, CompressionInfo.from_tensor(second_moments, role=TensorRole.OPTIMIZER)))
    assert not torch.equal(plain, second_moments)
    sent = deserialize_torch_tensor(ParametersOnly(make_compression(name)).compress(
        second_moments, CompressionInfo.from_tensor(second_moments, role=TensorRole.OPTIMIZER)))
    assert sent.dtype == torch.float32 and torch.equal(sent, second_moments)


def test_numpy_decode_fix_is_needed_and_installed():
    """With NumPy >= 2.4, hivemind's own 8-bit decoder raises; importing lean_transformer.swarm replaces it."""
    from hivemind.compression import quantization

    from lean_transformer.swarm.hivemind_fixes import numpy_decode

    if not numpy_rejects_one_element_int():
        pytest.skip("this NumPy still converts one-element arrays to int; hivemind's decoder works as is")
    assert quantization.Quantization.extract is numpy_decode._extract_codebook_quantization
    assert quantization.BlockwiseQuantization.extract is numpy_decode._extract_blockwise_quantization
