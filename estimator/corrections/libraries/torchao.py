"""torchao's ``CPUOffloadOptimizer`` on the CUDA target (torchao/optim/cpu_offload.py).

``CPUOffloadOptimizer(params, optimizer_class, offload_gradients=False, minimal_size=4096)`` keeps,
for each parameter of ``minimal_size`` elements or more, a pinned host copy and a pinned host
gradient (``torch.empty_like(p, device="cpu", pin_memory=True)``), one ``optimizer_class`` over
that copy (fused CPU AdamW by default) and a post-accumulate-grad hook that copies the device
gradient to the host on a side stream (and drops the device gradient with
``offload_gradients=True``); ``step()`` steps the small parameters with one device optimizer
(``d_opt``), the others on the CPU, and copies each host copy back into its device parameter in
place.  So the device holds the parameters, their gradients until ``zero_grad`` (or until copied
out) and the small parameters' optimizer state; the host holds the rest.

Its constructor asserts a CUDA or XPU device and makes its stream with ``torch.cuda.Stream()``,
neither of which a machine without a GPU has: while capturing for the CUDA target its module sees a
CUDA device whose streams are ``torch.cpu``'s (``cuda_device``); the host copies, their gradients
and their optimizers' state are host memory (``offloaded``, a ``@host_state`` rule: never counted
on the device, and the optimizer ops on them make host tensors, ``Tracker.keep_on_host``); its
optimizers' state reads through ``state`` (``states``: it calls no ``Optimizer.__init__``).
Streams carry no timing in the replay: ``record_stream`` (the device gradient kept from reuse
until its copy ends) is not modelled.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Mapping

import torch
from torchao.optim import cpu_offload

from estimator.corrections.patches import patched
from estimator.corrections.registry import host_state, optimizer_rule, while_capturing
from estimator.vocab.categories import Target


class _Stream(torch.cpu.Stream):
    """A CUDA stream's methods the optimizer calls, on the capture's CPU (no timing)."""

    def record_event(self, event=None):
        return types.SimpleNamespace(synchronize=lambda: None)

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Torch(types.ModuleType):
    """``torch`` as ``cpu_offload`` sees it: ``torch.cuda`` with CPU streams."""

    cuda = types.SimpleNamespace(Stream=_Stream, stream=torch.cpu.stream, current_stream=torch.cpu.current_stream)

    def __getattr__(self, name: str):
        return getattr(torch, name)


@while_capturing(targets=Target.CUDA)
@contextlib.contextmanager
def cuda_device(spec) -> Iterator[None]:
    """``get_available_devices()[-1]`` is ``"cuda"`` and ``torch.cuda``'s streams are the CPU's;
    ``record_stream`` records nothing."""
    with patched(vars(cpu_offload), "get_available_devices", lambda: ["cpu", "cuda"]), \
            patched(vars(cpu_offload), "torch", _Torch("torch")), \
            patched(torch.Tensor, "record_stream", lambda self, stream: None):
        yield


class _States(Mapping):
    """The state of every optimizer a ``CPUOffloadOptimizer`` steps, by parameter (a host copy or
    a small device parameter), read live."""

    def __init__(self, optimizer) -> None:
        self._optimizer = optimizer

    def _maps(self) -> list:
        inner = [*self._optimizer.optim_dict.values(), *filter(None, [self._optimizer.d_opt])]
        return [opt.state for opt in inner]

    def __getitem__(self, param):
        for state in self._maps():
            if param in state:
                return state[param]
        raise KeyError(param)

    def __iter__(self):
        return (param for state in self._maps() for param in state)

    def __len__(self) -> int:
        return sum(len(state) for state in self._maps())


@optimizer_rule(targets=Target.CUDA)
def states(spec, optimizer) -> None:
    if isinstance(optimizer, cpu_offload.CPUOffloadOptimizer) and not hasattr(optimizer, "state"):
        optimizer.state = _States(optimizer)


@host_state(targets=Target.CUDA)
def offloaded(optimizer, group: dict, key: str, value: torch.Tensor) -> bool:
    """A host copy (``key`` ``"param"``), its gradient and its optimizer's state."""
    if not isinstance(optimizer, cpu_offload.CPUOffloadOptimizer):
        return False
    param = group["params"][0]
    return any(param is host for host in optimizer.param_d2h_map.values())
