"""The target layer ids a drafter taps: the one rule, shared by extract (what to capture), the workflow (which
keys decide the features) and train (checking the features against the config).

Semantics, fixed: **id i = output of decoder layer i = HF ``output_hidden_states[i + 1]``** (for the last layer,
the output after the final norm), the convention of the official DFlash code, SpecForge and vLLM's
``dflash_config``.

The rule: ``drafter.target_layer_ids`` when set; otherwise the official formula (:func:`default_target_layer_ids`)
over ``drafter.num_target_features`` taps, which defaults to ``drafter.num_layers``.

Importing this module does not import torch or transformers (the workflow is planned without them).
"""

from __future__ import annotations

from collections.abc import Sequence


def default_target_layer_ids(num_target_layers: int, num_layers: int) -> list[int]:
    """Target layer ids tapped by default (the official z-lab formula, ``dflash.model.build_target_layer_ids``).

    ``n = 1`` -> ``[L // 2]``; otherwise ``round(1 + i * (L - 4) / (n - 1))`` for ``i = 0 .. n - 1``: spread from
    layer 1 to layer L - 3. Python's ``round`` (banker's rounding) as in the official code.

    Args:
        num_target_layers: L, decoder layers of the target (>= 4 when ``num_layers > 1``).
        num_layers: n, how many target layers to tap (the drafter's layer count by convention).

    Raises:
        ValueError: ``num_layers < 1``, or the formula would give ids outside ``0 .. L - 1`` or duplicates.
    """
    if num_layers < 1:
        raise ValueError(f"need at least one tapped layer, got {num_layers}")
    if num_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    ids = [round(start + i * (end - start) / (num_layers - 1)) for i in range(num_layers)]
    if min(ids) < 0 or max(ids) >= num_target_layers or len(set(ids)) != len(ids):
        raise ValueError(f"the default formula gives target layer ids {ids} for a {num_target_layers}-layer "
                         f"target and {num_layers} taps; set drafter.target_layer_ids explicitly")
    return ids


def num_tapped_layers(target_layer_ids: Sequence[int] | None, num_target_features: int | None,
                      num_layers: int | None) -> int:
    """How many target layers the drafter reads: ``len(target_layer_ids)`` when set, else
    ``num_target_features``, else ``num_layers`` (else 1) -- the config keys of the ``drafter`` section."""
    if target_layer_ids is not None:
        return len(target_layer_ids)
    return int(num_target_features or num_layers or 1)


def validate_layer_ids(layer_ids: Sequence[int], num_target_layers: int) -> list[int]:
    """``layer_ids`` as ints, checked against the target's L decoder layers.

    Raises:
        ValueError: an empty list, an id outside ``0 .. L - 1`` (named), or duplicates.
    """
    if not layer_ids:
        raise ValueError("target_layer_ids is empty")
    for i in layer_ids:
        if not 0 <= int(i) < num_target_layers:
            raise ValueError(f"target layer id {i} is outside 0..{num_target_layers - 1} "
                             f"(id i = output of decoder layer i)")
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"target_layer_ids {list(layer_ids)} has duplicates")
    return [int(i) for i in layer_ids]


def tapped_layer_ids(target_layer_ids: Sequence[int] | None, num_target_features: int | None,
                     num_layers: int | None, num_target_layers: int) -> list[int]:
    """The target layer ids to tap: ``target_layer_ids`` when set, else the official formula over
    :func:`num_tapped_layers` taps; validated against the target's ``num_target_layers``.

    Raises:
        ValueError: see :func:`validate_layer_ids` and :func:`default_target_layer_ids`.
    """
    if target_layer_ids is None:
        ids = default_target_layer_ids(num_target_layers,
                                       num_tapped_layers(None, num_target_features, num_layers))
    else:
        ids = list(target_layer_ids)
    return validate_layer_ids(ids, num_target_layers)
