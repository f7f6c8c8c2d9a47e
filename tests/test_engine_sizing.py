"""`engine_kwargs.max_num_seqs: auto` (job/generate/engine_sizing.py) on the production config and the 27B hybrid
shape, for the two GPU types cluster.yaml offers. The sums against vLLM's own pool are checked end to end on the tiny
hybrid (test_generate.py::test_hybrid_end_to_end[mtp]) and on an H200 (docs/BENCHMARKS.md, issue 34)."""

from __future__ import annotations

import sys
from pathlib import Path

from job.config import load_config
from job.generate.engine_sizing import auto_max_num_seqs, sequence_cost
from job import target

REPO = Path(__file__).resolve().parents[1]
PROD_CONFIG = str(REPO / "configs" / "qwen3.6-27b.yaml")
# Total memory as the driver reports it (nvidia-smi: 143,771 MiB on the H200; ~183,359 MiB on a B200).
H200 = ("NVIDIA H200", 143_771 * 2 ** 20)
B200 = ("NVIDIA B200", 183_359 * 2 ** 20)


def dummy_27b(tiny_hybrid_dir: str, tmp_path: Path) -> str:
    sys.path.insert(0, str(REPO / "bench"))
    from dummy_model import ensure_dummy_hybrid_27b

    return ensure_dummy_hybrid_27b(str(tmp_path / "dummy-27b"), tiny_hybrid_dir)


def test_the_27b_cache_laid_out_as_vllm_lays_it_out(tiny_hybrid_dir, tmp_path):
    """The figures vLLM 0.26 logged for this shape on an H200 with MTP (docs/BENCHMARKS.md, issue 34): 800-token
    attention blocks (a GDN state is 3,207,168 bytes: 10,240 conv channels x 3 x 2 B + 48 heads x 128 x 128 x 4 B; a
    block of one layer's KV, 4,096 B a token, as large, in multiples of 32 tokens), one page per layer in groups of 16
    layers, and 17 with the MTP layer's KV (vLLM's 1.5x rule keeps it from doubling the groups); its pool of 1,423
    blocks was 23.33 sequences of 40,960 tokens."""
    config = target.config_json(dummy_27b(tiny_hybrid_dir, tmp_path))
    plain = sequence_cost(config, {"enable_prefix_caching": False}, 8192)
    assert plain.state_bytes == 10_240 * 3 * 2 + 48 * 128 * 128 * 4
    assert plain.kv_bytes_per_token == 2 * 4 * 256 * 2
    assert (plain.block_size, plain.group_size, plain.state_groups, plain.attention_groups) == (800, 16, 3, 1)
    assert plain.blocks() == 3 * 1 + 11  # one state slot per group; 8,192 tokens in 11 blocks
    mtp = sequence_cost(config, {"enable_prefix_caching": False,
                                 "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}, 8192)
    assert (mtp.state_slots, mtp.group_size, mtp.state_groups, mtp.attention_groups) == (3, 17, 3, 1)
    assert round(1_423 / mtp.blocks(40_960), 2) == 23.33  # vLLM's "Maximum concurrency for 40,960 tokens": 23.33x
    assert 1_423 * mtp.block_bytes / 2 ** 30 < 73.84  # within the 73.84 GiB vLLM said it had for the cache
    cached = sequence_cost(config, {"enable_prefix_caching": True}, 8192)
    assert cached.state_slots == 2  # vLLM's 'align' mode keeps one more state per sequence


def test_auto_on_the_production_config_per_gpu_type(tiny_hybrid_dir, tmp_path):
    model = dummy_27b(tiny_hybrid_dir, tmp_path)
    config = load_config(PROD_CONFIG, model=model)
    ek = config.engine_kwargs
    assert ek["max_num_seqs"] == "auto" and ek["speculative_config"]["method"] == "mtp"
    tokens = config.generate.kv_tokens_per_seq
    h200, b200 = (auto_max_num_seqs(model, ek, tokens, device) for device in (H200, B200))
    for sizing in (h200, b200):  # the largest multiple of 8 whose sequences fit the pool
        n, per_seq = sizing.max_num_seqs, sizing.cost.bytes()
        assert n % 8 == 0 and n * per_seq <= sizing.pool_bytes < (n + 8) * per_seq, sizing.why
    assert h200.max_num_seqs < b200.max_num_seqs
    # Without MTP the same H200 holds more: 1 state slot a sequence instead of 3, no MTP layer.
    no_mtp = auto_max_num_seqs(model, {**ek, "speculative_config": None}, tokens, H200)
    assert no_mtp.max_num_seqs > h200.max_num_seqs
    # The admission gate keeps 2 x max_num_seqs rows in each engine: the units handed to it hold that many.
    assert config.generate.rows_per_shard * config.generate.units_in_flight_per_engine >= 2 * b200.max_num_seqs
    # The same GPU type gives the same value (the compile cache is keyed on it): nothing read but config and total.
    assert auto_max_num_seqs(model, ek, tokens, H200) == h200
