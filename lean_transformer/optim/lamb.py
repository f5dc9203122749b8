"""LAMB (You et al., 2019) on the CPU with both moments kept in 8 bits (Dettmers et al., 2021).

Per parameter tensor ``w`` with gradient ``g`` (optionally scaled by global norm clipping), step ``t``::

    m = b1 * m + (1 - b1) * g                  v = b2 * v + (1 - b2) * g**2
    r = (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps)      # bias correction is optional
    u = r + weight_decay * w                                    # decoupled weight decay
    w = w - lr * clamp(||w||, 0, clamp_value) / ||u|| * u       # trust ratio is 1 if either norm is 0

Large tensors keep ``m`` and ``v`` as block-wise quantized bytes (see ``quantization.py``). A step runs one
fused kernel per tile (compiled with numba: a chain of torch ops sweeps memory once per op and was ~4x slower):
it decodes a block, updates it in float32, re-encodes it and writes the block of ``u``; tiles are spread over
worker threads (see ``workers.py``). Because the trust ratio needs ``||u||`` of the whole tensor
before any weight moves, ``u`` goes to a float32 buffer for tensors of up to ``chunk_size`` elements; bigger
tensors are walked twice (norms first, then the update recomputed tile by tile from the same old state), so
the extra memory never exceeds ``4 * chunk_size`` bytes. Both routes run the same per-tile arithmetic and
give bit-identical results, whatever the number of threads.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import numba
import numpy as np
import torch

from lean_transformer.optim.quantization import (
    JIT,
    SIGNED_LEVELS,
    TINY,
    UNSIGNED_LEVELS,
    block_absmax,
    encode_signed,
    encode_unsigned_from_sqrt,
    num_blocks,
)
from lean_transformer.optim.workers import TileWorkers

logger = logging.getLogger(__name__)

# elements per tile: enough work (~0.2 ms) to hide the per-call overhead, few enough to balance the threads
DEFAULT_TILE_SIZE = 2**18
QUANTIZED_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class _StepConstants:
    """The scalars of one parameter's step."""

    beta1: float
    beta2: float
    clip: float  # gradient scale from global norm clipping
    bias_correction1: float  # 1 - b1**t, or 1 without bias correction
    bias_correction2: float
    eps: float
    weight_decay: float


@dataclass(frozen=True)
class _FoldedConstants:
    """The same step rewritten so that a tile needs a single sweep with few operations per value.

    A tile works on M = m / ((1 - b1) * clip) and V = v / ((1 - b2) * clip**2), which makes the moment updates
    ``M = g + decay_m * m_old`` and ``V = g**2 + decay_v * v_old``, and computes U = u / update_scale as
    ``weight_mult * w + value * M / (sqrt(V) + eps)`` (weight_mult is 0 without weight decay).
    """

    m_decode: float  # times the stored absmax: decodes q * |q| straight into decay_m * m_old in M units
    v_decode: float
    m_store: float  # stored absmax = m_store * max|M| over the block
    v_store: float
    eps: float
    weight_mult: float
    value: float
    update_scale: float

    @classmethod
    def from_step(cls, k: _StepConstants) -> _FoldedConstants:
        m_unit, v_unit = (1 - k.beta1) * k.clip, (1 - k.beta2) * k.clip**2
        sqrt_v_unit = math.sqrt(v_unit / k.bias_correction2)  # sqrt(v_hat) = sqrt_v_unit * sqrt(V)
        correction = m_unit / k.bias_correction1 / sqrt_v_unit  # r = correction * M / (sqrt(V) + eps)
        return cls(
            m_decode=k.beta1 / (m_unit * SIGNED_LEVELS**2),
            v_decode=k.beta2 / (v_unit * float(UNSIGNED_LEVELS) ** 4),
            m_store=m_unit,
            v_store=v_unit,
            eps=k.eps / sqrt_v_unit,
            weight_mult=1.0 if k.weight_decay else 0.0,
            value=correction / k.weight_decay if k.weight_decay else 1.0,
            update_scale=k.weight_decay if k.weight_decay else correction,
        )

    def kernel_args(self) -> tuple[np.float32, ...]:
        """The scalars _lamb_tile takes, as float32 so that its arithmetic stays in float32."""
        names = ("m_decode", "v_decode", "m_store", "v_store", "eps", "weight_mult", "value")
        return tuple(np.float32(getattr(self, name)) for name in names)


@numba.njit(**JIT)
def _update_block(g, w, m_codes, v_codes, update, m, v, sqrt_v, m_decode, v_decode, eps, weight_mult, value):
    """Decode and update the moments of one block, write U, and return the block's sums of U**2 and w**2."""
    update_sq, weight_sq = np.float32(0.0), np.float32(0.0)
    for j in range(g.size):
        q_m, q_v = np.float32(m_codes[j]), np.float32(v_codes[j])
        m[j] = g[j] + q_m * abs(q_m) * m_decode
        v[j] = g[j] * g[j] + (q_v * q_v) * (q_v * q_v) * v_decode
        sqrt_v[j] = np.sqrt(v[j] + TINY)
        update[j] = weight_mult * w[j] + value * m[j] / (sqrt_v[j] + eps)
        update_sq += update[j] * update[j]
        weight_sq += w[j] * w[j]
    return update_sq, weight_sq


@numba.njit(**JIT)
def _lamb_tile(
    g, w, m_codes, v_codes, m_absmax, v_absmax, update, block_size, m_decode, v_decode, m_store, v_store, eps,
    weight_mult, value, store,
):  # fmt: skip
    """One tile of the quantized step (see _FoldedConstants); returns its sums of U**2 and w**2."""
    m, v, sqrt_v = np.empty(block_size, np.float32), np.empty(block_size, np.float32), np.empty(block_size, np.float32)
    bits_scratch = np.empty(1, np.int32)
    update_sq, weight_sq = 0.0, 0.0
    for b in range(m_absmax.size):
        start, end = b * block_size, min((b + 1) * block_size, g.size)
        size = end - start
        block_update_sq, block_weight_sq = _update_block(
            g[start:end], w[start:end], m_codes[start:end], v_codes[start:end], update[start:end], m[:size], v[:size],
            sqrt_v[:size], np.float32(m_absmax[b] * m_decode), np.float32(v_absmax[b] * v_decode), eps, weight_mult,
            value,
        )  # fmt: skip
        update_sq += block_update_sq
        weight_sq += block_weight_sq
        if store:
            m_max, v_max = block_absmax(m[:size], bits_scratch), block_absmax(v[:size], bits_scratch)
            encode_signed(m[:size], m_max, m_codes[start:end])
            encode_unsigned_from_sqrt(sqrt_v[:size], v_max, v_codes[start:end])
            m_absmax[b], v_absmax[b] = m_max * m_store, v_max * v_store
    return update_sq, weight_sq


@numba.njit(**JIT)
def _add_scaled(weight, update, alpha):
    """weight += alpha * update: a tile's share of w -= lr * trust_ratio * u."""
    for j in range(weight.size):
        weight[j] += alpha * update[j]


class _QuantizedTensor:
    """Flat numpy views of one parameter, its gradient and its 8-bit state (zero-copy), made once per step."""

    def __init__(self, param: torch.Tensor, state: dict[str, Any], constants: _FoldedConstants):
        self.constants, self.block_size = constants, state["block_size"]
        self.kernel_args = constants.kernel_args()  # the same for every tile
        self.grad = param.grad.detach().reshape(-1).contiguous().numpy()
        self.weight = param.detach().view(-1).numpy()
        self.m_codes = state["exp_avg"].view(-1).view(torch.int8).numpy()
        self.v_codes = state["exp_avg_sq"].view(-1).numpy()
        self.m_absmax, self.v_absmax = state["exp_avg_absmax"].numpy(), state["exp_avg_sq_absmax"].numpy()


def global_norm(grads: list[torch.Tensor]) -> float:
    """The L2 norm over all gradients (as ``clip_grad_norm_`` computes it); inf or nan if any value is."""
    return math.sqrt(sum(torch.linalg.vector_norm(grad, dtype=torch.float32).item() ** 2 for grad in grads))


class CPULAMB8Bit(torch.optim.Optimizer):
    """LAMB with block-wise 8-bit moments for float32 CPU parameters (e.g. hivemind's offloaded copies).

    :param min_8bit_size: tensors with fewer elements keep float32 moments (their state is negligible)
    :param block_size: values per quantization block; state costs ``2 + 8 / block_size`` bytes per parameter
    :param chunk_size: the largest tensor updated in a single pass; the float32 buffer this needs is the
      optimizer's only sizeable scratch memory (``4 * chunk_size`` bytes at most)
    :param max_grad_norm: if set, gradients are scaled as by ``clip_grad_norm_`` over all parameters of all
      groups (without modifying ``.grad``). Whether set or not, a step whose gradients hold an inf or nan is
      skipped as a whole (parameters, statistics and step counts untouched) with a warning.
    :param tile_size: elements processed at a time by one thread (rounded down to whole blocks)
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        clamp_value: float = 10.0,
        bias_correction: bool = True,
        max_grad_norm: Optional[float] = None,
        min_8bit_size: int = 4096,
        block_size: int = 256,
        chunk_size: int = 2**24,
        tile_size: int = DEFAULT_TILE_SIZE,
    ):
        for name, value, minimum in (
            ("min_8bit_size", min_8bit_size, 0),
            ("block_size", block_size, 1),
            ("chunk_size", chunk_size, 1),
            ("tile_size", tile_size, 1),
        ):
            if not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
        self.max_grad_norm = max_grad_norm
        self.min_8bit_size, self.block_size, self.chunk_size = min_8bit_size, block_size, chunk_size
        self.tile_size = tile_size
        self._update_buffer = np.empty(0, np.float32)
        self._workers = TileWorkers()
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            clamp_value=clamp_value,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            _check_param_group(self.param_groups[-1], len(self.param_groups) - 1)
        except ValueError:
            self.param_groups.pop()  # a rejected group must not stay behind
            raise

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for group_index, group in enumerate(self.param_groups):
            for index, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                if param.grad.is_sparse or param.grad.shape != param.shape:
                    problem = "is sparse" if param.grad.is_sparse else f"has shape {tuple(param.grad.shape)}"
                    raise ValueError(
                        f"the gradient of param_groups[{group_index}]['params'][{index}] {problem}; "
                        f"CPULAMB8Bit needs dense gradients shaped like the parameter {tuple(param.shape)}"
                    )
                work.append((group, param))
        total_norm = global_norm([param.grad for _, param in work])
        if not math.isfinite(total_norm):  # one bad value would poison the 8-bit statistics for good
            logger.warning(f"CPULAMB8Bit: skipped a step with a non-finite gradient norm ({total_norm}); parameters "
                           f"and statistics are unchanged")
            return loss
        clip = self._clip_coefficient(total_norm)
        for group, param in work:
            state = self.state[param]
            if not state:
                self._init_state(param, state)
            state["step"] += 1
            constants = self._step_constants(group, state["step"], clip)
            if state["exp_avg"].dtype == torch.uint8:
                self._update_quantized(param, state, group, constants)
            else:
                self._update_full_precision(param, state, group, constants)
        return loss

    def _clip_coefficient(self, total_norm: float) -> float:
        if self.max_grad_norm is None:
            return 1.0
        return min(1.0, self.max_grad_norm / (total_norm + 1e-6))

    def _init_state(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        state["step"] = 0
        if param.numel() < self.min_8bit_size:
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
            return
        state["block_size"] = self.block_size  # saved with the state, so that loading it can never misread codes
        for key in QUANTIZED_KEYS:
            state[key] = torch.zeros(param.shape, dtype=torch.uint8)
            state[f"{key}_absmax"] = torch.zeros(num_blocks(param.numel(), self.block_size))

    @staticmethod
    def _step_constants(group: dict[str, Any], step: int, clip: float) -> _StepConstants:
        beta1, beta2 = group["betas"]
        return _StepConstants(
            beta1=beta1,
            beta2=beta2,
            clip=clip,
            bias_correction1=1 - beta1**step if group["bias_correction"] else 1.0,
            bias_correction2=1 - beta2**step if group["bias_correction"] else 1.0,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )

    @staticmethod
    def _step_size(weight_norm: float, update_norm: float, group: dict[str, Any]) -> float:
        """lr times the trust ratio clamp(||w||, 0, clamp_value) / ||u|| (1 if either norm is 0)."""
        trust_ratio = (
            min(weight_norm, group["clamp_value"]) / update_norm if weight_norm > 0 and update_norm > 0 else 1.0
        )
        return group["lr"] * trust_ratio

    def _update_full_precision(
        self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any], k: _StepConstants
    ) -> None:
        grad, m, v = param.grad, state["exp_avg"], state["exp_avg_sq"]
        if k.clip != 1.0:
            grad = grad * k.clip
        m.mul_(k.beta1).add_(grad, alpha=1 - k.beta1)
        v.mul_(k.beta2).addcmul_(grad, grad, value=1 - k.beta2)
        update = (m / k.bias_correction1).div_((v / k.bias_correction2).sqrt_().add_(k.eps))
        if k.weight_decay:
            update.add_(param, alpha=k.weight_decay)
        step_size = self._step_size(
            torch.linalg.vector_norm(param).item(), torch.linalg.vector_norm(update).item(), group
        )
        param.sub_(update, alpha=step_size)

    def _update_quantized(
        self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any], k: _StepConstants
    ) -> None:
        numel, block = param.numel(), state["block_size"]
        tensor = _QuantizedTensor(param, state, _FoldedConstants.from_step(k))
        tile = max(block, self.tile_size // block * block)  # tiles hold whole blocks
        bounds = [(start, min(start + tile, numel)) for start in range(0, numel, tile)]
        sums = [(0.0, 0.0)] * len(bounds)  # per tile: sum of U**2 and of w**2
        single_pass = numel <= self.chunk_size
        if single_pass and self._update_buffer.size < numel:
            self._update_buffer = np.empty(numel, np.float32)

        def tile_update(i: int, store: bool) -> np.ndarray:
            start, end = bounds[i]
            update = self._update_buffer[start:end] if single_pass else self._workers.buffer(tile)[: end - start]
            sums[i] = self._tile_step(tensor, start, end, update, store)
            return update

        self._workers.run(lambda i: tile_update(i, store=single_pass), range(len(bounds)))
        update_norm, weight_norm = (math.sqrt(sum(pair[j] for pair in sums)) for j in (0, 1))
        update_scale = tensor.constants.update_scale
        alpha = np.float32(-self._step_size(weight_norm, update_scale * update_norm, group) * update_scale)

        def second_pass(i: int) -> None:
            # without a full update buffer, recompute the tile from its old state (replaced only now)
            start, end = bounds[i]
            update = self._update_buffer[start:end] if single_pass else tile_update(i, store=True)
            _add_scaled(tensor.weight[start:end], update, alpha)

        self._workers.run(second_pass, range(len(bounds)))

    @staticmethod
    def _tile_step(tensor: _QuantizedTensor, start: int, end: int, update: np.ndarray, store: bool) -> tuple:
        """Write U (see _FoldedConstants) of elements [start, end) to ``update``; if ``store``, save the new moments."""
        block = tensor.block_size
        blocks = slice(start // block, num_blocks(end, block))
        return _lamb_tile(
            tensor.grad[start:end], tensor.weight[start:end], tensor.m_codes[start:end], tensor.v_codes[start:end],
            tensor.m_absmax[blocks], tensor.v_absmax[blocks], update, block, *tensor.kernel_args, store,
        )  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, rejecting one saved for a different parameter layout."""
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(groups, saved_groups)
        ):
            raise ValueError(
                "state_dict has a different number of parameter groups or parameters per group than this optimizer"
            )
        params = [param for group in groups for param in group["params"]]
        saved_ids = [param_id for group in saved_groups for param_id in group["params"]]
        for param, param_id in zip(params, saved_ids):
            if param_id in state_dict["state"]:
                _check_saved_state(param, state_dict["state"][param_id], f"state_dict['state'][{param_id!r}]")
        super().load_state_dict(state_dict)
        for param in params:  # torch casts every floating-point param's state to the param's dtype: undo for codes
            state = self.state.get(param)
            if state and "block_size" in state:
                for key in QUANTIZED_KEYS:
                    state[key] = state[key].to(torch.uint8)

    def scratch_bytes(self) -> int:
        """Bytes of the float32 update buffer kept between steps (at most 4 * chunk_size)."""
        return self._update_buffer.nbytes

    def state_bytes(self) -> int:
        """Bytes held by optimizer state tensors (the codes, absmax values and float32 moments)."""
        return sum(
            value.numel() * value.element_size()
            for state in self.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )


def _check_param_group(group: dict[str, Any], group_index: int) -> None:
    betas = group["betas"]
    checks = {
        "lr": group["lr"] >= 0,
        "eps": group["eps"] >= 0,
        "weight_decay": group["weight_decay"] >= 0,
        "clamp_value": group["clamp_value"] > 0,
        "betas": isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0 <= beta < 1 for beta in betas),
    }
    for name, ok in checks.items():
        if not ok:
            raise ValueError(f"param_groups[{group_index}] has an invalid {name}: {group[name]!r}")
    for index, param in enumerate(group["params"]):
        if param.dtype != torch.float32 or param.device.type != "cpu" or not param.is_contiguous():
            raise ValueError(
                f"param_groups[{group_index}]['params'][{index}] must be a contiguous float32 CPU tensor "
                f"(got {param.dtype} on {param.device}); keep low-precision or GPU weights in OffloadedOptimizer"
            )


def _check_saved_state(param: torch.Tensor, saved: dict[str, Any], where: str) -> None:
    """The shapes and dtypes a parameter's saved state must have to be read back correctly."""
    expected = {key: (tuple(param.shape), torch.float32) for key in QUANTIZED_KEYS}
    if "block_size" in saved:
        block_size = saved["block_size"]
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"{where}['block_size'] must be a positive int, got {block_size!r}")
        blocks = (num_blocks(param.numel(), block_size),)
        expected = {key: (tuple(param.shape), torch.uint8) for key in QUANTIZED_KEYS}
        expected.update({f"{key}_absmax": (blocks, torch.float32) for key in QUANTIZED_KEYS})
    for key, (shape, dtype) in expected.items():
        value = saved.get(key)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or value.dtype != dtype:
            got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            raise ValueError(
                f"{where}[{key!r}] is {got}, expected {dtype} {shape} for a parameter of shape {tuple(param.shape)}"
            )
