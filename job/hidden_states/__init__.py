"""Stage 2: completion shards → the target model's hidden states, as Arrow shards or a stream into a trainer.

    python -m job hidden-states --config configs/demo.yaml --output demo-run

    from job.hidden_states import load, dataset, collate
    for sample in load("demo-run"):               # written shards; hidden_states views the file (no copy)
        sample["hidden_states"]                   # torch.bfloat16 [num_tokens, num_layers, hidden]
    ds = dataset(config)                           # the same records, never written: a ray.data.Dataset
    for batch in ds.iter_torch_batches(batch_size=8, collate_fn=collate):
        batch["hidden_states"]                    # list of 8 bf16 tensors [num_tokens, num_layers, hidden]

Modules, in the order a unit meets them:
    run.py                   the stage as job/stage.py's runner takes it; `dataset` (the stream)
    plan.py                  units (one per completion shard), what earlier runs left, the storage estimate
    actor.py                 the Ray Data actor: one per GPU, one completion shard per call
    samples.py               completion rows → samples → parts → batches; host buffers
    transformers_backend.py  forward passes with hooks on the chosen layers (packing.py keeps packed batches exact)
    vllm_backend.py          the same from vLLM's prefill (CUDA only)
    checks.py                feature sanity checks and the exactness self-check against a plain forward
    shards.py                features → Arrow parts (background writer) and back, zero-copy: `load`
    report.py                each unit's summary taken, the report at the end
    verify.py                `hidden-states --check`: a finished run's shards against a plain forward
The core (samples, backends, checks, shards) needs no Ray: it runs where only torch, transformers and pyarrow are.
"""

from job.hidden_states.actor import collate
from job.hidden_states.checks import HiddenStateCheckError
from job.hidden_states.plan import estimate_storage, plan_units
from job.hidden_states.report import HiddenStatesSummary
from job.hidden_states.run import dataset, run_hidden_states
from job.hidden_states.shards import load
from job.hidden_states.verify import check_run

__all__ = ["run_hidden_states", "HiddenStatesSummary", "estimate_storage", "dataset", "collate", "load", "check_run",
           "plan_units", "HiddenStateCheckError"]
