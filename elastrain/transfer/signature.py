"""Model signatures: the (name, shape, dtype) list of a model's state_dict.

Pure local functions; no communication. A signature is plain JSON so that it can
travel in a manifest and be compared on the receiving side.
"""

from __future__ import annotations

from typing import Any

import torch

from elastrain.transfer.names import model_state


def model_signature(
    model: torch.nn.Module, walked: dict[str, Any] | None = None
) -> list[list[Any]]:
    """Return ``[[name, shape, dtype], ...]`` for ``model.state_dict()`` in order.

    ``walked``: the model's `model_state`, walked already (the walk is most of
    the cost, and a heal needs it several times).

    ``name`` is the state_dict key without torch.compile's ``_orig_mod.`` segments
    (`elastrain.transfer.names`): a compiled model has the signature of the model
    it wraps.

    ``shape`` is a ``list[int]`` and ``dtype`` is ``str(tensor.dtype)`` (for
    example ``"torch.float32"``), so the result is JSON-able and survives a JSON
    round trip unchanged. Raises TypeError for a non-tensor state_dict value
    (``get_extra_state``), which elastrain cannot move without pickle.
    """
    out: list[list[Any]] = []
    for name, value in (model_state(model) if walked is None else walked).items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"state_dict entry {name!r} is a {type(value).__name__}, not a tensor; "
                "elastrain moves only tensors (no pickle): drop get_extra_state or "
                "store it as a tensor buffer"
            )
        out.append([name, [int(d) for d in value.shape], str(value.dtype)])
    return out


def _describe(entry: list[Any]) -> str:
    name, shape, dtype = entry
    return f"{name!r} {list(shape)} {dtype}"


def signature_mismatch(mine: list[Any], theirs: list[Any]) -> str | None:
    """Compare a local signature with a remote one.

    Returns None when they are equal, otherwise a one-line message naming the
    first differing entry: a shape or dtype difference, an entry missing from or
    extra in the local model, or the same names in a different order.
    """
    mine_l = [[e[0], list(e[1]), e[2]] for e in mine]
    theirs_l = [[e[0], list(e[1]), e[2]] for e in theirs]
    if mine_l == theirs_l:
        return None
    mine_names = {e[0] for e in mine_l}
    theirs_names = {e[0] for e in theirs_l}
    for i in range(max(len(mine_l), len(theirs_l))):
        a = mine_l[i] if i < len(mine_l) else None
        b = theirs_l[i] if i < len(theirs_l) else None
        if a == b:
            continue
        if a is None:
            assert b is not None
            return (
                f"model signature differs at entry {i}: {_describe(b)} is missing from "
                f"the local model (local has {len(mine_l)} entries, remote {len(theirs_l)})"
            )
        if b is None:
            return (
                f"model signature differs at entry {i}: {_describe(a)} is extra in the "
                f"local model (local has {len(mine_l)} entries, remote {len(theirs_l)})"
            )
        if a[0] != b[0]:
            if b[0] not in mine_names:
                return (
                    f"model signature differs at entry {i}: {_describe(b)} is missing "
                    f"from the local model (local has {_describe(a)} there)"
                )
            if a[0] not in theirs_names:
                return (
                    f"model signature differs at entry {i}: {_describe(a)} is extra in "
                    f"the local model (remote has {_describe(b)} there)"
                )
            return (
                f"model signature differs at entry {i}: same names in a different order "
                f"(local {a[0]!r}, remote {b[0]!r})"
            )
        if a[1] != b[1]:
            return (
                f"model signature differs at entry {i}: {a[0]!r} has shape {a[1]} locally "
                f"but {b[1]} remotely"
            )
        return (
            f"model signature differs at entry {i}: {a[0]!r} has dtype {a[2]} locally "
            f"but {b[2]} remotely"
        )
    return "model signatures differ"  # unreachable: equal lists returned above
