"""The target's final norm, applied by the export to a run that stored the last layer before it.

A run stores the model's last decoder layer before the final norm (what vLLM and speculators read); SpecForge's
EAGLE-3 `hidden_state` (and a DFlash context layer that is the last one) is the same layer after the norm. The norm
is one weight vector of the target, so the export applies it instead of a second stage-2 run.

The norm is the model's own module with its weight in the dtype the run computed in, as stage 2 loaded it
(job/target_weights.py). tests/test_export.py checks the result equals a run that stored the layer after the norm.
"""

from __future__ import annotations

from job.export.trainer_format import Plan
from job.target_weights import load_final_norm


def with_final_norm(plan: Plan) -> Plan:
    """`plan` with the target's final norm loaded when it has a layer to pass through it."""
    if plan.norm_slot is not None and plan.final_norm is None:
        plan.final_norm = load_final_norm(plan.model, plan.dtype)
    return plan
