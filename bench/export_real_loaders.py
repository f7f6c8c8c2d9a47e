"""Read this project's exports with the REAL SpecForge 0.2.0, speculators 0.9.0 and datasets 5.1.0 code.

Neither trainer installs into the project's venv (SpecForge pins torch 2.11 + sglang; speculators needs `datasets`),
so tests/test_export.py uses readers that copy their loader code. This script closes the gap by importing the
real modules from unpacked wheels (their pure-Python readers need none of the pinned heavy dependencies), never
installing them into the venv:

    d=$(mktemp -d); .venv/bin/python -m pip download --no-deps -d $d specforge==0.2.0 speculators==0.9.0 \\
        hs-connectors==0.9.0
    for w in $d/*.whl; do (cd $d && unzip -qo $w); done
    .venv/bin/python -m pip install --no-deps --target $d/deps datasets==5.1.0 multiprocess xxhash
    PYTHONPATH=$PWD REAL_LOADERS="$d:$d/deps" .venv/bin/python bench/export_real_loaders.py /tmp/xcheck

Loading is not training: `python -m job train-check` (job/trainers/, `make trainers`) runs the trainers' own training
steps on exports. This script stays as the bit-for-bit reader check.

Builds two stage-2 runs of the tiny dense model (last layer after / before the norm), exports SpecForge DFlash and
EAGLE-3 and speculators EAGLE-3, and checks them with SpecForge's `OfflineManifestReader(validate_files=True)`,
`load_feature_file`, its DFlash and EAGLE-3 normalizers and `process_token_dict_to_mappings`; `datasets.load_from_disk`,
hs-connectors' `FileTransfer`, speculators' `check_hidden_states`, `ArrowDataset` and
`save_token_frequency_distribution`. Measured 2026-12-03: every check passes.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path


def build(work: str) -> None:
    import numpy as np
    import pyarrow as pa
    import ray

    from job import layout, schema, storage
    from job.builtin.tiny_model import ensure_tiny_model
    from job.config import HiddenStatesConfig, RunConfig
    from job.export import export
    from job.hidden_states import run_hidden_states

    model = ensure_tiny_model(os.path.join(os.path.dirname(__file__), "..", ".cache", "tiny-model"))
    rng = np.random.default_rng(3)
    rows = []
    for i, n_out in enumerate([40, 25, 60, 12, 0, 1]):
        prompt, output = rng.integers(0, 3840, size=10).tolist(), rng.integers(0, 3840, size=n_out).tolist()
        row = {c: None for c in schema.COMPLETION_COLUMNS}
        row.update(id=f"r{i}", prompt_token_ids=prompt, output_token_ids=output, num_prompt_tokens=len(prompt),
                   num_output_tokens=len(output), finish_reason="stop", seed=i)
        rows.append(row)
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    for before in (False, True):
        run = os.path.join(work, "run-pre" if before else "run-post")
        storage.write_shard(storage.join(run, layout.COMPLETIONS_DIR, "f00000-r0000000000-0000000006.arrow"),
                            pa.Table.from_pylist(rows, schema=schema.completion_schema()))
        run_hidden_states(RunConfig(model=model, output=run, hidden_states=HiddenStatesConfig(
            layer_ids=[0, 1, 2, -1], max_length=128, batch_tokens=256, dtype="bfloat16",
            last_layer_before_norm=before)))
    ray.shutdown()
    export(f"{work}/run-post", to="specforge", format="dflash", output=f"{work}/sf-dflash", layers=[2, 0])
    export(f"{work}/run-post", to="specforge", format="eagle3", output=f"{work}/sf-eagle3", draft_vocab_size=64)
    export(f"{work}/run-pre", to="speculators", format="eagle3", output=f"{work}/sp-eagle3")


def check(work: str) -> list[str]:
    import torch

    from job.hidden_states import load

    post = {r["id"]: r for r in load(f"{work}/run-post")}
    pre = {r["id"]: r for r in load(f"{work}/run-pre")}

    def order(out):
        return [json.loads(line)["id"] for line in open(f"{out}/samples.jsonl")]

    from specforge.algorithms.common.dflash_family_data import normalize_offline_sample as dflash_normalize
    from specforge.algorithms.eagle3.data import normalize_offline_sample as eagle3_normalize
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader, list_feature_files

    passed = []
    for fmt, keys in (("dflash", ("input_ids", "loss_mask", "hidden_states")),
                      ("eagle3", ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state"))):
        out, ids = f"{work}/sf-{fmt}", order(f"{work}/sf-{fmt}")
        refs = list(OfflineManifestReader(out, strategy=fmt, feature_keys=keys, validate_files=True))
        assert len(refs) == len(ids)
        for path in list_feature_files(out):
            raw = load_feature_file(path)
            ours = post[ids[int(os.path.basename(path)[5:-5])]]
            hs = ours["hidden_states"]
            assert raw["input_ids"].tolist() == ours["input_ids"].tolist()
            assert raw["loss_mask"].tolist() == ours["loss_mask"].tolist()
            if fmt == "dflash":
                dflash_normalize(raw, max_len=4096)  # raises on a sample SpecForge cannot train on
                assert torch.equal(raw["hidden_states"][0], torch.cat([hs[:, 2], hs[:, 0]], -1))
            else:
                assert torch.equal(eagle3_normalize(raw, max_len=4096)["target"][0], hs[:, 3])
                assert torch.equal(raw["aux_hidden_state"][0], hs[:, :3].flatten(1))
        passed.append(f"specforge {fmt}: {len(refs)} samples through OfflineManifestReader, load_feature_file and "
                      "its normalizer, bit for bit")
    counts = Counter()
    for sid in order(f"{work}/sf-eagle3"):
        masked = post[sid]["input_ids"].long()[post[sid]["loss_mask"].bool()]
        unique, n = masked.unique(return_counts=True)
        counts.update(dict(zip(unique.tolist(), n.tolist())))
    d2t, t2d = process_token_dict_to_mappings(counts, 64, 3840)
    mapping = torch.load(f"{work}/sf-eagle3/vocab_mapping/vocab_mapping.pt")
    assert torch.equal(mapping["d2t"], d2t) and torch.equal(mapping["t2d"], t2d)
    passed.append("specforge vocab_mapping.pt equals process_token_dict_to_mappings")

    import datasets
    from hs_connectors.transfer import FileTransfer
    from speculators.data_generation.offline import check_hidden_states
    from speculators.train.data import ArrowDataset
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    out, ids = f"{work}/sp-eagle3", order(f"{work}/sp-eagle3")
    ds = datasets.load_from_disk(out)
    files = FileTransfer(Path(out) / "hidden_states")
    trainer = ArrowDataset(max_len=4096, datapath=out, on_missing="raise")
    for i in range(len(ds)):
        hs = files.get_cached(i)
        check_hidden_states(hs, ds[i]["input_ids"].tolist())
        ours = pre[ids[i]]
        assert torch.equal(hs["hidden_states"], ours["hidden_states"])
        assert ds[i]["loss_mask"].tolist() == ours["loss_mask"].tolist()
        assert int(ds[i]["seq_len"]) == len(hs["token_ids"])
        item = trainer[i]
        assert torch.equal(item["verifier_last_hidden_states"], ours["hidden_states"][:, -1])
    Path(f"{work}/token_freq_real.pt").unlink(missing_ok=True)  # theirs reuses an existing file without counting
    save_token_frequency_distribution(ds, f"{work}/token_freq_real.pt")
    assert torch.load(f"{work}/token_freq_real.pt") == torch.load(f"{out}/token_freq.pt")
    passed.append(f"speculators: {len(ds)} rows through datasets.load_from_disk (format {ds.format['type']}), "
                  "FileTransfer, check_hidden_states and ArrowDataset; token_freq.pt equals theirs")
    return passed


if __name__ == "__main__":
    work = sys.argv[1] if len(sys.argv) > 1 else "/tmp/export-real-loaders"
    if not os.path.exists(f"{work}/sp-eagle3"):
        build(work)
    sys.path[:0] = [p for p in os.environ.get("REAL_LOADERS", "").split(":") if p]
    print("\n".join(check(work)))
