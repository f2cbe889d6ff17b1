"""Helpers for client state: nested dicts of tensors with a leading client axis."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

State = dict[str, Any]  # nested dict whose leaves are tensors with a leading client axis


def tree_map(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {key: tree_map(fn, value) for key, value in tree.items()}
    return fn(tree)


def take_rows(state: State, rows: torch.Tensor) -> State:
    """The sub-state of the clients at positions `rows`."""
    sub: State = tree_map(lambda t: t[rows], state)
    return sub


def put_rows(state: State, rows: torch.Tensor, sub: State) -> State:
    """A copy of `state` whose rows at `rows` are replaced by `sub`."""

    def merge(full: Any, part: Any) -> Any:
        if isinstance(full, Mapping):
            return {key: merge(full[key], part[key]) for key in full}
        out = full.clone()
        out[rows] = part.to(out.dtype)
        return out

    merged: State = merge(state, sub)
    return merged


def cat_rows(states: list[State]) -> State:
    first = states[0]
    if isinstance(first, Mapping):
        return {key: cat_rows([s[key] for s in states]) for key in first}
    return torch.cat(states)


def flatten(tree: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, torch.Tensor]:
    """{"a": {"b": t}} -> {"a.b": t}. Use a `sep` that cannot occur in keys when leaves
    are parameter dicts whose names contain dots (``conv1.weight``)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + sep, sep))
        else:
            out[name] = value
    return out


def unflatten(flat: Mapping[str, torch.Tensor], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """Inverse of `flatten` (same `sep`) for the keys starting with `prefix`."""
    out: dict[str, Any] = {}
    for name, value in flat.items():
        if not name.startswith(prefix):
            continue
        *parents, leaf = name[len(prefix) :].split(sep)
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def strip_prefix(flat: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """{prefix + name: t} -> {name: t} for the keys with `prefix`; parameter names may
    themselves contain dots (``conv1.weight``), so this never splits them."""
    return {name[len(prefix) :]: value for name, value in flat.items() if name.startswith(prefix)}


def vectorize(params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """(C, P): every client's parameters flattened in key order."""
    return torch.cat([params[k].flatten(start_dim=1) for k in sorted(params)], dim=1)


def unvectorize(vector: torch.Tensor, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `vectorize`, shaped like `like` (which has a leading client axis)."""
    out, offset = {}, 0
    for key in sorted(like):
        shape = like[key].shape[1:]
        size = int(torch.Size(shape).numel())
        out[key] = vector[:, offset : offset + size].reshape(vector.shape[0], *shape)
        offset += size
    return out
