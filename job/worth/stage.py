"""`python -m job worth` declared for job/stage.py's runner: its units are the drafters served (the target alone, the
trained draft, the same draft untrained, the target's MTP head where it has one), each done when its result under
RUN/reports/worth/ was served with the same settings and the same draft bytes (content, not a name: a retrained
draft is served again). The training before it is `python -m job train`'s own stage (job/train/run.py).

Each drafter is served by one vLLM engine in a process of its own (vLLM's metrics are process-wide, and an engine's
memory is only surely freed when its process ends), started by a Ray task on a GPU of the cluster where it has one:
the head of a GPU cluster has none. One at a time: each engine takes the GPU's memory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from job import layout, storage, target
from job.config import ConfigError, RunConfig, to_dict
from job.export.files import in_sample
from job.stage import Stage, StageSummary, run_stage
from job.train import TrainOptions
from job.train.run import TrainSummary, draft_config_of, draft_vocabulary, run_train
from job.train.serve import target_sampling
from job.worth import verdict

DRAFTERS = ("target", "untrained", "trained", "mtp")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")
# Prompt-length buckets the held-out prompts are served in, each counted on its own: acceptance falls as the context
# grows, and a drafter that holds up only on short prompts shows it here.
NUM_BUCKETS = 3


@dataclass(kw_only=True)
class WorthOptions:
    format: str = "eagle3"
    holdout: float = 0.1
    """The fraction of the run's samples (by a hash of the id) left out of training and served on."""
    rows: int = 32
    """Held-out prompts served (the first by id)."""
    k: int | None = None
    """Draft length served (default: the trained draft's own, 3 for EAGLE-3); the MTP head is served at the same."""
    max_tokens: int = 128
    """Tokens generated per prompt and pass."""
    train: TrainOptions | None = None
    """The training (default: one epoch, `--name worth-FORMAT`, `holdout`)."""

    def __post_init__(self):
        if not 0 < self.holdout < 1:
            raise ConfigError(f"worth: --holdout {self.holdout}: a fraction between 0 and 1")
        if self.rows < 1 or self.max_tokens < 1 or (self.k is not None and self.k < 1):
            raise ConfigError("worth: --rows, --max-tokens and --k must be at least 1")
        base = self.train or TrainOptions(format=self.format, name=f"worth-{self.format}")
        self.train = dataclasses.replace(base, format=self.format, holdout=self.holdout)


@dataclass
class Drafter:
    name: str
    num_rows: int
    identity: str
    done: bool = False

    def to_row(self) -> dict:
        return {"drafter": self.name}


@dataclass(kw_only=True)
class WorthSummary(StageSummary):
    verdict: dict = field(default_factory=dict)


class WorthStage(Stage):
    label, unit_noun, tokens_key = "worth", "drafters", "output_tokens"
    directory = layout.WORTH_DIR

    def __init__(self, config: RunConfig, options: WorthOptions, trained: TrainSummary):
        super().__init__(config)
        self.options, self.trained, self.key = options, trained, layout.worth_stage(options.format)

    def identity(self, record) -> dict:
        o = self.options
        return {"format": o.format, "holdout": o.holdout, "rows": o.rows, "k": self.k, "max_tokens": o.max_tokens}

    @property
    def k(self) -> int:
        return self.options.k or int(self.trained.speculative_config["num_speculative_tokens"])

    def plan(self, fence, changed) -> list[Drafter]:
        c, o = self.config, self.options
        self.prompts = held_out_prompts(c, o.holdout, o.rows)
        self.buckets = by_prompt_length(self.prompts, NUM_BUCKETS)
        self.sampling = run_sampling(c)
        names = [d for d in DRAFTERS if d != "mtp" or target.mtp_layers(target.config_json(c.model))]
        common = {"model": c.model, "k": self.k, "max_tokens": o.max_tokens, "sampling": self.sampling,
                  "prompts": [p["id"] for p in self.prompts]}
        drafters = []
        for name in names:
            identity = digest({**common, "drafter": name, "draft": self.draft_identity(name)})
            previous = read_result(self.result_uri(name), c.storage)
            drafters.append(Drafter(name, len(self.prompts), identity,
                                    done=previous is not None and previous.get("identity") == identity))
        return drafters

    def draft_identity(self, name: str):
        """What the drafter is, by content: the trained draft's weights' digest, the untrained one's config."""
        if name == "trained":
            return storage.sha256(storage.join(self.trained.draft, "model.safetensors"), self.config.storage)
        if name == "untrained":
            return draft_config_of(self.config, self.options.train)
        return None  # the target alone, or its own MTP head: the model's path and settings say it

    def result_uri(self, name: str) -> str:
        return storage.join(self.config.output, layout.WORTH_DIR, f"{self.options.format}-{name}.json")

    def is_done(self, unit: Drafter) -> bool:
        return unit.done

    def execute(self, ray_session, units, pending, fence) -> None:
        import ray  # heavy: imported on use

        from job.pipeline import job_errors_surface, runtime_env

        ray_session.start()
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        task = ray.remote(num_cpus=1, num_gpus=gpus, max_retries=0)(serve_drafter).options(
            runtime_env=runtime_env(self.config))
        with job_errors_surface():
            for unit in pending:  # one engine at a time: each takes the GPU's memory
                print(f"worth: serving {describe(unit.name, self.options.format)} on {len(self.prompts)} held-out "
                      f"prompts, k = {self.k if unit.name != 'target' else 0}", flush=True)
                result = ray.get(task.remote(self.spec(unit.name)))
                fence.write_json(self.result_uri(unit.name), {"identity": unit.identity, **result})
                print(f"worth: {verdict.one_drafter_line(unit.name, result)}", flush=True)

    def spec(self, name: str) -> dict:
        """What the engine's process needs to serve drafter `name` (engine_pass.py)."""
        c, o = self.config, self.options
        spec = {"model": c.model, "run_config": to_dict(c), "buckets": self.buckets, "sampling": self.sampling,
                "max_tokens": o.max_tokens, "drafter": name, "speculative_config": None,
                "storage": dataclasses.asdict(c.storage)}
        if name == "trained":
            spec["draft_uri"], spec["speculative_config"] = self.trained.draft, {"num_speculative_tokens": self.k}
        elif name == "untrained":
            draft_config = draft_config_of(c, o.train)
            freq = draft_vocabulary(c, o.train, draft_config)  # the trained draft's vocabulary
            spec["untrained"] = {"draft_config": draft_config, "format": o.format,
                                 "token_freq": sorted(freq.items()) if freq else None}  # JSON: pairs, not str keys
            spec["speculative_config"] = {"num_speculative_tokens": self.k}
        elif name == "mtp":
            spec["speculative_config"] = {"method": "mtp", "num_speculative_tokens": self.k}
        return spec

    def finish(self, units, fence) -> tuple[WorthSummary, dict]:
        c, o = self.config, self.options
        results = {u.name: read_result(self.result_uri(u.name), c.storage) for u in units}
        judged = verdict.judge(results, fmt=o.format, k=self.k, sampling=self.sampling, prompts=len(self.prompts),
                               run=c.output, trained=self.trained, holdout=o.holdout, max_tokens=o.max_tokens)
        report_uri = storage.join(c.output, layout.REPORTS_DIR, layout.WORTH_REPORT)
        everything = read_result(report_uri, c.storage) or {}
        everything.setdefault("formats", {})[o.format] = judged
        fence.write_json(report_uri, everything)
        png = verdict.plot(judged)
        if png is not None:
            fence.write_bytes(storage.join(c.output, layout.REPORTS_DIR, f"worth-{o.format}.png"), png)
        return (WorthSummary(output=c.output, verdict=judged, report=report_uri),
                {"verdict": judged["verdict"], "worth_training": judged["worth_training"]})

    def report(self, summary: WorthSummary, fence) -> None:
        print(verdict.table(summary.verdict) + f"\nworth: report {summary.report}", flush=True)


def run_worth(config: RunConfig, options: WorthOptions, *, take_lock: bool = False) -> WorthSummary:
    """Train a draft with a held-out slice left out, then serve the target with every drafter on that slice."""
    trained = run_train(config, options.train, take_lock=take_lock)
    return run_stage(WorthStage(config, options, trained), allow_drift=True, take_lock=take_lock)


# ---------------------------------------------------------------------------------------------------------------
# The prompts and settings served
# ---------------------------------------------------------------------------------------------------------------


def held_out_prompts(config: RunConfig, holdout: float, rows: int) -> list[dict]:
    """The first `rows` completion rows (by id) that training left out (`in_sample(id, holdout)`: the rule training
    skips them by), without an error: {"id", "prompt_token_ids"}."""
    from job.runview.notebook import read_rows  # the notebook's reader: trusted shards only

    table = read_rows(config.output, ["id", "prompt_token_ids", "error"], config.storage)
    kept = sorted((r for r in table.to_pylist() if r["error"] is None and in_sample(r["id"], holdout)),
                  key=lambda r: r["id"])
    if not kept:
        raise ConfigError(f"worth: none of the run's {table.num_rows:,} rows falls in the held-out {holdout:g}: "
                          "raise --holdout")
    return [{"id": r["id"], "prompt_token_ids": list(r["prompt_token_ids"])} for r in kept[:rows]]


def by_prompt_length(prompts: list[dict], n: int) -> dict[str, list[dict]]:
    """The prompts in up to `n` buckets of equal size by prompt length, named by their range ("12-40 tokens")."""
    ordered = sorted(prompts, key=lambda p: (len(p["prompt_token_ids"]), p["id"]))
    n = max(1, min(n, len(ordered)))
    buckets = {}
    for i in range(n):
        part = ordered[i * len(ordered) // n:(i + 1) * len(ordered) // n]
        lengths = [len(p["prompt_token_ids"]) for p in part]
        buckets[f"{min(lengths)}-{max(lengths)} tokens"] = [{"prompt_token_ids": p["prompt_token_ids"]}
                                                            for p in part]
    return buckets


def run_sampling(config: RunConfig) -> dict:
    """The run's own sampling settings: the model's generation_config.json under the config's `generate.sampling`."""
    given = {k: v for k, v in config.generate.sampling.items() if k in SAMPLING_KEYS}
    return {**target_sampling(config.model), **given}


def describe(name: str, fmt: str) -> str:
    return {"target": "the target alone", "untrained": f"an untrained {fmt} draft",
            "trained": f"the trained {fmt} draft", "mtp": "the target's own MTP head"}[name]


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:32]


def read_result(uri: str, storage_config) -> dict | None:
    try:
        return storage.read_json(uri, storage_config)
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------------------------
# On the worker
# ---------------------------------------------------------------------------------------------------------------


def serve_drafter(spec: dict) -> dict:
    """A Ray task: serve one drafter in a process of its own (engine_pass.py) and return what it counted, or
    {"error": its last lines} where the engine could not serve it (a result, reported: not every target's MTP head
    or architecture is served by every vLLM build)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory(prefix="worth-") as work:
        path = os.path.join(work, "spec.json")
        with open(path, "w") as f:
            json.dump({**spec, "workdir": work}, f)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run([sys.executable, "-m", "job.worth.engine_pass", path], capture_output=True, text=True,
                              env=env)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    if line is None:
        tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-3:]
        return {"error": f"the engine's process ended with {proc.returncode}: " + " | ".join(tail)[-800:]}
    return json.loads(line[len("RESULT "):])
