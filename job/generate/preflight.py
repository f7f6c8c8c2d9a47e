"""What stage 1 checks and reads before it takes the lock: the config that can work (input, model, the engine
settings a text-only run needs), the input's files and identity (a changed input is refused whatever the flags
say), and the identity that a resume may not change. Cheap: listings and footers, no engine."""

from __future__ import annotations

import base64
import dataclasses
import os
from dataclasses import dataclass

import pyarrow as pa

from job import runs, storage
from job.config import ConfigError, RunConfig
from job.generate import engine_sizing, inputs, length_mix
from job.generate.engine_start import resolved_sampling, text_only_engine_kwargs
from job.generate.units import wanted_ranges
from job.run_record import RunRecord


def checked_config(config: RunConfig) -> RunConfig:
    """The config refused at once when it cannot work (no input, no model), with the engine settings a text-only
    run of this model needs; what `max_num_seqs: auto` will do is said first."""
    if not config.input:
        raise ConfigError("no input: pass --input (a folder, file or s3:// prefix of prompts: parquet, JSONL or "
                          "Arrow / datasets.save_to_disk)")
    check_model(config)
    engine_kwargs, note = text_only_engine_kwargs(config.model, config.engine_kwargs)
    if note:
        print(note, flush=True)
        config = dataclasses.replace(config, engine_kwargs=engine_kwargs)
    if engine_sizing.is_auto(config.engine_kwargs):
        gen = config.generate
        length_mix.check_config(gen)
        what = (f"{gen.kv_tokens_per_seq:,} tokens a sequence (generate.kv_tokens_per_seq)" if gen.kv_tokens_per_seq
                else "the run's length mix (measured once the run has rows, else generate.output_tokens_mean "
                     f"{gen.output_tokens_mean:,} / p99 {gen.output_tokens_p99:,})")
        print(f"engine: max_num_seqs auto: each engine sizes it from its device's memory for {what}; its line "
              "'max_num_seqs auto = N' follows when it starts", flush=True)
    return config


def check_model(config: RunConfig) -> None:
    model = config.model
    looks_local = model.startswith(("/", ".", "~")) or os.path.exists(model)
    if looks_local and not os.path.isdir(model):
        raise ConfigError(f"model {model!r}: no such directory (build the demo model with "
                          "`python -m job tiny-model --output DIR`)")
    if looks_local and not os.path.exists(os.path.join(model, "config.json")):
        raise ConfigError(f"model {model!r}: no config.json in that directory")
    if not looks_local and "://" not in model:
        check_hub_model(model, token=config.env_vars.get("HF_TOKEN") or os.environ.get("HF_TOKEN"))


def check_hub_model(name: str, token: str | None = None) -> None:
    """A model given by hub name must be in the local Hugging Face cache or reachable on the hub, checked here in
    a second. Left to the engine actors, a name that cannot be fetched failed after the actor's imports and the hub
    client's retries (79 s here) with a raw traceback. (s3:// and other URIs are the loader's to fetch.)"""
    import huggingface_hub as hub  # heavy: imported on use

    if isinstance(hub.try_to_load_from_cache(name, "config.json"), str):
        return
    try:
        hub.HfApi().model_info(name, timeout=10, token=token or None)
    except (hub.errors.RepositoryNotFoundError, hub.errors.GatedRepoError) as e:
        raise ConfigError(f"model {name!r}: not a local directory, and the Hugging Face hub has no such model, or "
                          f"it is gated or private (set HF_TOKEN in env_vars): {type(e).__name__}") from None
    except Exception as e:  # no network, a proxy, HF_HUB_OFFLINE
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"model {name!r}: not a local directory, not in the Hugging Face cache, and the hub cannot "
                          f"be reached from here ({type(e).__name__}: {first}). Give a model directory (on a "
                          "cluster every node needs it at that path: cluster.yaml stages it), or run where the hub "
                          "is reachable") from None


def read_chat_template(config: RunConfig) -> str | None:
    path = config.generate.chat_template
    if not path:
        return None
    try:
        return storage.read_bytes(path, config.storage).decode()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"chat template {path} cannot be read: {e}") from None


@dataclass
class RunInput:
    """What stage 1 knows of its input and of the run before it takes the lock."""
    uri: str
    files: list
    file_records: list
    carried: pa.Schema
    identity: dict
    sampling: dict
    chat_template: str | None
    canary_passed: bool
    total_rows: int
    lengths: dict | None = None  # the run's measured length mix so far (run.json `generate.lengths`)

    def recorded(self) -> dict:
        """What run.json records of the input, to refuse other content on a resume."""
        return {"input": {"uri": self.uri, "format": self.files[0].format, "num_files": len(self.files),
                          "num_rows": self.total_rows, "files": self.file_records,
                          "columns": base64.b64encode(self.carried.serialize().to_pybytes()).decode()},
                "sampling": self.sampling}


def read_input(config: RunConfig, record: RunRecord | None) -> RunInput:
    """Input files listed and their footers read (cheap); ids validated once per run; a changed input refused
    whatever the flags say (settings that changed are the stage runner's to judge: `identity`)."""
    chat_template = read_chat_template(config)
    sampling = resolved_sampling(config.model, config.generate.sampling)
    files = inputs.list_input_files(config.input, config.storage)
    for note in (inputs.row_group_note(files, config.generate.rows_per_shard),
                 inputs.compressed_note(files, config.generate.rows_per_shard)):
        if note:
            print(note, flush=True)
    ident = runs.identity(config, sampling, chat_template, inputs.fingerprint(files))
    previous = record.generate if record is not None else None
    if previous is not None:
        recorded = previous.input.files
        if recorded is not None:  # refused whatever the flags say: never resume across changed input
            file_records = inputs.check_unchanged(recorded, files, config.input, config.storage)
        else:  # a run directory from before files were recorded
            file_records = inputs.describe_files(files, config.input, {}, inputs.content_digests(files, config.storage))
        if previous.input.columns:  # the columns validation found (JSONL's are the keys of all rows: no re-parse)
            carried = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(previous.input.columns)))
        elif files[0].format == "jsonl":  # cannot happen for runs of this version; validate again, it is safe
            carried = inputs.validate_input(files, config.storage)
        else:
            carried = inputs.read_schema(files[0].uri, config.storage)
    else:
        digests: dict[str, str] = {}
        carried = inputs.validate_input(files, config.storage, ids_digests=digests,
                                        regenerate=config.generate.regenerate)
        file_records = inputs.describe_files(files, config.input, digests,
                                             inputs.content_digests(files, config.storage))
    total_rows = sum(e - s for _, s, e in wanted_ranges(files, config.limit))
    return RunInput(uri=config.input, files=files, file_records=file_records, carried=carried, identity=ident,
                    sampling=sampling, chat_template=chat_template, total_rows=total_rows,
                    canary_passed=bool(previous is not None and previous.canary_passed),
                    lengths=previous.lengths if previous is not None and previous.lengths else None)
