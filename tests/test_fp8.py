"""FP8 feature storage (`hidden_states.dtype: float8_e4m3fn`, issue 32): the shared run's completions through stage 2
once more, stored as float8 e4m3 with a scale per token and layer, against the shared run's own bf16 stage 2 (same
backend, same batches, so the difference is FP8 alone)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import DEMO_CONFIG

from job.config import load_config
from job.export import export
from job.hidden_states import check_run, fp8, load, run_hidden_states


@pytest.mark.slow  # a stage-2 run of its own (~40 s): the one way to prove what FP8 storage keeps
def test_fp8_storage_halves_the_bytes_and_keeps_the_features_within_its_error(shared_run, tmp_path):
    run = str(shutil.copytree(shared_run.stage1, tmp_path / "run"))
    config = load_config(DEMO_CONFIG, model=shared_run.model, output=run,
                         **{"hidden_states.dtype": "float8_e4m3fn"})
    summary = run_hidden_states(config)

    bf16 = {r["id"]: r["hidden_states"].clone() for r in load(shared_run.full)}
    stored = {r["id"]: r["hidden_states"] for r in load(run)}
    assert stored.keys() == bf16.keys()
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}  # read back as bf16, whatever is on disk
    ids = sorted(bf16)
    x, y = torch.cat([bf16[i] for i in ids]), torch.cat([stored[i] for i in ids])
    error = fp8.relative_l2(x, y)  # per layer, over every token of the run
    assert (error > 0.005).all() and (error < fp8.ROUND_TRIP_TOLERANCE).all(), error  # lossy, and within its bound
    # ~half the bytes: 1 B per value + 4 B of scale per token and layer, against 2 B per value.
    assert 0.45 < summary.bytes / shared_run.hidden_states.bytes < 0.55, (summary.bytes, shared_run.hidden_states.bytes)
    # The run's self-check measured the same round trip on its check samples, and kept the bf16 exactness check.
    (check,) = summary.self_checks
    assert check["max_difference"] < 0.05
    assert max(check["fp8_round_trip_by_layer"].values()) < fp8.ROUND_TRIP_TOLERANCE

    # The stored shards against a plain forward, at FP8's tolerance (bf16 noise + FP8 rounding).
    verdict = check_run(config, num_samples=4)
    assert verdict["tolerance"] == 0.10 and verdict["max_difference"] < 0.05

    # Exports dequantize: a trainer gets bf16 and the manifest says what was stored.
    manifest = export(run, to="speculators", format="eagle3", output=str(tmp_path / "export"))
    assert manifest["dtype"] == "bfloat16" and manifest["stored_dtype"] == "float8_e4m3fn"
    assert json.loads((tmp_path / "export" / "export.json").read_text())["stored_dtype"] == "float8_e4m3fn"


def test_fp8_round_trip_is_bounded_per_layer_and_safe_on_zeros():
    """A scale per token AND layer: layers of one token that differ by 10^7 in scale keep the same relative error,
    where one scale per token would flush the small layer into e4m3's subnormals. An all-zero vector stays zero."""
    torch.manual_seed(0)
    x = torch.randn(256, 3, 512) * torch.tensor([1e-3, 1.0, 1e4])[None, :, None]
    x[0] = 0
    q, scale = fp8.quantize(x.to(torch.bfloat16))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (256, 3)
    y = fp8.dequantize(q, scale)
    assert torch.isfinite(y).all() and (y[0] == 0).all()
    per_layer = fp8.relative_l2(x[1:], y[1:])
    assert (per_layer < 0.035).all(), per_layer
    one_scale = x.abs().amax(dim=(1, 2), keepdim=True).clamp_min(1e-30) / fp8.E4M3_MAX
    shared = (x / one_scale).to(torch.float8_e4m3fn).float() * one_scale
    assert fp8.relative_l2(x[1:], shared[1:])[0] > 0.5  # the 1e-3 layer, lost under the 1e4 layer's scale


def test_extractor_fp8_records_are_the_quantized_features(tiny_hybrid_dir):
    """The transformers backend quantizes on its device before the copy (`fp8_records`): the records, split as the
    writer splits them, hold exactly what quantizing the bf16 features it computes gives, in half the host bytes."""
    import numpy as np

    from job.hidden_states.samples import Sample, plan_parts
    from job.hidden_states.transformers_backend import TransformersExtractor, load_model

    rng = np.random.default_rng(3)
    samples = [Sample(id=f"s{i}", input_ids=rng.integers(0, 3000, size=int(n), dtype=np.int32), num_prompt_tokens=2,
                      original_num_tokens=int(n), row=i) for i, n in enumerate(rng.integers(5, 120, size=8))]
    ex = TransformersExtractor(load_model(tiny_hybrid_dir, dtype="bfloat16", device="cpu"), layer_ids=[0, 1, 2, 3],
                               batch_tokens=400)
    L, H = len(ex.layer_ids), ex.hidden_size
    parts = list(enumerate(plan_parts(samples, 4)))
    plain = [(p.samples, p.features.copy()) for p in ex.run(parts, pooled=False)]
    ex.fp8_records = True
    assert ex.width == L * (H + 4) < L * H * 2
    for (samples_of_part, bf16), part in zip(plain, ex.run(parts, pooled=False)):
        tokens = sum(s.num_tokens for s in samples_of_part)
        assert part.features.nbytes == tokens * L * (H + 4)
        values, scales = fp8.split_records(part.features, tokens, L, H)
        q, scale = fp8.quantize(torch.from_numpy(bf16).view(torch.bfloat16).view(tokens, L, H))
        assert torch.equal(torch.from_numpy(values), q.view(torch.uint8).reshape(-1))
        assert torch.equal(torch.from_numpy(scales), scale)
    ex.close()
