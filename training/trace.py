"""Following every storage a piece of torch work allocates and frees, to find its peak and what the peak holds.

`Trace` is a dispatch mode: inside it, every operation's results are counted as live until their storage
is freed, and the largest total is the peak, split into `PARTS` by what each storage is (weights, the
optimizer's parameters, their gradients and state, activations and every other temporary), with the step
and phase it falls in. It runs on real tensors, or on fake ones (shapes and dtypes, no storage), which
hold no values: an operation whose result depends on them (which experts a token picks, a count,
`.item()`) gets one from a shadow, integer and other small tensors being computed for real beside their
fakes, and a router's top-k on value-less scores routes round-robin, every expert getting the same share
of tokens; a loss read as a number reads 0. This module knows nothing about models, training or nodes:
`training.plan` runs a node's work inside it.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

PARTS = ("weights", "trainable_copies", "gradients", "optimizer_state", "activations")
"""What the peak is made of; `activations` holds every temporary too (AdamW's, the loss's)."""
_SHADOW_NUMEL = 1 << 24
"""The largest float tensor given a real shadow; a bigger one (a float mask of a long sequence) stays fake."""
_SHADOW_NUMEL_EXACT = 1 << 26
"""The largest integer or boolean tensor given one: routing's one-hot masks of a validator's batch (16 x 2048
tokens, top-8 of 64 experts: 17 M values) decide which experts run."""
aten = torch.ops.aten


class Trace(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves the mode unannotated
    """Follows every storage the operations inside allocate, until they free it, and labels the peak.

    Storages are keyed by their storage's identity; a tensor's weakref finalizer says when one may be
    gone, and the storage's own weak reference says whether it is. `weights` are live from the start.
    The optimizer step is marked through torch's step hooks: its parameters are the trainable copies,
    their gradients the gradients, and what its state holds after the step the optimizer state.
    It follows every step the caller runs and what comes after them; the caller says which step runs
    (`step`) and when they are over (`after_steps`). With `fake`, data-
    dependent operations are answered from real shadows (module docstring).
    With `places` (the device of each weight, for a model spread over several), every storage is also
    counted on a device: an operation's results on the last of its inputs' devices (a forward pass moves
    through the devices in order, and accelerate's hooks move the inputs of each module to its device), or
    where the last operation ran when it has none; each device's peak is kept apart (`device_peak`).
    """

    def __init__(self, weights: Iterable[torch.Tensor], fake: FakeTensorMode | None,
                 places: Iterable[int] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.step = 1
        """The inner step running now (the caller advances it); its peak is kept apart (`step_peaks`)."""
        self.after_steps = False
        """Set by the caller once the last step is over: what follows is the trained rows written back."""
        self._fake = fake
        self._shadows: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._allocations: dict[int, int] = {}
        """A live storage's address -> its allocation's number (addresses are reused once freed)."""
        self._count = itertools.count()
        self._refs: dict[int, tuple[int, StorageWeakRef]] = {}
        """Allocation -> (its storage's address, a weak reference to the storage)."""
        self._live: dict[int, int] = {}
        """Allocation -> bytes, for the storages alive now."""
        self._maybe_freed: set[int] = set()
        self._labels: dict[int, str] = {}
        self._live_bytes = 0
        self._peak: dict[int, int] = {}
        self._peak_bytes = -1
        self._peak_phase = "forward"
        self._peak_step = 1
        self.step_peaks: dict[int, int] = {}
        """Step -> the most bytes live during it (the write-back after the last step counts in the last)."""
        self._in_step = False
        self._where: dict[int, int] | None = None if places is None else {}
        """Allocation -> its device, where the model is spread over several."""
        self._here = self._last = 0
        self._device_live: dict[int, int] = {}
        self._device_peak: dict[int, tuple[int, dict[int, int], str, int]] = {}
        """Device -> (its peak bytes, allocation -> bytes on it then, phase, step)."""
        weights = list(weights)
        for tensor, place in zip(weights, places if places is not None else [0] * len(weights), strict=True):
            self._here = place  # no finalizer: a weakref would stop `Module.to` swapping a fake parameter
            self._labels[self._add(tensor, watch=False)] = "weights"
        self._hooks: list[Any] = []

    def __enter__(self) -> Trace:
        self._hooks = [register_optimizer_step_pre_hook(self._before_step),
                       register_optimizer_step_post_hook(self._after_step)]
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        for hook in self._hooks:
            hook.remove()

    def peak(self) -> tuple[int, dict[str, int], str, int]:
        """(peak bytes, PARTS at the peak, its phase, its step)."""
        parts = dict.fromkeys(PARTS, 0)
        for key, nbytes in self._peak.items():
            parts[self._labels.get(key, "activations")] += nbytes
        assert sum(parts.values()) == self._peak_bytes, "the parts of the peak do not add up to it"
        return self._peak_bytes, parts, self._peak_phase, self._peak_step

    def device_peak(self) -> dict[int, tuple[int, dict[str, int], str, int]]:
        """Device -> (its peak bytes, PARTS at it, its phase, its step), where the model is spread over several."""
        out = {}
        for device, (peak, live, phase, step) in sorted(self._device_peak.items()):
            parts = dict.fromkeys(PARTS, 0)
            for key, nbytes in live.items():
                parts[self._labels.get(key, "activations")] += nbytes
            out[device] = (peak, parts, phase, step)
        return out

    def _before_step(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                self._labels[self._key(param)] = "trainable_copies"
                if param.grad is not None:
                    self._labels[self._key(param.grad)] = "gradients"
        self._collect_frees()
        self._in_step = True

    def _after_step(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self._labels[self._key(value)] = "optimizer_state"
        self._in_step = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs) if self._fake is None else self._fake_call(func, args, kwargs)
        self._collect_frees()
        if self._where is not None:
            where, allocations = self._where, self._allocations
            inputs = [where.get(allocations.get(int(a.untyped_storage()._cdata), -1), -1)
                      for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            self._here = max(inputs, default=-1)
            if self._here < 0:
                self._here = self._last
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._add(tensor)
        if self._live_bytes > self.step_peaks.get(self.step, -1):
            self.step_peaks[self.step] = self._live_bytes
        if self._live_bytes > self._peak_bytes:
            self._peak, self._peak_bytes, self._peak_step = dict(self._live), self._live_bytes, self.step
            self._peak_phase = self._phase()
        if self._where is not None:
            self._last = self._here
            here = self._device_live.get(self._here, 0)
            if here > self._device_peak.get(self._here, (-1,))[0]:
                live = {key: n for key, n in self._live.items() if self._where.get(key) == self._here}
                self._device_peak[self._here] = (here, live, self._phase(), self.step)
        return out

    def _phase(self) -> str:
        return ("optimizer step" if self._in_step else
                "backward" if torch._C._current_autograd_node() is not None else
                "writing back" if self.after_steps else "forward")

    def _key(self, tensor: torch.Tensor) -> int:
        return self._allocations[int(tensor.untyped_storage()._cdata)]

    def _add(self, tensor: torch.Tensor, watch: bool = True) -> int:
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        key = self._allocations.get(int(storage._cdata))
        if key is None:
            key = self._allocations[int(storage._cdata)] = next(self._count)
            self._refs[key] = (int(storage._cdata), StorageWeakRef(storage))  # type: ignore[no-untyped-call]
            self._live[key] = 0
            if self._where is not None:
                self._where[key] = self._here
        if nbytes > self._live[key]:  # new, or resized in place
            self._live_bytes += nbytes - self._live[key]
            if self._where is not None:
                device = self._where[key]
                self._device_live[device] = self._device_live.get(device, 0) + nbytes - self._live[key]
            self._live[key] = nbytes
        if watch:
            weakref.finalize(tensor, self._maybe_freed.add, key)
        return key

    def _collect_frees(self) -> None:
        for key in list(self._maybe_freed):
            ref = self._refs.get(key)
            if ref is None or ref[1].expired():  # type: ignore[no-untyped-call]
                self._maybe_freed.discard(key)
                if ref is not None:
                    del self._refs[key], self._allocations[ref[0]]
                    nbytes = self._live.pop(key)
                    self._live_bytes -= nbytes
                    if self._where is not None:
                        self._device_live[self._where.pop(key)] -= nbytes

    def _fake_call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run `func` on fake tensors, answering what depends on values from the shadows."""
        assert self._fake is not None
        flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        known = all(not isinstance(a, FakeTensor) or a in self._shadows for a in flat)
        if not known and func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            args = (args[0], [self._long_index(i) for i in args[1]], *args[2:])
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            if known:
                return self._shadowed(func, args, kwargs, None)
            if func is aten._local_scalar_dense.default and args[0].is_floating_point():
                return 0.0  # a value no one traced: a loss read as a number
            raise AssertionError(f"the plan cannot trace {func} on values it does not hold") from None
        if func is aten.topk.default and not known:
            self._round_robin(args, out)
        elif known and all(_shadowable(t) for t in tree_flatten(out)[0]
                                    if isinstance(t, torch.Tensor)):
            self._shadowed(func, args, kwargs, out)
        elif not known and func._schema.is_mutable:
            for tensor in flat:
                self._shadows.pop(tensor, None)  # type: ignore[no-untyped-call]
        return out

    def _shadowed(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        """Run `func` on the shadows; `out` (None: made from the real result) gets the results as shadows."""
        assert self._fake is not None
        shadows = self._shadows
        real_args, real_kwargs = tree_map(
            lambda a: shadows.get(a, a) if isinstance(a, FakeTensor) else a,  # type: ignore[no-untyped-call]
            (args, kwargs))
        with unset_fake_temporarily():
            real = func(*real_args, **real_kwargs)
        if out is None:
            fake = self._fake
            out = tree_map(lambda r: fake.from_tensor(r) if isinstance(r, torch.Tensor) else r, real)
        for o, r in zip(tree_flatten(out)[0], tree_flatten(real)[0], strict=True):
            if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor) and _shadowable(r):
                self._shadows[o] = r
        return out

    def _long_index(self, index: torch.Tensor | None) -> torch.Tensor | None:
        """A known boolean mask index as the integer indices it selects (its shape is then known)."""
        if index is None or index.dtype != torch.bool or index not in self._shadows:
            return index
        assert self._fake is not None
        assert index.ndim == 1, "the plan turns only one-dimensional masks into indices"
        with unset_fake_temporarily():
            rows = self._shadows[index].nonzero().reshape(-1)
        fake = self._fake.from_tensor(rows)
        self._shadows[fake] = rows
        return fake

    def _round_robin(self, args: tuple[Any, ...], out: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Shadow a top-k over value-less scores: row r picks choices (r k + j) mod E, every choice equally often."""
        scores = args[0]
        dim = args[2] if len(args) > 2 else -1
        assert dim in (-1, scores.ndim - 1), "the plan routes only a top-k over the last dimension"
        choices = scores.shape[-1]
        with unset_fake_temporarily():
            picks = torch.arange(out[1].numel()).remainder(choices).reshape(out[1].shape)
        self._shadows[out[1]] = picks


def _shadowable(tensor: torch.Tensor) -> bool:
    """Whether a tensor is small enough to be computed for real beside its fake (`_SHADOW_NUMEL`)."""
    limit = _SHADOW_NUMEL if tensor.is_floating_point() else _SHADOW_NUMEL_EXACT
    return tensor.numel() <= limit
