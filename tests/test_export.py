"""Export to SpecForge and vLLM speculators: a real stage-2 run of each tiny model (dense and hybrid), exported, then
read back the way the trainers read it. Token ids and loss masks equal ours exactly, features equal ours bit for
bit, speculators' last slot is the final decoder layer before the norm (checked against a plain transformers forward
with a hook), and the dropped-sample report names exactly the crafted bad rows.

Neither trainer installs here (SpecForge 0.2.0 pins torch 2.11 + sglang; speculators 0.9.0 needs `datasets`, which
the shared venv lacks), so the readers below mirror their loader code line for line, each citing the file it copies.
Where `datasets` is importable, the speculators directory is also opened with the real `datasets.load_from_disk`.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import REPO, ensure_local_ray

from job import layout, schema, storage
from job.config import HiddenStatesConfig, RunConfig
from job.export import ExportError, collate, export, make_plan, stream
from job.export.files import in_sample
from job.hidden_states import load, run_hidden_states

# With two workers (pytest-xdist), on one: the module's runs (per model) are made once.

LAYERS = [0, 1, 2, -1]  # the tiny models have 4 decoder layers: aux 0, 1, 2 and the last (3)


# ---------------------------------------------------------------------------------------------------------------
# Faithful readers of the trainers' formats
# ---------------------------------------------------------------------------------------------------------------


def specforge_read(path: str, fmt: str, max_len: int = 4096) -> list[dict]:
    """SpecForge 0.2.0's offline path: `list_feature_files` (runtime/data_plane/offline_reader.py: every *.ckpt under
    the directory, sorted), `load_feature_file` (feature_store.py: torch.load weights_only=False, mmap=True), then
    the strategy's normalizer (algorithms/common/dflash_family_data.py `normalize_offline_sample`, or
    algorithms/eagle3/data.py `normalize_offline_sample`)."""
    files = sorted(os.path.abspath(os.path.join(root, n)) for root, _, names in os.walk(path) for n in names
                   if n.endswith((".ckpt", ".ckpt.gz")))
    out = []
    for f in files:
        raw = torch.load(f, weights_only=False, mmap=True)
        if fmt == "dflash":
            input_ids = raw["input_ids"][:max_len].unsqueeze(0)
            loss_mask = raw["loss_mask"][:max_len].unsqueeze(0)
            hidden = raw["hidden_states"]
            if hidden.dim() == 3:
                assert hidden.shape[0] == 1
                hidden = hidden.squeeze(0)
            assert hidden.dim() == 2
            hidden = hidden[:max_len].unsqueeze(0)
            assert len({input_ids.shape[1], loss_mask.shape[1], hidden.shape[1]}) == 1
            values = loss_mask[0].tolist()
            if not any(bool(a) and bool(b) for a, b in zip(values, values[1:])):
                raise ValueError("offline DFlash-family samples require two consecutive supervised tokens")
            out.append({"file": f, "raw": raw, "input_ids": input_ids, "loss_mask": loss_mask,
                        "hidden_states": hidden})
        else:
            loss_mask = raw["loss_mask"][:max_len].clone().unsqueeze(0)
            if loss_mask.numel() > 0:
                loss_mask[0, -1] = 0
            out.append({"file": f, "raw": raw, "hidden_state": raw["aux_hidden_state"].squeeze(0)[:max_len][None],
                        "target": raw["hidden_state"].squeeze(0)[:max_len][None],
                        "input_ids": raw["input_ids"][:max_len][None], "loss_mask": loss_mask})
    return out


def speculators_read(path: str) -> list[dict]:
    """speculators 0.9.0 `ArrowDataset._get_raw_data` (train/data.py): the `save_to_disk` dataset in torch format,
    `hs_{i}.safetensors` through hs-connectors' FileTransfer (safetensors `load_file`), `check_hidden_states`
    (data_generation/offline.py), token ids equal to the row's input_ids, the last layer split off."""
    from safetensors.torch import load_file

    state = json.load(open(os.path.join(path, "state.json")))
    assert state["_format_type"] == "torch"
    tables = [pa.ipc.open_stream(os.path.join(path, f["filename"])).read_all() for f in state["_data_files"]]
    rows = pa.concat_tables(tables).to_pylist()
    out = []
    for index, row in enumerate(rows):
        hs = load_file(os.path.join(path, "hidden_states", f"hs_{index}.safetensors"))
        assert set(hs) == {"token_ids", "hidden_states"}
        assert hs["token_ids"].tolist() == row["input_ids"] and hs["hidden_states"].shape[0] == row["seq_len"]
        assert torch.isfinite(hs["hidden_states"].float()).all()
        assert torch.equal(hs["token_ids"], torch.tensor(row["input_ids"]))
        out.append({"hidden_states": hs["hidden_states"][:, :-1].flatten(1), "input_ids": hs["token_ids"],
                    "verifier_last_hidden_states": hs["hidden_states"][:, -1],
                    "loss_mask": torch.tensor(row["loss_mask"]), "raw": hs})
    return out


# ---------------------------------------------------------------------------------------------------------------
# Runs: crafted completion rows through the real stage 2, once per model and norm convention
# ---------------------------------------------------------------------------------------------------------------


def completion_table(vocab: int) -> pa.Table:
    """7 rows: 4 ordinary, an error row (stage 2 skips it), an empty completion (every export drops it: no
    loss-mask token) and a one-token completion (DFlash drops it: no two consecutive loss-mask tokens)."""
    rng = np.random.default_rng(3)
    rows = []
    for i, n_out in enumerate([40, 25, 60, 12, None, 0, 1]):
        prompt = rng.integers(0, vocab, size=int(rng.integers(4, 20))).tolist()
        output = rng.integers(0, vocab, size=n_out or 0).tolist()
        row = {c: None for c in schema.COMPLETION_COLUMNS}
        row.update(id=f"r{i}", prompt_token_ids=prompt, output_token_ids=output, num_prompt_tokens=len(prompt),
                   num_output_tokens=len(output), finish_reason="stop", seed=i)
        if n_out is None:
            row.update(error="prompt too long", prompt_token_ids=None, output_token_ids=None)
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=schema.completion_schema())


def hs_config(model_dir: str, run: str, before_norm: bool) -> RunConfig:
    return RunConfig(model=model_dir, output=run, hidden_states=HiddenStatesConfig(
        layer_ids=LAYERS, max_length=128, batch_tokens=256, rows_per_shard=3, dtype="bfloat16", check_samples=2,
        last_layer_before_norm=before_norm))  # the self-check compares the pre-norm layer with a hooked forward


@pytest.fixture(scope="module", params=["dense", pytest.param("hybrid", marks=pytest.mark.slow)])
def runs(request, tmp_path_factory, s3_server):
    """{False: run after the norm, True: run before the norm} of one tiny model, and the model directory. ~40-100 s:
    two stage-2 runs (the two conventions for the last layer are what the exports differ in), made once per model."""
    ensure_local_ray()
    model_dir = request.getfixturevalue("tiny_model_dir" if request.param == "dense" else "tiny_hybrid_dir")
    vocab = json.load(open(os.path.join(model_dir, "config.json"))).get("vocab_size") or 3840
    out = {}
    for before in (False, True):
        run = str(tmp_path_factory.mktemp(f"{request.param}-{'pre' if before else 'post'}"))
        storage.write_shard(storage.join(run, layout.COMPLETIONS_DIR, "f00000-r0000000000-0000000007.arrow"),
                            completion_table(vocab))
        run_hidden_states(hs_config(model_dir, run, before))
        out[before] = run
    return out, model_dir


def ours(run: str) -> dict[str, dict]:
    return {r["id"]: r for r in load(run)}


def ids_in_order(out: str) -> list[str]:
    return [json.loads(line)["id"] for line in open(os.path.join(out, "samples.jsonl"))]


# ---------------------------------------------------------------------------------------------------------------
# SpecForge
# ---------------------------------------------------------------------------------------------------------------


def test_specforge_dflash_and_eagle3_read_back_exactly(runs, tmp_path, capsys):
    by_norm, _ = runs
    run = by_norm[False]
    mine = ours(run)

    # DFlash through the CLI: layers 2 and 0, in that order (the trainer's order is kept).
    from job.cli import main

    out = str(tmp_path / "dflash")
    assert main(["export", run, "--to", "specforge", "--format", "dflash", "--output", out, "--layers", "2", "0"]) == 0
    assert "dropped 2" in capsys.readouterr().out
    read = specforge_read(out, "dflash")
    order = ids_in_order(out)
    assert sorted(order) == ["r0", "r1", "r2", "r3"]
    dropped = {d["id"]: d["reason"] for d in map(json.loads, open(os.path.join(out, "dropped.jsonl")))}
    assert set(dropped) == {"r5", "r6"}
    assert dropped["r5"].startswith("no loss-mask token") and dropped["r6"].startswith("no two consecutive")
    by_file = {os.path.relpath(r["file"], out): r for r in read}
    for index, sid in enumerate(order):
        rec = by_file[f"rows_0-2000/data_{index}.ckpt"]
        raw = rec["raw"]
        assert raw["input_ids"].dtype == torch.int64 and raw["loss_mask"].dtype == torch.int64
        assert raw["input_ids"].tolist() == mine[sid]["input_ids"].tolist()
        assert raw["loss_mask"].tolist() == mine[sid]["loss_mask"].tolist()
        hs = mine[sid]["hidden_states"]
        assert raw["hidden_states"].shape == (1, hs.shape[0], 2 * hs.shape[2])
        assert torch.equal(raw["hidden_states"][0], torch.cat([hs[:, 2], hs[:, 0]], dim=-1))  # bit for bit

    # EAGLE-3: aux layers 0, 1, 2 and the last layer after the norm; the vocabulary mapping from the counts.
    out = str(tmp_path / "eagle3")
    summary = export(run, to="specforge", format="eagle3", output=out, draft_vocab_size=64)
    assert summary["num_samples"] == 5 and summary["dropped_by_reason"] == {
        "no loss-mask token: an empty completion, nothing to train on": 1}
    order = ids_in_order(out)
    counts: dict[int, int] = {}
    for index, sid in enumerate(order):
        rec = next(r for r in specforge_read(out, "eagle3") if r["file"].endswith(f"/data_{index}.ckpt"))
        hs = mine[sid]["hidden_states"]
        assert torch.equal(rec["hidden_state"][0], hs[:, :3].reshape(hs.shape[0], -1))
        assert torch.equal(rec["target"][0], hs[:, 3])
        assert rec["input_ids"][0].tolist() == mine[sid]["input_ids"].tolist()
        assert rec["raw"]["loss_mask"].tolist() == mine[sid]["loss_mask"].tolist()
        for t in mine[sid]["input_ids"][mine[sid]["loss_mask"].bool()].tolist():
            counts[t] = counts.get(t, 0) + 1
    mapping = torch.load(os.path.join(out, "vocab_mapping", "vocab_mapping.pt"), weights_only=True)
    d2t, t2d = mapping["d2t"], mapping["t2d"]
    assert d2t.shape == (64,) and t2d.shape == (summary["target_vocab_size"],) and int(t2d.sum()) == 64
    draft = (torch.arange(64) + d2t).tolist()  # SpecForge: target id = draft id + d2t[draft id]
    assert draft == sorted(draft) and all(t2d[t] for t in draft)
    ranked = sorted(counts.values(), reverse=True)  # every token counted more often than the 64th is in the draft
    cutoff = ranked[63] if len(ranked) > 63 else 0
    assert all(t in draft for t, c in counts.items() if c > cutoff)


# ---------------------------------------------------------------------------------------------------------------
# speculators
# ---------------------------------------------------------------------------------------------------------------


def test_speculators_reads_back_exactly_and_its_last_slot_is_before_the_norm(runs, tmp_path):
    by_norm, model_dir = runs
    run = by_norm[True]
    mine = ours(run)
    meta = storage.read_shard(storage.list_files(os.path.join(run, "hidden_states"), ".arrow")[0]).schema.metadata
    assert json.loads(meta[schema.META_LAYER_IDS]) == [0, 1, 2, 3]
    assert json.loads(meta[schema.META_VLLM_LAYER_IDS]) == [1, 2, 3, 4]
    assert meta[schema.META_LAST_LAYER_NORM] == b"before_norm" and meta[schema.META_NUM_MODEL_LAYERS] == b"4"
    from job.hidden_states import check_run

    assert check_run(hs_config(model_dir, run, True), num_samples=2)["max_difference"] < 0.05

    out = str(tmp_path / "spec")
    summary = export(run, to="speculators", format="eagle3", output=out)
    assert summary["layers"]["trainer_layer_ids"] == [1, 2, 3] and summary["num_samples"] == 5
    read = speculators_read(out)
    order = ids_in_order(out)
    assert len(read) == len(order) == 5
    for rec, sid in zip(read, order):
        hs = mine[sid]["hidden_states"]
        assert rec["raw"]["hidden_states"].dtype == torch.bfloat16 and rec["raw"]["token_ids"].dtype == torch.int64
        assert rec["input_ids"].tolist() == mine[sid]["input_ids"].tolist()
        assert rec["loss_mask"].tolist() == mine[sid]["loss_mask"].tolist()
        assert torch.equal(rec["raw"]["hidden_states"], hs)  # [L, 3 + 1, H]: aux 0, 1, 2, then the last

    # The last slot is decoder layer 3's own output (before the norm), from a plain transformers forward.
    from transformers import AutoModelForCausalLM

    from job.target_weights import decoder_stack

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stack = decoder_stack(model)
    captured = []
    hook = stack.layers[-1].register_forward_hook(lambda m, a, o: captured.append(o[0] if isinstance(o, tuple) else o))
    try:
        for rec in read:
            captured.clear()
            with torch.no_grad():
                after = model(rec["input_ids"][None], output_hidden_states=True).hidden_states[-1][0]
            before, got = captured[0][0], rec["verifier_last_hidden_states"].float()
            assert (got - before).norm() / before.norm() < 2e-2  # bf16 of the same value
            assert (got - after).norm() / after.norm() > 0.2  # and not the post-norm one
    finally:
        hook.remove()

    token_freq = torch.load(os.path.join(out, "token_freq.pt"), weights_only=True)
    want: dict[int, int] = {}
    for sid in order:
        for t in mine[sid]["input_ids"][mine[sid]["loss_mask"].bool()].tolist():
            want[t] = want.get(t, 0) + 1
    assert token_freq == want

    try:
        import datasets
    except ImportError:
        return  # not in the shared venv: the reader above stands in (checked against datasets 5.1.0 by hand)
    ds = datasets.load_from_disk(out)
    assert len(ds) == 5 and torch.equal(ds[0]["input_ids"], read[0]["input_ids"])


@pytest.mark.parametrize("runs", ["dense"], indirect=True)  # one model is enough: the stream shares the mapping
def test_stream_gives_the_files_rows(runs, tmp_path):          # with the files (saves ~20 s)
    by_norm, model_dir = runs
    run = by_norm[True]
    out = str(tmp_path / "spec")
    export(run, to="speculators", format="dflash", output=out)  # 2 aux layers: 0, 1
    extra = os.path.join(out, "hidden_states", "hs_99.safetensors")
    open(extra, "wb").write(b"from an earlier export")
    export(run, to="speculators", format="dflash", output=out, layers=[1])  # the same directory, other layers
    assert not os.path.exists(extra)  # the trainer would read it as a sample
    files = dict(zip(ids_in_order(out), speculators_read(out)))
    streamed = {}
    ds = stream(hs_config(model_dir, run, True), to="speculators", format="dflash", layers=[1])
    for batch in ds.iter_torch_batches(batch_size=2, collate_fn=collate):
        for i, sid in enumerate(batch["id"]):
            streamed[sid] = {k: v[i] for k, v in batch.items()}
    assert set(streamed) == set(files)
    for sid, rec in streamed.items():
        assert torch.equal(rec["hidden_states"], files[sid]["raw"]["hidden_states"])
        assert torch.equal(rec["token_ids"], files[sid]["raw"]["token_ids"])
        assert rec["loss_mask"].tolist() == files[sid]["loss_mask"].tolist()


def test_final_norm_applied_by_the_export_equals_the_model_s(runs, tmp_path):
    """One run serves every trainer (issue 29): from the run that stored the last layer BEFORE the norm, SpecForge's
    exports get it after the norm, applied by the export with the target's own norm module, and that is bit for bit
    what the run that stored it after the norm (the model's own output_hidden_states) holds."""
    by_norm, _ = runs
    for fmt, key, kwargs in (("eagle3", "hidden_state", {"draft_vocab_size": 64}),
                             ("dflash", "hidden_states", {"layers": [0, 3]})):
        outs = {before: str(tmp_path / f"{fmt}-{before}") for before in (False, True)}
        for before, out in outs.items():
            export(by_norm[before], to="specforge", format=fmt, output=out, **kwargs)
        summary = json.load(open(os.path.join(outs[True], "export.json")))
        assert "the export applied the target's final norm" in json.dumps(summary["layers"])
        read = {before: {os.path.relpath(r["file"], out): r["raw"] for r in specforge_read(out, fmt)}
                for before, out in outs.items()}
        assert ids_in_order(outs[True]) == ids_in_order(outs[False]) and read[True].keys() == read[False].keys()
        for name, raw in read[True].items():
            assert torch.equal(raw[key], read[False][name][key]), (fmt, name)
        if fmt == "eagle3":  # and the stored (pre-norm) layer really differs: the norm was applied, not skipped
            pre = ours(by_norm[True])[ids_in_order(outs[True])[0]]["hidden_states"][:, 3]
            assert not torch.equal(read[True]["rows_0-2000/data_0.ckpt"][key][0], pre)
    # The export reads the target (config, tokenizer, norm weight): where the run's path is not on this machine it
    # says which flag gives it, and writes nothing.
    with pytest.raises(ExportError, match="pass --model DIR"):
        export(by_norm[True], to="speculators", format="eagle3", output=str(tmp_path / "nomodel"), model="/no/model")
    assert not (tmp_path / "nomodel").exists()


# ---------------------------------------------------------------------------------------------------------------
# Conventions refused, conversations
# ---------------------------------------------------------------------------------------------------------------


def test_wrong_conventions_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ExportError, match="must lie outside the run directory"):
        export(str(tmp_path), to="specforge", format="dflash", output=str(tmp_path / "export"))
    with pytest.raises(ExportError, match="last_layer_before_norm: true"):
        make_plan("speculators", "eagle3", [0, 1, 2, 3], 4, last_before_norm=False)
    with pytest.raises(ExportError, match="needs the target model's directory"):  # to apply the final norm
        make_plan("specforge", "eagle3", [0, 1, 2, 3], 4, last_before_norm=True)
    assert make_plan("specforge", "eagle3", [0, 1, 2, 3], 4, last_before_norm=True, model="m").norm_slot == 3
    assert make_plan("speculators", "eagle3", [0, 1, 2, 3], 4, last_before_norm=True).norm_slot is None
    # The trainer's own default layers when the run holds them (job/drafters.py), else the run's but the last.
    assert make_plan("specforge", "dflash", list(range(64)), 64, True, model="m").aux_layer_ids == [1, 16, 31, 46, 61]
    assert make_plan("speculators", "eagle3", [1, 16, 31, 46, 60, 61, 63], 64, True).aux_layer_ids == [1, 31, 60]
    assert make_plan("specforge", "dflash", [0, 1, 3], 4, True, model="m").aux_layer_ids == [0, 1]
    with pytest.raises(ExportError, match="exactly 3 aux layers"):
        make_plan("specforge", "eagle3", [0, 2, 3], 4, last_before_norm=False)
    with pytest.raises(ExportError, match=r"needs the model's last layer \(3"):
        make_plan("speculators", "dflash", [0, 1], 4, last_before_norm=True)
    with pytest.raises(ExportError, match=r"layer\(s\) \[2\] are not in this run"):
        make_plan("specforge", "dflash", [0, 1], 4, last_before_norm=False, layers=[2])
    plan = make_plan("speculators", "dflash", [3, 0, 1], 4, last_before_norm=True, layers=[1, 0])
    assert plan.aux_slots == [2, 1] and plan.last_slot == 0 and plan.conventions()["trainer_layer_ids"] == [2, 1]


def test_conversations_keep_valid_rows_and_report_every_other_one(tmp_path):
    good = {"reasoning": "Add them.", "answer": "4", "finish_reason": "stop"}
    cases = {  # id → (carried input, completion fields, expected drop reason or None)
        "ok-prompt": ({"prompt": "2+2?"}, good, None),
        "ok-messages": ({"messages": json.dumps([{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "2+2?"}])}, good, None),
        "error": ({"prompt": "x"}, {"error": "prompt too long"}, "stage-1 error: prompt too long"),
        "truncated": ({"prompt": "x"}, {**good, "truncated": True}, "truncated (finish_reason length)"),
        "empty-answer": ({"prompt": "x"}, {**good, "answer": ""}, "message 1 content must be a non-empty string"),
        "no-reasoning": ({"prompt": "x"}, {**good, "reasoning": ""}, "assistant message 1 has empty reasoning_content"),
        "stray-think": ({"prompt": "x"}, {**good, "answer": "4</think>"},
                        "assistant message 1 contains a thinking marker"),
        "think-in-reasoning": ({"prompt": "x"}, {**good, "reasoning": "<think>hm"},
                               "assistant message 1 reasoning_content contains a thinking marker"),
        # Conversations that fail the input checks (job/generate/prompts.py, the same ones stage 1 applies) are dropped
        # with that reason; a run's own rows never get here (stage 1 made them error rows), crafted ones do.
        "starts-assistant": ({"messages": json.dumps([{"role": "assistant", "content": "hi"},
                                                      {"role": "user", "content": "2+2?"}])}, good,
                             "prompt: bad conversation: roles do not alternate: message 0 is 'assistant'"),
        "ends-user-twice": ({"messages": json.dumps([{"role": "user", "content": "a"}, {"role": "user",
                                                                                       "content": "b"}])}, good,
                            "prompt: bad conversation: roles do not alternate: message 1 is 'user'"),
        "tool-role": ({"messages": json.dumps([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                               {"role": "tool", "content": "c"}])}, good,
                      "prompt: bad conversation: tool message 2 answers no call"),
        # A regenerated turn of a multi-turn conversation: its history ends before the data's own turn 1.
        "multi-turn": ({"messages": json.dumps([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                                {"role": "user", "content": "c"},
                                                {"role": "assistant", "content": "old"}])},
                       {**good, "turn": 1}, None),
    }
    rows = []
    for sid, (inp, fields, _) in cases.items():
        row = {c: None for c in schema.COMPLETION_COLUMNS}
        row.update(id=sid, messages=inp.get("messages"), prompt=inp.get("prompt"), **fields)
        rows.append(row)
    carried = pa.schema([pa.field("id", pa.string()), pa.field("messages", pa.string()),
                         pa.field("prompt", pa.string())])
    run = str(tmp_path / "run")
    storage.write_shard(os.path.join(run, layout.COMPLETIONS_DIR, "f00000-r0000000000-0000000012.arrow"),
                        pa.Table.from_pylist(rows, schema=schema.completion_schema(carried)))
    out = str(tmp_path / "conv")
    summary = export(run, to="specforge", format="conversations", output=out)
    written = [json.loads(line) for line in open(os.path.join(out, "conversations.jsonl"))]
    dropped = {d["id"]: d["reason"] for d in map(json.loads, open(os.path.join(out, "dropped.jsonl")))}
    assert [w["id"] for w in written] == ["ok-prompt", "ok-messages", "multi-turn"]
    assert written[2]["conversations"] == [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."}]
    assert written[0] == {"id": "ok-prompt", "status": "success", "conversations": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."}]}
    assert written[1]["conversations"][0] == {"role": "system", "content": "Be brief."}
    want = {sid: reason for sid, (_, _, reason) in cases.items() if reason}
    assert set(dropped) == set(want)
    for sid, reason in want.items():
        assert dropped[sid].startswith(reason), (sid, dropped[sid])
    assert summary["num_input_rows"] == len(cases) == summary["num_samples"] + summary["num_dropped"]


def test_conversation_runs_export_one_conversation_each_every_turn_the_model_s_own(tmp_path):
    """`generate.regenerate: conversation`: SpecForge's conversations export writes each conversation once, as it was
    regenerated (the data's user turns, every assistant turn the model's own with its reasoning: what SpecForge's own
    regenerate_train_data.py writes), not one row per turn on the data's history. A turn that is unusable (an error,
    truncated) cuts its conversation there, each later turn dropped naming it; per-row thinking follows the row's
    sampling variant (generate.sampling_variants)."""
    data = json.dumps([{"role": "user", "content": "a"}, {"role": "assistant", "content": "DATA-0"},
                       {"role": "user", "content": "b"}, {"role": "assistant", "content": "DATA-1"},
                       {"role": "user", "content": "c"}])

    def turn(base, k, answer, reasoning="why", variant=0, **fields):
        row = {c: None for c in schema.COMPLETION_COLUMNS}
        row.update(id=f"{base}#{k}", turn=k, answer=answer, reasoning=reasoning, finish_reason="stop",
                   variant=variant, messages=data, **fields)
        return row

    rows = [turn("whole", 0, "own-0"), turn("whole", 1, "own-1"), turn("whole", 2, "own-2"),
            turn("cut", 0, "own-0"), turn("cut", 1, "x", truncated=True), turn("cut", 2, "own-2"),
            turn("plain", 0, "p0", reasoning="", variant=1), turn("plain", 1, "p1", reasoning="", variant=1),
            turn("plain", 2, "p2", reasoning="", variant=1),
            {**{c: None for c in schema.COMPLETION_COLUMNS}, "id": "bad", "error": "bad conversation: no user turn"}]
    carried = pa.schema([pa.field("id", pa.string()), pa.field("messages", pa.string())])
    run = str(tmp_path / "run")
    storage.write_shard(os.path.join(run, layout.COMPLETIONS_DIR, "f00000-r0000000000-0000000004.arrow"),
                        pa.Table.from_pylist(rows, schema=schema.completion_schema(carried)))
    storage.write_json(os.path.join(run, "run.json"), {"config": {"generate": {
        "regenerate": "conversation", "enable_thinking": True,
        "sampling_variants": [{"temperature": 1.0}, {"enable_thinking": False}]}}})
    out = str(tmp_path / "conv")
    summary = export(run, to="specforge", format="conversations", output=out)
    written = {w["id"]: w["conversations"] for w in map(json.loads, open(os.path.join(out, "conversations.jsonl")))}
    dropped = {d["id"]: d["reason"] for d in map(json.loads, open(os.path.join(out, "dropped.jsonl")))}
    own = [{"role": "assistant", "content": f"own-{k}", "reasoning_content": "why"} for k in range(3)]
    assert written["whole"] == [{"role": "user", "content": "a"}, own[0], {"role": "user", "content": "b"}, own[1],
                                {"role": "user", "content": "c"}, own[2]]
    assert written["cut"] == [{"role": "user", "content": "a"}, own[0]], "cut at the truncated turn"
    assert written["plain"][-1] == {"role": "assistant", "content": "p2"}, "variant 1: thinking off, no reasoning"
    assert "DATA-" not in json.dumps(written)
    assert dropped["cut#1"].startswith("truncated") and dropped["cut#2"].startswith(
        "after turn 1 of its conversation, which is dropped (truncated")
    assert dropped["bad"] == "stage-1 error: bad conversation: no user turn"
    assert summary["num_samples"] == 3 and summary["num_input_rows"] == len(rows) == \
        summary["num_rows_in_samples"] + summary["num_dropped"] and summary["one_sample_per"] == "conversation"


def test_loss_on_every_assistant_turn_covers_the_history_s_answers(tiny_model_dir):
    """--loss-turns every_assistant_turn (SpecForge's own rule) widens stage 2's mask to the history's assistant
    turns: exactly the tokens after each "<|im_start|>assistant\\n" up to and including its "<|im_end|>", found in a
    prompt rendered by the target's own chat template; the system and user turns and the open generation prompt stay
    0, the generated turn stays 1."""
    from transformers import AutoTokenizer

    from job.export.trainer_format import EVERY_ASSISTANT_TURN, chatml_markers, with_history_turns

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "two plus two"},
               {"role": "assistant", "content": "four"}, {"role": "user", "content": "and three more"},
               {"role": "assistant", "content": "seven"}, {"role": "user", "content": "thanks"}]
    prompt = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(prompt, add_special_tokens=False)
    output = tok.encode("ok<|im_end|>", add_special_tokens=False)
    input_ids = torch.tensor(ids + output)
    stage2 = torch.tensor([0] * len(ids) + [1] * len(output), dtype=torch.uint8)
    mask = with_history_turns(input_ids, stage2, *chatml_markers(tiny_model_dir))
    assert mask.dtype == stage2.dtype and mask[len(ids):].tolist() == [1] * len(output)
    supervised = tok.decode([t for t, m in zip(ids, mask.tolist()) if m])
    assert supervised == "four<|im_end|>seven<|im_end|>", supervised
    # The default per trainer, and the rule refused where it cannot hold.
    assert make_plan("specforge", "dflash", [0, 1, 2, 3], 4, True, model=tiny_model_dir).loss_turns == \
        EVERY_ASSISTANT_TURN
    assert make_plan("speculators", "eagle3", [0, 1, 2, 3], 4, True).loss_turns == "last_turn"
    with pytest.raises(ExportError, match="needs the target's tokenizer"):
        make_plan("specforge", "dflash", [0, 1, 2, 3], 4, False)


NORM_CHECK = r'''
import json, sys, torch
from safetensors.torch import load_file
from job.trainers import speculators_train as st

export, work = sys.argv[1], sys.argv[2]
m = json.load(open(export + "/export.json"))
args = st.resolve_args(export, m, m["draft_config"], work)
_, model = st.build_model(args)
replace = st.with_the_target_s_final_norm
st.with_the_target_s_final_norm = lambda model, model_dir: False  # speculators' own, as its trainer builds it
_, theirs = st.build_model(args)
st.with_the_target_s_final_norm = replace
w = load_file(m["model"] + "/model.safetensors")["model.language_model.norm.weight"].float()
eps = json.load(open(m["model"] + "/config.json"))["text_config"]["rms_norm_eps"]
x = torch.randn(4, w.shape[0])
x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
with torch.no_grad():
    ours = float((model.verifier_norm(x) - x_hat * (1 + w)).abs().max())
    speculators = float((theirs.verifier_norm(x) - x_hat * (1 + w)).abs().max())
print(json.dumps({"ours": ours, "speculators": speculators}))
'''


@pytest.mark.slow  # the trainers' imports and 4 x 5 steps (~40 s); needs .venv-trainers (make trainers)
def test_the_hybrid_target_exports_and_trains_like_the_dense_one(runs, tmp_path):
    """The tiny hybrid (Qwen3.5: Gated DeltaNet + gated attention, text config nested in a multimodal wrapper) from
    its pre-norm run, the every-trainer layout: all four exports train with the trainers' own code. (The dense
    target trains in tests/test_trainers.py, on the shared run.)"""
    from test_trainers import FORMATS, TRAINERS_PYTHON, assert_trained, train_check, trainers_environment

    by_norm, model_dir = runs
    if "hybrid" not in model_dir:
        pytest.skip("the dense target's exports train in tests/test_trainers.py (the shared run)")
    trainers_environment()
    exports = []
    for to, fmt in FORMATS:
        out = str(tmp_path / f"{to}-{fmt}")
        export(by_norm[True], to=to, format=fmt, output=out)
        exports.append(out)
    for result in train_check(exports).values():
        assert_trained(result)
    # speculators' EAGLE-3 verifier norm is a LlamaRMSNorm (weight * x̂); Qwen3.5's is (1 + weight) * x̂. Without the
    # target's own norm (speculators_train.with_the_target_s_final_norm) the draft's targets are noise (BENCHMARKS:
    # their argmax was the target's greedy token at 0 % of positions, 100 % with it). The draft as built for training
    # must compute Qwen3.5's formula, written out here from the checkpoint's weight.
    proc = subprocess.run([str(TRAINERS_PYTHON), "-c", NORM_CHECK, exports[3], str(tmp_path / "work")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "disagrees with the target's own final norm (Qwen3_5RMSNorm)" in proc.stderr
    differences = json.loads(proc.stdout.strip().splitlines()[-1])
    assert differences["ours"] < 1e-5 and differences["speculators"] > 0.5, differences


@pytest.mark.parametrize("runs", ["dense"], indirect=True)  # the rule does not depend on the architecture
def test_an_interrupted_export_is_finished_by_its_rerun_and_a_sample_holds_exactly_its_ids(runs, tmp_path):
    """The export is a stage of the run on the workers, a group of parts per unit: a rerun after a job that died in
    the middle of a group redoes only that group (its marker missing, one of its files lost) and ends with every
    sample once under its index; `--limit N` holds exactly the first N samples, `--sample F` the same ids each time."""
    run = runs[0][True]
    out = tmp_path / "spec"
    full = export(run, to="speculators", format="eagle3", output=str(out), parts_per_group=1)
    ids = ids_in_order(str(out))
    groups = sorted((out / "_export").glob("g*.json"))
    assert len(ids) == len(set(ids)) == full["num_samples"] >= 3 and len(groups) >= 2
    hs = sorted((out / "hidden_states").glob("hs_*.safetensors"))
    assert [f.name for f in hs] == sorted(f"hs_{i}.safetensors" for i in range(len(ids)))

    # The job died writing group 1: its marker never written, one of its files not yet there, no export.json yet.
    second = json.load(open(groups[1]))["expected"]
    lost = out / "hidden_states" / f"hs_{second['offset']}.safetensors"
    groups[1].unlink()
    lost.unlink()
    (out / "export.json").unlink()
    untouched = {f: f.stat().st_mtime_ns for f in hs if f != lost and int(f.stem[3:]) < second["offset"]}
    again = export(run, to="speculators", format="eagle3", output=str(out), parts_per_group=1)
    assert ids_in_order(str(out)) == ids and again["num_samples"] == len(ids) and lost.exists()
    assert all(f.stat().st_mtime_ns == t for f, t in untouched.items()), "a done group was written again"
    assert len(list((out / "hidden_states").glob("hs_*.safetensors"))) == len(ids)

    small = tmp_path / "small"
    export(run, to="speculators", format="eagle3", output=str(small), limit=2, parts_per_group=1)
    assert ids_in_order(str(small)) == ids[:2]
    assert sorted(f.name for f in (small / "hidden_states").glob("*")) == ["hs_0.safetensors", "hs_1.safetensors"]
    # --sample: the ids a hash of the id picks (files.in_sample), the same ones each time: here half of them.
    picked = export(run, to="speculators", format="eagle3", output=str(tmp_path / "half"), sample=0.5)
    assert ids_in_order(str(tmp_path / "half")) == [i for i in ids if in_sample(i, 0.5)] and picked["sample"] == 0.5
    assert 0 < picked["num_samples"] < len(ids)
