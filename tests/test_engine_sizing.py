"""`engine_kwargs.max_num_seqs: auto` (job/generate/engine_sizing.py) on the production config and the 27B hybrid
shape, for the two GPU types cluster.yaml offers. The sums against vLLM's own pool are checked end to end on the tiny
hybrid (test_generate.py::test_hybrid_end_to_end[mtp]), on an H200 (docs/BENCHMARKS.md) and an H100
(bench/results/h100_max_num_seqs_auto); the fast tests below hold the sums to the figures vLLM 0.26 printed on
those two GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

from job import target
from job.config import load_config
from job.generate.engine_sizing import (
    GIB,
    Sizing,
    auto_max_num_seqs,
    check_against_vllm,
    choose,
    gpu_pool,
    reserve_bytes,
    row_bytes,
    sequence_cost,
    sizing_tokens,
)
from job.generate.length_mix import sizing_tokens as sizing_tokens_for

REPO = Path(__file__).resolve().parents[1]
PROD_CONFIG = str(REPO / "configs" / "qwen3.6-27b.yaml")
# Total memory as the driver reports it (nvidia-smi: 143,771 MiB on the H200; ~183,359 MiB on a B200).
H200 = ("NVIDIA H200", 143_771 * 2 ** 20)
B200 = ("NVIDIA B200", 183_359 * 2 ** 20)
H100 = ("NVIDIA H100 80GB HBM3", 81_559 * 2 ** 20)  # "pool 79.6 GiB" in the H100 run's line

# The 27B hybrid shape (bench/dummy_model.py: bench_hybrid_stage2.SHAPE_27B on the tiny hybrid's text config) as
# config.json gives it, without building anything: what the sums read.
TEXT_27B = dict(vocab_size=248_320, hidden_size=5_120, intermediate_size=17_408, num_hidden_layers=64,
                num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_conv_kernel_dim=4,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48,
                max_position_embeddings=40_960, mamba_ssm_dtype="float32", dtype="bfloat16", mtp_num_hidden_layers=1,
                layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16)
CONFIG_27B = {"text_config": TEXT_27B}
# The production engine settings (configs/qwen3.6-27b.yaml) that the H200 and H100 runs used.
PROD_EK = {"max_model_len": 40_960, "max_num_batched_tokens": 16_384, "gpu_memory_utilization": 0.92,
           "enable_prefix_caching": False, "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}
WEIGHTS_27B_MTP = 54_641_000_000  # engine_sizing.weight_bytes of that shape with MTP (50.9 GiB; vLLM: 51.02)
# vLLM 0.26's own pools with these settings, in blocks of 17 layers x 800 tokens x 4,096 B, by the max_num_seqs the
# engine started with: an H100 (bench/results/h100_max_num_seqs_auto: "18.6 GiB" at 8 from that run, stage 1's
# engine at 17, the bench's engines at 34 and 44) and an H200 (at 64).
VLLM_BLOCKS = {"H100": {8: 358, 17: 357, 34: 343, 44: 339}, "H200": {64: 1_423}}


def _sizing(device, tokens=8_192, ek=PROD_EK) -> Sizing:
    pool, why = gpu_pool(device, CONFIG_27B, ek, WEIGHTS_27B_MTP)
    return choose(pool, sequence_cost(CONFIG_27B, ek, tokens), why, row_bytes(CONFIG_27B, ek))


def test_the_sums_follow_vllms_pool_on_the_h100_and_h200():
    """vLLM's pool shrinks as max_num_seqs grows (sampler rows, CUDA graphs): the sums' pool at each max_num_seqs an
    engine started with is within 0.3 GiB of the one vLLM allocated, on both GPUs."""
    assert round(reserve_bytes(CONFIG_27B, PROD_EK) / GIB, 2) == 3.59
    assert round(row_bytes(CONFIG_27B, PROD_EK) / 2 ** 20, 1) == 28.4
    block = sequence_cost(CONFIG_27B, PROD_EK, 8_192).block_bytes
    for gpu, device in (("H100", H100), ("H200", H200)):
        before, _ = gpu_pool(device, CONFIG_27B, PROD_EK, WEIGHTS_27B_MTP)
        for n, blocks in VLLM_BLOCKS[gpu].items():
            sums = before - n * row_bytes(CONFIG_27B, PROD_EK)
            assert abs(sums - blocks * block) < 0.3 * GIB if gpu == "H100" else sums < blocks * block, (gpu, n)


def test_auto_holds_what_vllms_pool_holds_on_the_h100_and_h200():
    """Issue 49's defect: the reserve was 8.2 GiB where vLLM took ~3.7 (H100) and ~4.3 (H200), and the count was
    rounded down to a multiple of 8: 8 on the H100 where 17 fit (280 against 553 tok/s at 17), 64 on the H200 where
    71 fit. Now: what vLLM's pool held at that max_num_seqs, at 8,192 tokens a sequence and at the bench's mix (512:
    ~30-token prompts + max_tokens 256, one 800-token block), never more (which would preempt at that length)."""
    h100, h200, h100_mix = _sizing(H100), _sizing(H200), _sizing(H100, tokens=512)
    assert h100.cost.block_size == 800 and h100.cost.blocks() == 20 and h100_mix.cost.blocks() == 9 + 1
    assert (h100.max_num_seqs, h100_mix.max_num_seqs, h200.max_num_seqs) == (17, 34, 70), (h100.why, h200.why)
    assert VLLM_BLOCKS["H100"][17] // 20 == 17 and VLLM_BLOCKS["H100"][34] // 10 == 34  # held at those values
    assert VLLM_BLOCKS["H200"][64] // 20 == 71  # at 64; the sums keep a sequence back on the H200


def test_no_rounding_and_the_limits():
    """Every sequence that fits, no multiple of 8 (vLLM pads a decode batch to its next capture size anyway); at least
    one (a pool of less is vLLM's own start-up error to give), at most MAX_SEQS."""
    cost = sequence_cost(CONFIG_27B, PROD_EK, 8_192)
    assert choose(13 * cost.bytes() + 1, cost, "").max_num_seqs == 13
    assert choose(cost.bytes() - 1, cost, "").max_num_seqs == 1
    assert "kept within 1..1024" in choose(2_000 * cost.bytes(), cost, "").why
    assert choose(2_000 * cost.bytes(), cost, "").max_num_seqs == 1024


def test_sized_at_the_runs_length_mix():
    """kv_tokens_per_seq is the run's mix; a sequence never holds more than its prompt + max_tokens (where the caller
    knows it) or max_model_len."""
    assert sizing_tokens(8_192, 40_960) == 8_192
    assert sizing_tokens(8_192, 4_096) == 4_096
    assert sizing_tokens(8_192, 40_960, longest_seq=300) == 300
    assert sizing_tokens(8_192, 40_960, longest_seq=None) == 8_192


def test_the_check_after_start_names_vllms_figure():
    """The line the engine logs once vLLM has laid out its cache: what vLLM's pool holds, and the value to pin when
    the sums chose fewer (the H200 run: 64 chosen, 71 held) or more (a warning in engine.py)."""
    sizing = _sizing(H100)
    line, holds = check_against_vllm(sizing, VLLM_BLOCKS["H100"][17], "Available KV cache memory: 18.55 GiB")
    assert holds == 17 == sizing.max_num_seqs and "(vLLM: 18.6 GiB available)" in line and "more would" not in line
    old = Sizing(max_num_seqs=64, pool_bytes=sizing.pool_bytes, cost=sizing.cost, why="")
    line, holds = check_against_vllm(old, VLLM_BLOCKS["H200"][64])
    assert holds == 71 and "7 more would fit (engine_kwargs.max_num_seqs: 71 pins" in line
    assert check_against_vllm(sizing, None)[1] == sizing.max_num_seqs


def dummy_27b(tiny_hybrid_dir: str, tmp_path: Path) -> str:
    sys.path.insert(0, str(REPO / "bench"))
    from dummy_model import ensure_dummy_hybrid_27b

    return ensure_dummy_hybrid_27b(str(tmp_path / "dummy-27b"), tiny_hybrid_dir)


def test_the_27b_cache_laid_out_as_vllm_lays_it_out(tiny_hybrid_dir, tmp_path):
    """The figures vLLM 0.26 logged for this shape on an H200 with MTP (docs/BENCHMARKS.md): 800-token
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
    tokens = prod_mix_tokens(config)
    h200, b200 = (auto_max_num_seqs(model, ek, tokens, device) for device in (H200, B200))
    extra = row_bytes(target.config_json(model), ek)
    for sizing in (h200, b200):  # every sequence that fits the pool left once each has taken its sampler rows
        n, per_seq = sizing.max_num_seqs, sizing.cost.bytes()
        assert n * per_seq <= sizing.pool_bytes < (n + 1) * per_seq + extra, sizing.why
    assert h200.max_num_seqs < b200.max_num_seqs
    # Without MTP the same H200 holds more: 1 state slot a sequence instead of 3, no MTP layer.
    no_mtp = auto_max_num_seqs(model, {**ek, "speculative_config": None}, tokens, H200)
    assert no_mtp.max_num_seqs > h200.max_num_seqs
    # The admission gate keeps 2 x max_num_seqs rows in each engine: the units handed to it hold that many.
    assert config.generate.rows_per_shard * config.generate.units_in_flight_per_engine >= 2 * b200.max_num_seqs
    # The same GPU type gives the same value (the compile cache is keyed on it): nothing read but config and total.
    assert auto_max_num_seqs(model, ek, tokens, H200) == h200


def prod_mix_tokens(config) -> int:
    """The tokens a sequence is sized for at the production config's configured length mix (no run measured yet)."""
    return sizing_tokens_for(config.generate, config.generate.sampling["max_tokens"],
                             config.engine_kwargs["max_model_len"])[0]


def test_the_docs_repeat_the_sums_figures():
    """The concurrency the README, OPERATIONS and the production config quote for `auto` is what the sums give on each
    GPU at the production config's length mix (B200: computed from its memory, never measured): a change to the sums
    or the mix fails here until the docs follow. At 8,192 tokens a sequence (the rule before the mix) they were 17,
    70 and 103."""
    tokens = prod_mix_tokens(load_config(PROD_CONFIG))
    assert tokens == 3_520
    h100, h200, b200 = (_sizing(d, tokens=tokens).max_num_seqs for d in (H100, H200, B200))
    assert (h100, h200, b200) == (24, 99, 146)
    assert tuple(_sizing(d).max_num_seqs for d in (H100, H200, B200)) == (17, 70, 103)
    readme = (REPO / "README.md").read_text()
    operations = (REPO / "docs" / "OPERATIONS.md").read_text()
    config = (REPO / "configs" / "qwen3.6-27b.yaml").read_text()
    assert f"`max_num_seqs: auto`: {h200} on an H200, {b200} on a B200 with MTP" in readme
    assert f"{h200} on an H200, {b200} on a B200, {h100} on an" in operations
    assert f"H200 (143,771 MiB): {h200}; B200 (~183,359 MiB): {b200}; H100: {h100}" in config
    assert f"2 × max_num_seqs ({2 * h200} on an H200, {2 * b200} on a B200)" in config  # the admission gate's
