"""Plain encoding of run state, for checkpoints that `torch.load(weights_only=True)` reads.

`encode` turns tensors, numpy arrays, torch generators, numbers, strings, bytes and
containers of them into dicts, lists and tensors (tagged where the type must come
back); `capture` does so for the instance attributes of a plugin object that hold run
state. `decode_into` writes a saved value back into the live object of the same kind
(tensors, arrays and generators in place, containers item by item), so references other
objects hold stay valid; `restore_object` does so for a captured object.

Encoded tensors are on the host whatever device the run used (a checkpoint of a run on
an accelerator loads anywhere); `decode_into` puts a tensor back on the device of the
live tensor it replaces, others on the `device` it is given (the run's).

Functions, models and secret sources are taken as stateless and left out; so are the
config, public data and attributes named like caches or scratch memory. Whatever else
cannot be encoded (locks, handles, foreign key objects) is left out and its path
reported in `unsaved`.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from p4bench.rng import SecretSource

__all__ = ["encode", "capture", "decode_into", "restore_object"]

_TAG = "__p4bench__"
# Attributes of plugin objects that are not run state: set from the config, shared, or rebuilt on demand.
_SKIP_NAMES = frozenset({"config", "model", "public_data"})
# ... and attributes named like caches or reusable scratch memory (rebuilt on demand, often large).
_SCRATCH_WORDS = ("cache", "scratch", "workspace", "buffer")
_MAX_DEPTH = 8


class _Skip:
    pass


_SKIP = _Skip()


def _stateless(value: Any) -> bool:
    """Values taken as carrying no run state: code, models (their parameters live in the
    client state), and secret randomness (`SecretSource`: a resumed run draws fresh secrets)."""
    return (
        isinstance(
            value,
            (
                types.FunctionType,
                types.BuiltinFunctionType,
                types.MethodType,
                types.ModuleType,
                type,
                enum.Enum,
                torch.nn.Module,
                range,
                slice,
                SecretSource,
            ),
        )
        or callable(value)
        and not hasattr(value, "__dict__")
    )


def encode(
    value: Any,
    unsaved: list[str] | None = None,
    path: str = "",
    _seen: frozenset[int] = frozenset(),
) -> Any:
    """`value` as plain dicts, lists and tensors (tagged where the type must come back);
    what cannot be encoded is left out and its path appended to `unsaved`."""
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        return {
            _TAG: "int",
            "v": hex(value),
        }  # big integers (keys, counters) as text: the safe loader reads no LONG4
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {_TAG: "dtype", "v": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if tensor.device.type != "cpu":
            return (
                tensor.cpu()
            )  # a compact host copy: checkpoints do not depend on the run's device
        compact = (
            tensor.is_contiguous()
            and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        )
        return tensor if compact else tensor.clone()  # a view would save its whole storage
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            return _unsaved(unsaved, path)
        raw = (
            torch.frombuffer(bytearray(np.ascontiguousarray(value).tobytes()), dtype=torch.uint8)
            if value.nbytes
            else torch.zeros(0, dtype=torch.uint8)
        )
        return {_TAG: "ndarray", "bytes": raw, "dtype": value.dtype.str, "shape": list(value.shape)}
    if isinstance(value, torch.Generator):
        return {_TAG: "generator", "state": value.get_state()}
    if isinstance(value, (bytes, bytearray)):
        return {
            _TAG: "bytes",
            "v": torch.frombuffer(bytearray(value), dtype=torch.uint8)
            if value
            else torch.zeros(0, dtype=torch.uint8),
        }
    if id(value) in _seen or len(_seen) > _MAX_DEPTH or _stateless(value):
        return _SKIP
    seen = _seen | {id(value)}
    if isinstance(value, list):
        return [_keep(encode(v, unsaved, f"{path}[{i}]", seen)) for i, v in enumerate(value)]
    if isinstance(value, (tuple, set, frozenset)):
        kind = "tuple" if isinstance(value, tuple) else "set"
        return {
            _TAG: kind,
            "v": [_keep(encode(v, unsaved, f"{path}[{i}]", seen)) for i, v in enumerate(value)],
        }
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and k != _TAG for k in value):
            items = {k: encode(v, unsaved, f"{path}.{k}", seen) for k, v in value.items()}
            return {k: v for k, v in items.items() if v is not _SKIP}
        pairs = [
            [encode(k, unsaved, f"{path}.key", seen), encode(v, unsaved, f"{path}[{k!r}]", seen)]
            for k, v in value.items()
        ]
        return {_TAG: "dict", "v": [p for p in pairs if p[0] is not _SKIP and p[1] is not _SKIP]}
    if hasattr(value, "__dict__"):
        return {_TAG: "object", "v": capture(value, unsaved, path, seen)}
    return _unsaved(unsaved, path)


def _keep(value: Any) -> Any:
    return None if value is _SKIP else value


def _unsaved(unsaved: list[str] | None, path: str) -> _Skip:
    if unsaved is not None:
        unsaved.append(path)
    return _SKIP


def capture(
    obj: Any, unsaved: list[str] | None = None, path: str = "", _seen: frozenset[int] = frozenset()
) -> dict[str, Any]:
    """The instance attributes of `obj` that hold run state, encoded (see the module doc)."""
    if obj is None:
        return {}
    out: dict[str, Any] = {}
    for name, value in vars(obj).items():
        if name in _SKIP_NAMES or any(word in name.lower() for word in _SCRATCH_WORDS):
            continue
        encoded = encode(value, unsaved, f"{path}.{name}" if path else name, _seen | {id(obj)})
        if encoded is not _SKIP:
            out[name] = encoded
    return out


def decode_into(existing: Any, saved: Any, device: torch.device | None = None) -> Any:
    """The value `saved` encodes, written into `existing` where it is of the same kind
    (tensors, arrays and generators in place, containers and objects item by item), so
    references other objects hold stay valid; returns the value to store. A tensor that
    replaces a live one goes to that tensor's device, any other to `device` (None: stays
    where it was loaded, the host)."""
    if isinstance(saved, torch.Tensor):
        if (
            isinstance(existing, torch.Tensor)
            and existing.shape == saved.shape
            and existing.dtype == saved.dtype
        ):
            with torch.no_grad():
                existing.copy_(saved)
            return existing
        place = existing.device if isinstance(existing, torch.Tensor) else device
        return saved if place is None or saved.device == place else saved.to(place)
    if isinstance(saved, list):
        if isinstance(existing, list) and len(existing) == len(saved):
            existing[:] = [decode_into(e, s, device) for e, s in zip(existing, saved)]
            return existing
        return [decode_into(None, s, device) for s in saved]
    if not isinstance(saved, dict):
        return saved
    tag = saved.get(_TAG)
    if tag is None:
        target = existing if isinstance(existing, dict) else {}
        new = {k: decode_into(target.get(k), v, device) for k, v in saved.items()}
        target.clear()
        target.update(new)
        return target
    if tag == "ndarray":
        array = (
            np.frombuffer(saved["bytes"].numpy().tobytes(), dtype=np.dtype(saved["dtype"]))
            .reshape(saved["shape"])
            .copy()
        )
        same = (
            isinstance(existing, np.ndarray)
            and existing.shape == array.shape
            and existing.dtype == array.dtype
        )
        if same and existing.flags.writeable:
            existing[...] = array
            return existing
        return array
    if tag == "generator":
        generator = existing if isinstance(existing, torch.Generator) else torch.Generator()
        generator.set_state(saved["state"])
        return generator
    if tag == "int":
        return int(saved["v"], 16)
    if tag == "dtype":
        return getattr(torch, saved["v"])
    if tag == "bytes":
        return bytes(saved["v"].numpy().tobytes())
    if tag in ("tuple", "set"):
        olds = (
            list(existing)
            if isinstance(existing, tuple) and len(existing) == len(saved["v"])
            else [None] * len(saved["v"])
        )
        items = [decode_into(e, s, device) for e, s in zip(olds, saved["v"])]
        return tuple(items) if tag == "tuple" else set(items)
    if tag == "dict":
        target = existing if isinstance(existing, dict) else {}
        pairs = [(_hashable(decode_into(None, k)), v) for k, v in saved["v"]]
        new = {k: decode_into(target.get(k), v, device) for k, v in pairs}
        target.clear()
        target.update(new)
        return target
    if tag == "object":
        if existing is not None and hasattr(existing, "__dict__"):
            restore_object(existing, saved["v"], device)
        return existing
    raise ValueError(f"unknown checkpoint entry {tag!r}")


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def restore_object(obj: Any, saved: Mapping[str, Any], device: torch.device | None = None) -> None:
    """Write attributes saved by `capture` back into `obj` (new tensors on `device`, as
    `decode_into`)."""
    if obj is None:
        return
    for name, value in saved.items():
        current = getattr(obj, name, None)
        new = decode_into(current, value, device)
        if new is not current:
            object.__setattr__(obj, name, new)  # also into frozen dataclasses
