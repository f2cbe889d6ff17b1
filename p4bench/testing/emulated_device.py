"""An accelerator emulated on the CPU, to test device handling where there is no GPU.

`install()` registers a device type `emu` (PyTorch's PrivateUse1 backend, renamed).
Tensors on it are CPU tensors wrapped in `EmulatedTensor`, which computes on the CPU
but keeps a GPU's rules:

- an operation mixing an `emu` tensor with a CPU tensor that has dimensions fails, as
  CUDA does (0-dim CPU tensors and CPU index tensors are allowed, as CUDA allows them,
  and so is `copy_` between the two devices, a transfer);
- `.numpy()` on an `emu` tensor fails, as it does on CUDA (`.cpu()` first);
- factory calls with `device=emu` (or inside `torch.device("emu")`) make `emu` tensors,
  and a CPU `torch.Generator` cannot draw them;
- every read back to the host (`.item()`, `.tolist()`, a copy to the CPU) is counted
  in `host_reads`, so a test can bound the host round trips of a hot path.

So a run with `--device emu` fails wherever a run with `--device cuda` would fail for a
misplaced tensor, and the suite checks that on machines without a GPU. Only for tests:
every operation goes through Python and is slow.

Registering a PrivateUse1 backend makes it the process's accelerator in PyTorch's eyes,
and autograd on CUDA tensors then fails (an internal assert about streams). So `emu` is
registered at import only where CUDA is not available (early: autograd sizes its device
queues at its first backward pass); where it is, `install()` and `emulation()` refuse
with `EmulationUnavailable`: test on the real GPU there (`pytest -m cuda`; the
conformance kit's `accelerator` runtime uses CUDA itself).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from p4bench.engine.devices import register_emulated_type

__all__ = [
    "EMULATED",
    "EmulatedTensor",
    "EmulationUnavailable",
    "install",
    "emulation",
    "host_reads",
    "reset_host_reads",
    "available",
    "accelerator_device",
    "accelerator_scope",
]

_lock = threading.Lock()
_installed = False
_reads = {"count": 0}
_HOST = torch.device("cpu")
# Ops where CUDA accepts CPU index tensors for an accelerator `self`.
_INDEX_OPS = {"aten::index.Tensor", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"}
# Copies between the devices, which CUDA performs (host to device, device to host).
_COPY_OPS = {"aten::copy_"}


def host_reads() -> int:
    """How many values were read back to the host since the last reset."""
    return _reads["count"]


def reset_host_reads() -> None:
    _reads["count"] = 0


def _is_emulated(device: Any) -> bool:
    return device is not None and not isinstance(device, int) and torch.device(device).type == "emu"


class EmulatedTensor(torch.Tensor):
    """A CPU tensor (`elem`) that reports device `emu:0`."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> EmulatedTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.shape,
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=_DEVICE["emu"],
            requires_grad=elem.requires_grad,
        )
        wrapper.elem = elem
        return wrapper

    def __repr__(self) -> str:  # type: ignore[override]
        return f"EmulatedTensor({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        kwargs = dict(kwargs or {})
        emulated, host = [False], [False]

        def unwrap(value: Any) -> Any:
            if isinstance(value, EmulatedTensor):
                emulated[0] = True
                return value.elem
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                host[0] = True
            return value

        plain_args, plain_kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        generator = next(
            (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Generator)), None
        )
        if emulated[0] and generator is not None and generator.device.type != "emu":
            # in-place sampling (`t.normal_(generator=g)`): CUDA refuses a CPU generator too
            raise RuntimeError(
                f"Expected a 'emu' device type for generator but found '{generator.device.type}'"
            )
        name = func._schema.name + (
            f".{func._overloadname}" if func._overloadname != "default" else ""
        )
        indexing = name in _INDEX_OPS or func._schema.name in _INDEX_OPS
        copying = func._schema.name in _COPY_OPS
        if (
            emulated[0]
            and host[0]
            and not copying
            and not (indexing and isinstance(args[0], EmulatedTensor))
        ):
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, "
                f"emu:0 and cpu! (in {func})"
            )
        if copying and not isinstance(
            args[0], EmulatedTensor
        ):  # device to host into a CPU tensor: a read
            _reads["count"] += 1
            func(*plain_args, **plain_kwargs)
            return args[0]
        target = plain_kwargs.get("device")
        to_host = target is not None and torch.device(target).type == "cpu"
        if _is_emulated(target):
            plain_kwargs["device"] = _HOST
        if func is torch.ops.aten._local_scalar_dense.default or (to_host and emulated[0]):
            _reads["count"] += 1
        out = func(*plain_args, **plain_kwargs)
        if to_host:
            return out
        return tree_map(lambda t: EmulatedTensor(t) if type(t) is torch.Tensor else t, out)


def _target_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if "device" in kwargs:
        return kwargs["device"]
    return next((a for a in args[1:] if isinstance(a, (str, torch.device))), None)


class _EmulationMode(TorchFunctionMode):
    """Routes factory calls and moves that name the `emu` device to the wrappers."""

    def __init__(self, constructors: set[Callable[..., Any]]) -> None:
        super().__init__()
        self.constructors = constructors

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func in self.constructors and _is_emulated(kwargs.get("device")):
            generator = kwargs.get("generator")
            if generator is not None and generator.device.type != "emu":
                raise RuntimeError(
                    f"Expected a 'emu' device type for generator but found '{generator.device.type}'"
                )
            kwargs["device"] = _HOST
            return EmulatedTensor(func(*args, **kwargs))
        if func is torch.Tensor.to and _is_emulated(_target_device(args, kwargs)):
            source = args[0]
            rest = [a for a in args[1:] if not isinstance(a, (str, torch.device))]
            kwargs.pop("device", None)
            kwargs.pop("non_blocking", None)
            if isinstance(source, EmulatedTensor):
                return source.to(*rest, **kwargs) if rest or kwargs else source
            return EmulatedTensor(
                source.to(*rest, **kwargs).clone()
                if not rest and not kwargs
                else source.to(*rest, **kwargs)
            )
        if func is torch.Tensor.tolist and isinstance(args[0], EmulatedTensor):
            _reads["count"] += 1
            return args[0].elem.tolist()
        if func is torch.Tensor.numpy and isinstance(args[0], EmulatedTensor):
            raise TypeError(
                "can't convert emu:0 device type tensor to numpy. "
                "Use Tensor.cpu() to copy the tensor to host memory first."
            )
        if func is torch.Tensor.pin_memory:  # no pinned memory without an accelerator runtime
            return args[0]
        if func is torch.Tensor.untyped_storage and isinstance(args[0], EmulatedTensor):
            return args[0].elem.untyped_storage()
        return func(*args, **kwargs)


_library: Any = None


def _register_allocators() -> None:
    """Allocations that PyTorch's C++ code makes on the `emu` device (a scalar that
    `x[mask] = 1.0` puts there, say) become emulated tensors too."""
    global _library
    _library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]  # torch leaves Library.__init__ unannotated

    def empty(
        size: Any,
        dtype: Any = None,
        layout: Any = None,
        device: Any = None,
        pin_memory: Any = None,
        memory_format: Any = None,
    ) -> torch.Tensor:
        return EmulatedTensor(torch.empty(size, dtype=dtype, device=_HOST))

    def empty_strided(
        size: Any,
        stride: Any,
        dtype: Any = None,
        layout: Any = None,
        device: Any = None,
        pin_memory: Any = None,
    ) -> torch.Tensor:
        return EmulatedTensor(torch.empty_strided(size, stride, dtype=dtype, device=_HOST))

    _library.impl("empty.memory_format", empty, "PrivateUse1")
    _library.impl("empty_strided", empty_strided, "PrivateUse1")


class EmulationUnavailable(RuntimeError):
    """The emulated accelerator cannot be registered in a process that uses CUDA."""


def available() -> bool:
    """Whether the emulated accelerator can be used here (no CUDA in this process)."""
    return _installed or not torch.cuda.is_available()


def install() -> torch.device:
    """Register the `emu` device type (once per process: PyTorch allows one rename of its
    PrivateUse1 backend). Returns the emulated device. Refused (`EmulationUnavailable`)
    where CUDA is available: the registered backend would break CUDA autograd."""
    global _installed
    with _lock:
        if not _installed:
            if torch.cuda.is_available():
                raise EmulationUnavailable(
                    "the emulated accelerator 'emu' is for machines without a GPU: registering it makes PyTorch's "
                    "autograd fail on CUDA tensors in this process; here, run on the real GPU (pytest -m cuda)"
                )
            from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

            if torch._C._get_privateuse1_backend_name() != "emu":
                _setup_privateuseone_for_python_backend("emu")
            _register_allocators()
            register_emulated_type("emu")
            _DEVICE["emu"] = torch.device("emu", 0)
            _installed = True
    return _DEVICE["emu"]


_DEVICE: dict[str, torch.device] = {}
# Registered at import (before any backward pass: autograd sizes its per-device queues at
# its first one), except where CUDA is available (None there: see the module docstring).
EMULATED: torch.device | None = None if torch.cuda.is_available() else install()


@contextlib.contextmanager
def emulation() -> Iterator[torch.device]:
    """Inside: factory calls and moves naming `emu` make emulated tensors (this thread)."""
    from torch.utils._device import _device_constructors

    device = install()
    with _EmulationMode(set(_device_constructors())):
        yield device


def accelerator_device() -> str:
    """The device of the conformance kit's `accelerator` runtime: the emulated `emu`, or
    CUDA itself where CUDA is available (where `emu` cannot be registered)."""
    return "emu" if available() else "cuda"


@contextlib.contextmanager
def accelerator_scope() -> Iterator[None]:
    """What a run on `accelerator_device()` needs around it: `emulation()` for `emu`."""
    if accelerator_device() == "emu":
        with emulation():
            yield
    else:
        yield
