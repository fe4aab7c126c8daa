"""Every global of torch (and of the libraries it runs) that fxmem replaces, through one owner.

A fake run takes other branches than a real one wherever code tests the tensor's type or reaches a
global that would touch the device, the disk or the network; fxmem replaces those globals for as
long as it needs them, and only then.  Each replacement goes through ``patched(owner, name,
value)`` (an attribute, or a key of a module's globals), which installs it, restores what it found
in reverse order on exit -- also when the step raises -- and is re-entrant: a nested patch of the
same name restores the outer one's value, never torch's too early.  ``active()`` lists what is
replaced right now (empty outside fxmem: a test checks it after captures that succeed and fail).

The patches, by the room that owns the need:

=====================================================  ===========================================
``torch.nn.functional.has_torch_function``             ``corrections.mode.run_inside``: a Python
                                                       function of ``F`` runs its body under the
                                                       substitution mode, not re-dispatched
``torch.overrides.has_torch_function``, and            ``corrections.registry.fast_path_checks_*``:
``_has_foreach_support`` in the globals of the         the fast-path and foreach checks answer for
modules that call it                                   fake tensors what they answer for real ones
``torch.clear_autocast_cache``                         ``corrections.cuda.autocast.emulate``: also
                                                       clears the emulated CUDA autocast's casts
``torch.utils.swap_tensors``                           ``capture.isolation.conversions_as_for_real``
``torch.Tensor.__format__``, ``torch.Tensor.numpy``,   ``capture.tracing.as_for_real``: "am I being
transformers' ``is_fake_tensor``                       traced?" answered as for real tensors
``torch.amp.GradScaler._maybe_opt_step``               ``capture.steps.finite_gradients``
``__init__`` of transformers' int-checked logits       ``capture.generation.symbolic_lengths``
processors
``_has_unfinished_sequences`` of the model             ``capture.generation.stopped_after``: the
generating (its instance)                              shortened run of ``capture.decode_steps``
``PyCodeCache.load_by_key_path``, ``AsyncCompile``'s   ``capture.compiled``: Inductor's generated
kernel compilers                                       wrapper loads, its kernels never compile
``torch.hub.download_url_to_file``                     ``integrations._common``: building a model
                                                       never downloads
``_chunk_with_empty`` in the globals of FSDP2's        ``capture.world``: the chunks a rank reads
``_fsdp_param``                                        made when read, not ``world_size`` views
bitsandbytes' ``MatMul8bitFp``                         ``corrections.libraries.bitsandbytes``: the
                                                       CUDA target trains with ``MatMul8bitLt``
FSDP2's ``FSDPParam.all_gather_inputs``,               ``capture.world.Offload``: the host-device
``foreach_reduce`` in the globals of                   copies of ``CPUOffloadPolicy`` on the CUDA
``_fsdp_param_group``, and ``torch.Tensor.to``         target, which a CPU mesh does not make
while it runs
``get_available_devices`` and ``torch`` in the         ``corrections.libraries.torchao``: its
globals of torchao's ``cpu_offload``,                  CUDA device on the CUDA target, with the
``torch.Tensor.record_stream``                         CPU's streams
=====================================================  ===========================================
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, MutableMapping
from typing import Any

_MISSING = object()
_ACTIVE: list[tuple[Any, str]] = []  # (owner, name) of every replacement in force, oldest first


def _get(owner, name: str):
    return owner.get(name, _MISSING) if isinstance(owner, MutableMapping) else owner.__dict__.get(name, _MISSING)


def _set(owner, name: str, value) -> None:
    if isinstance(owner, MutableMapping):
        if value is _MISSING:
            owner.pop(name, None)
        else:
            owner[name] = value
    elif value is _MISSING:
        delattr(owner, name)
    else:
        setattr(owner, name, value)


@contextlib.contextmanager
def patched(owner, name: str, value) -> Iterator[None]:
    """``owner.name`` (``owner[name]`` for a dict: a module's globals) is ``value`` for the block.

    What is restored is what ``owner`` itself held (its ``__dict__`` entry: a classmethod stays a
    classmethod, an inherited attribute is inherited again)."""
    found = _get(owner, name)
    _set(owner, name, value)
    entry = (owner, name)
    _ACTIVE.append(entry)
    try:
        yield
    finally:
        del _ACTIVE[next(i for i, e in enumerate(_ACTIVE) if e is entry)]  # by identity: owners may be dicts
        _set(owner, name, found)


@contextlib.contextmanager
def patched_all(replacements) -> Iterator[None]:
    """Each ``(owner, name, value)`` of ``replacements`` for the block (``patched``), undone in
    reverse order."""
    with contextlib.ExitStack() as stack:
        for owner, name, value in replacements:
            stack.enter_context(patched(owner, name, value))
        yield


def active() -> list[str]:
    """What is replaced now, as ``owner.name`` strings (outermost first)."""
    return [f"{getattr(owner, '__name__', type(owner).__name__)}.{name}" for owner, name in _ACTIVE]
