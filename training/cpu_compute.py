"""fp32 arithmetic for a model stored in bf16 or fp16, on a CPU.

A CPU without native bf16 instructions (AVX2, where AVX-512 BF16 and AMX are missing) multiplies bf16
matrices through a slow fallback: on this project's 2-core AVX2 machine one 256 x 2048 by 2048 x 2048
product took 0.03 s in fp32, 0.35 s in bf16 as `F.linear` computes it forward and 8.3 s in the layout its
backward uses (the input's gradient, grad @ W), so one training step of a real-size compressed miner took
minutes. Inside `fp32_compute()` every `F.linear` whose weight is bf16 or fp16 runs in fp32 on fp32 inputs,
upcasting the weight a block of rows at a time, and embedding lookups come out in fp32: the weights stay
stored in their dtype, autograd keeps the stored (narrow) weight for backward rather than an fp32 copy, and
activations are fp32. The trainer and the scorer use it on every CPU, also where bf16 is faster: on an
AVX-512 and AMX Xeon the same products ran at 470 (forward) and 660 GFLOP/s (backward's layout) in bf16,
against 160 in fp32, and fp32 keeps every CPU's arithmetic as close to every other's as fp32 sums allow.
Inside `as_on_accelerator()` it widens nothing: the memory plan traces on the CPU a step as a GPU runs it.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

NARROW = (torch.bfloat16, torch.float16)
"""The stored dtypes whose arithmetic is widened."""
BLOCK_BYTES = 64 << 20
"""The most fp32 weight bytes upcast at once (a 50k-token vocabulary's output layer is 0.4 GB in fp32)."""
_WIDEN = ContextVar("tessera_widen", default=True)


def holds_narrow_weights(model: torch.nn.Module) -> bool:
    """Whether any of `model`'s floating parameters is stored in bf16 or fp16."""
    return any(p.dtype in NARROW for p in model.parameters())


@contextmanager
def fp32_compute() -> Iterator[None]:
    """Inside: bf16/fp16 linear layers and embeddings compute in fp32 (module docstring)."""
    with _Widen() if _WIDEN.get() else nullcontext():
        yield


@contextmanager
def as_on_accelerator() -> Iterator[None]:
    """Inside (in this thread): `fp32_compute` widens nothing, so CPU work computes in the weights' dtype as an
    accelerator does."""
    token = _WIDEN.set(False)
    try:
        yield
    finally:
        _WIDEN.reset(token)


class _Widen(TorchFunctionMode):
    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = _linear_args(args, kwargs)
            if weight.dtype in NARROW:
                return _WideLinear.apply(x, weight, bias)  # type: ignore[no-untyped-call]  # unannotated in torch
        out = func(*args, **kwargs)
        if func is F.embedding and isinstance(out, torch.Tensor) and out.dtype in NARROW:
            return out.float()
        return out


def _linear_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, Any]:
    values = list(args) + [kwargs[name] for name in ("input", "weight", "bias")[len(args):] if name in kwargs]
    return values[0], values[1], values[2] if len(values) > 2 else None


def _blocks(weight: torch.Tensor) -> range:
    """Starts of the blocks of output rows upcast at once."""
    rows = max(1, BLOCK_BYTES // (4 * max(1, weight.shape[-1])))
    return range(0, weight.shape[0], rows)


class _WideLinear(torch.autograd.Function):
    """`F.linear` in fp32 over a narrow weight; saves the weight as stored, upcasts it again in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        x32 = x.float()
        out = x32.new_empty((*x.shape[:-1], weight.shape[0]))
        starts = _blocks(weight)
        for start in starts:
            end = start + starts.step
            out[..., start:end] = F.linear(x32, weight[start:end].float())
        if bias is not None:
            out += bias.float()
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad32 = grad.float()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            acc = grad32.new_zeros(x.shape)
            starts = _blocks(weight)
            for start in starts:
                end = start + starts.step
                acc += grad32[..., start:end] @ weight[start:end].float()
            grad_x = acc.to(x.dtype)
        if ctx.needs_input_grad[1]:
            flat = grad32.reshape(-1, weight.shape[0])
            grad_w = (flat.t() @ x.float().reshape(-1, weight.shape[1])).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = grad32.reshape(-1, weight.shape[0]).sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b
