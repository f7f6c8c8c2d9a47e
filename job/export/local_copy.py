"""An export on S3 brought to this machine for `python -m job train-check`: the trainers' own loaders read local
files, and the check needs one batch, so only a small export (one made with `--limit` or `--sample`) is copied.

Runs in the job's environment (the CLI), before the trainers' process starts: it may use the job's storage.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile

from job import storage
from job.config import ConfigError

# Above this an export is the run's, not a sample's: copying it to prove a launcher costs hours. 10 GB is ~140K
# tokens of the 27B's 7 layers, ~50 thinking-mode samples.
MAX_COPY_BYTES = 10 * 10**9


@contextlib.contextmanager
def local_copies(exports: list[str], storage_config: storage.StorageConfig | None = None,
                 max_bytes: int = MAX_COPY_BYTES):
    """Yield `exports` with every s3:// one replaced by a local copy of it (removed afterwards)."""
    import pyarrow.fs as pafs  # heavy: imported on use

    workdir = None
    local = []
    try:
        for i, uri in enumerate(exports):
            if not storage.is_s3(uri):
                local.append(uri)
                continue
            fs, path = storage.resolve(uri, storage_config)
            infos = [f for f in fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
                     if f.type == pafs.FileType.File]
            if not infos:
                raise ConfigError(f"train-check: {uri} holds no files: is it the --output of `python -m job export`?")
            size = sum(f.size for f in infos)
            if size > max_bytes:
                raise ConfigError(f"train-check: {uri} holds {size / 1e9:,.1f} GB, more than the {max_bytes / 1e9:g} "
                                  "GB this check copies to prove a launcher: export a sample for it (`python -m job "
                                  "export RUN ... --limit 2000 --output ...-sample`) and check that")
            workdir = workdir or tempfile.mkdtemp(prefix="train-check-")
            target = f"{workdir}/export-{i}"
            pafs.copy_files(path, target, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
            local.append(target)
        yield local
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
