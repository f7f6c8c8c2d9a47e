"""What each drafter trainer reads from the target: its default layers, and the one stage-2 layer set that serves
them all (a 45-hour stage-2 run must not have to be redone for the other drafter).

Layer ids here are ours (= SpecForge's): layer k = output of decoder layer k = transformers output_hidden_states[k + 1].

The trainers' own defaults, read from their code (SpecForge 0.2.0, speculators 0.9.0):
- SpecForge DFlash: `build_target_layer_ids(num_target_layers, num_draft_layers)` (modeling/draft/dflash.py):
  `num_draft_layers` ids evenly spaced from 1 to num_layers - 3. For Qwen3.6-27B (64 layers), 5 draft layers:
  [1, 16, 31, 46, 61].
- SpecForge EAGLE-3: `[1, n // 2 - 1, n - 4]` (algorithms/model_providers.py, `resolve_eagle_capture_layers`), plus the
  last layer AFTER the final norm as `hidden_state` (it feeds it to the target's LM head).
- speculators EAGLE-3 and DFlash: `[2, n // 2, n - 3]` in vLLM's convention (models/utils.py,
  `resolve_target_layer_ids`) = ours [1, n // 2 - 1, n - 4], the same layers as SpecForge's EAGLE-3; plus the last
  layer BEFORE the final norm (vLLM id n).

So one run stores the union, with the last layer before the norm: the export applies the target's final norm for
the trainers that want it after (job/export/norm.py). For 64 layers: [1, 16, 31, 46, 60, 61, 63], 7 layers instead of
DFlash's 5 (+40 % bytes). A model too small for the defaults (the tiny fixtures have 4 layers, where
[1, n // 2 - 1, n - 4] = [1, 1, 0] repeats a layer) gets distinct layers spread over 0..n-2 instead.
"""

from __future__ import annotations

EVERY_TRAINER = "every_trainer"
"""The value of `hidden_states.layer_ids` that stores the union below (the default)."""
DFLASH_DRAFT_LAYERS = 5
"""Draft layers of the DFlash drafters for Qwen3.6-27B and Qwen3-8B: the count SpecForge's default layer ids follow."""
EAGLE3_AUX_LAYERS = 3  # low, middle, high: both trainers take exactly three


def _spread(num_layers: int, count: int) -> list[int]:
    """`count` distinct layers spread evenly over 0..num_layers-2 (the last layer is taken apart), for a model too
    small for a trainer's formula."""
    top = num_layers - 2
    count = max(1, min(count, top + 1))
    if count == 1:
        return [top // 2]
    return sorted({round(i * top / (count - 1)) for i in range(count)})


def _usable(ids: list[int], num_layers: int, count: int) -> bool:
    return len(set(ids)) == count and all(0 <= k < num_layers - 1 for k in ids)


def dflash_layers(num_layers: int, num_draft_layers: int = DFLASH_DRAFT_LAYERS) -> list[int]:
    """SpecForge DFlash's default context layers (`build_target_layer_ids`)."""
    if num_draft_layers == 1:
        ids = [num_layers // 2]
    else:
        span = num_layers - 3 - 1
        ids = [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]
    return ids if _usable(ids, num_layers, num_draft_layers) else _spread(num_layers, num_draft_layers)


def eagle3_layers(num_layers: int) -> list[int]:
    """The low/middle/high aux layers both trainers default to (ours; speculators adds 1)."""
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    return ids if _usable(ids, num_layers, EAGLE3_AUX_LAYERS) else _spread(num_layers, EAGLE3_AUX_LAYERS)


def default_aux_layers(to: str, format: str, num_layers: int) -> list[int]:
    """The aux / context layers an export gives a trainer when the user names none: the trainer's own default."""
    if to == "specforge" and format == "dflash":
        return dflash_layers(num_layers)
    return eagle3_layers(num_layers)


def every_trainer_layers(num_layers: int) -> list[int]:
    """One stage-2 layer set every export can be cut from: DFlash's layers, EAGLE-3's three and the last layer."""
    return sorted(set(dflash_layers(num_layers)) | set(eagle3_layers(num_layers)) | {num_layers - 1})


def describe(num_layers: int) -> str:
    """One line saying which layer serves which trainer (for `plan` and the stage-2 banner)."""
    return (f"DFlash {dflash_layers(num_layers)}, EAGLE-3 aux {eagle3_layers(num_layers)}, last layer "
            f"{num_layers - 1} before the final norm (the export applies the norm for SpecForge)")
