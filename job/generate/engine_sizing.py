"""`engine_kwargs.max_num_seqs: auto`: the number of sequences an engine decodes together, worked out from the memory
of the device it starts on, before it starts, and checked against what vLLM allocated once it has.

Why before: vLLM needs max_num_seqs when it builds the engine (its CUDA graphs and its compile cache are keyed on
it), and it has no `auto` of its own. So the sums are ours, from config.json and the device:

    pool          = device memory x gpu_memory_utilization - weights - reserve          (CPU: VLLM_CPU_KVCACHE_SPACE)
    per sequence  = state slots x a Gated DeltaNet state per layer + its tokens' KV, in vLLM's blocks (SequenceCost)
                    + its sampler rows and CUDA graphs outside the cache (GPU: row_bytes)
    max_num_seqs  = pool // per sequence (every sequence that fits; no rounding)

- State slots: 1 per sequence; + num_speculative_tokens with MTP (vLLM keeps a state per draft position to roll
  back to); + 1 with prefix caching on a hybrid model ("align" mode keeps the last block's state). The 27B target:
  48 GDN layers x (conv 10,240 x 3 x 2 B + recurrent 48 x 128 x 128 x 4 B) = 146.8 MiB a slot.
- Tokens: what a sequence in flight holds on average at the run's length mix (length_mix.py: its prompt +
  E[L^2] / (2 E[L]) of its output L; measured on the run's own rows once it has them, else configured), at most
  max_model_len and the longest a sequence can be (its prompt + `sampling.max_tokens`) where the caller knows it.
  `generate.kv_tokens_per_seq` pins a number instead. The total in flight moves around its mean: when it outgrows
  the pool vLLM preempts (recomputes) the newest sequence. At the thinking-mode mix on an H100 this chose 24 where
  sizing for 8,192 tokens chose 17 (bench/sim_concurrency.py: the simulated steady state, checked against vLLM).
- Reserve: what vLLM's start-up profile takes besides weights and cache: the activations of ONE
  max_num_batched_tokens prefill (vLLM profiles one forward) and 1.9 GiB (CUDA context, NCCL, the rest), plus per
  sequence of max_num_seqs its sampler rows (1 + num_speculative_tokens, float32 over the vocabulary) and graphs.
  Fitted to vLLM 0.26 on the 27B hybrid shape with MTP on an H100 (docs/BENCHMARKS.md): its pool was
  18.6 GiB at max_num_seqs 8, 18.55 at 17 (stage 1's engine), 17.8 at 34, 17.64 at 44; the sums say 18.3, 17.9 and
  17.6 at 17, 34, 44 (within 0.25 GiB, low but at 34). On an H200 vLLM had 73.84 GiB at 64, the sums
  72.9. The first version counted the activations and 3 x 512 rows of logits twice over plus 2 GiB (8.2 GiB), and
  rounded down to a multiple of 8: on an H100 it chose 8 where vLLM's pool held 17 sequences of 8,192 tokens (280
  against 553 tok/s at 17), on an H200 64 where 71 fit. Now: 17 and 70.

Why no rounding: vLLM pads a decode batch up to its next CUDA-graph capture size (multiples of 8 tokens, and a
sequence is 1 + num_speculative_tokens tokens a step), so 17 sequences cost one step of 51 -> 56 tokens, no more
than 18 would; rounding 17 down to 16 gives away 6 % of the batch, and 13 down to 8 gave away 40 %. The value is
still the same for every engine on one GPU type: the device's total memory (not what is free) goes in, so a replaced
engine hits the compile cache its predecessor wrote.

The check after start takes the pool vLLM allocated (the block count its engine reports to the client) and says how
many of these sequences it holds, with vLLM's own log figures where it printed them; a pool smaller than the sums
assumed is a warning naming the value to pin, not an error (vLLM preempts).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

from job import target

AUTO = "auto"
GIB = 1024 ** 3
MIN_SEQS = 1
MAX_SEQS = 1024   # vLLM's own default ceiling for large GPUs; beyond it the sampler's per-step logits dominate
# CUDA context, NCCL and the rest of vLLM's profile besides one prefill's activations: fitted to vLLM 0.26 on the 27B
# hybrid shape with MTP on an H100 (module docstring).
FIXED_RESERVE = int(1.9 * GIB)
# What each sequence of max_num_seqs costs outside the cache: the sampler's rows (1 + num_speculative_tokens a
# sequence) of float32 logits, probabilities, sort keys and indices over the vocabulary, and its CUDA graphs. vLLM's
# pool on an H100 fell from 18.6 GiB at max_num_seqs 8 to 17.8 at 34 and 17.64 at 44 on the H100: 9.1 MiB a row of a
# 248,320-token vocabulary, ~38 B an entry; 40 here.
ROW_BYTES_PER_VOCAB = 40
# Tokens: vLLM makes a hybrid model's attention blocks a multiple of its attention kernels' alignment. On an H200
# (vLLM 0.26) the 27B target's blocks were 800 tokens with MTP and 784 without (both on an H200): 32 covers both
# (784 counted as 800 is 2 % more KV than needed, on the safe side). The CPU build: 128 (the tiny hybrid's are 256).
BLOCK_ALIGN = {"cuda": 32, "cpu": 128}
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "fp8_e4m3": 1,
                "fp8_e5m2": 1, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class SequenceCost:
    """What one sequence takes from vLLM's cache, laid out as vLLM lays out a hybrid model's cache (vLLM 0.26 and
    0.32, v1/core/kv_cache_utils.py): every layer's page is the same size (an attention block of `block_size`
    tokens is made as large as one layer's recurrent state, the state padded up to it); layers are grouped by kind
    in groups of `group_size` layers (the smaller kind's count, or the larger's when that is < 1.5x, the last group
    padded); each block of the shared pool is one page in each layer of a group. A sequence holds `state_slots`
    blocks in each state group and one block per `block_size` tokens in each attention group."""
    state_slots: int
    state_groups: int
    attention_groups: int
    group_size: int
    block_size: int             # tokens per attention block
    page_bytes: int             # one layer's page
    state_bytes: int            # one layer's recurrent state (conv + recurrent), before padding
    kv_bytes_per_token: int     # one attention layer, K and V
    tokens: int

    @property
    def block_bytes(self) -> int:
        return self.group_size * self.page_bytes

    def blocks(self, tokens: int | None = None) -> int:
        tokens = self.tokens if tokens is None else tokens
        return self.state_groups * self.state_slots + self.attention_groups * -(-tokens // self.block_size)

    def bytes(self, tokens: int | None = None) -> int:
        return self.blocks(tokens) * self.block_bytes

    def describe(self) -> str:
        state = (f"{self.state_groups} state groups x {self.state_slots} slot{'s' * (self.state_slots > 1)} + "
                 if self.state_groups else "")
        return (f"{self.bytes() / 2 ** 20:,.0f} MiB a sequence ({state}{self.attention_groups} attention group"
                f"{'s' * (self.attention_groups > 1)} x {-(-self.tokens // self.block_size)} blocks of "
                f"{self.block_size} tokens = {self.blocks()} blocks of {self.group_size} layers x "
                f"{self.page_bytes / 2 ** 20:.2f} MiB, for {self.tokens:,} tokens)")


def _dtype_bytes(name, default: int = 2) -> int:
    return _DTYPE_BYTES.get(str(name or "").replace("torch.", ""), default)


def mtp_tokens(engine_kwargs: dict) -> int:
    """Draft tokens per step of the model's own MTP head, 0 without it."""
    spec = engine_kwargs.get("speculative_config") or {}
    if spec.get("method") not in ("mtp", "qwen3_next_mtp", "qwen3_5_mtp"):
        return 0
    return int(spec.get("num_speculative_tokens") or 1)


def _group_size(counts: list[int]) -> int:
    """vLLM's rule (_get_kv_cache_groups_uniform_page_size): the smallest kind's layer count, or the largest's when
    it is less than 1.5x the smallest (a drafter's extra layer should not double the groups)."""
    small, large = min(counts), max(counts)
    return large if large < small * 1.5 else small


def sequence_cost(model_config: dict, engine_kwargs: dict, tokens: int, block_align: int = BLOCK_ALIGN["cuda"]
                  ) -> SequenceCost:
    """One sequence's cache for a model's config.json (dense Qwen3 or hybrid Qwen3.5/3.6) and engine settings."""
    text = target.text_config(model_config)
    layers = int(text["num_hidden_layers"])
    types = text.get("layer_types") or ["full_attention"] * layers
    draft = mtp_tokens(engine_kwargs)
    mtp_layers = int(text.get("mtp_num_hidden_layers") or text.get("num_nextn_predict_layers") or 1) if draft else 0
    attention_layers = sum(t == "full_attention" for t in types) + mtp_layers  # the MTP layer has its own KV
    linear_layers = sum(t == "linear_attention" for t in types)
    dtype = engine_kwargs.get("dtype") if engine_kwargs.get("dtype") not in (None, "auto") else (
        text.get("torch_dtype") or text.get("dtype") or model_config.get("torch_dtype") or "bfloat16")
    kv_dtype = engine_kwargs.get("kv_cache_dtype")
    head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or text["num_attention_heads"])
    kv_per_token = 2 * kv_heads * head_dim * _dtype_bytes(kv_dtype if kv_dtype not in (None, "auto") else dtype)
    if not linear_layers:  # one group of every attention layer, vLLM's default 16-token blocks
        block = int(engine_kwargs.get("block_size") or 16)
        return SequenceCost(state_slots=0, state_bytes=0, state_groups=0, attention_groups=1,
                            group_size=attention_layers, block_size=block, page_bytes=block * kv_per_token,
                            kv_bytes_per_token=kv_per_token, tokens=tokens)
    key_dim = int(text["linear_num_key_heads"]) * int(text["linear_key_head_dim"])
    value_dim = int(text["linear_num_value_heads"]) * int(text["linear_value_head_dim"])
    conv = (2 * key_dim + value_dim) * (int(text.get("linear_conv_kernel_dim", 4)) - 1) * _dtype_bytes(dtype)
    recurrent = (int(text["linear_num_value_heads"]) * int(text["linear_key_head_dim"])
                 * int(text["linear_value_head_dim"]) * _dtype_bytes(text.get("mamba_ssm_dtype") or dtype))
    state = conv + recurrent
    # vLLM makes an attention block as large as a state, in multiples of the kernels' block alignment.
    block = block_align * -(-state // (block_align * kv_per_token))
    group = _group_size([linear_layers, attention_layers])
    prefix_caching = engine_kwargs.get("enable_prefix_caching", True)
    return SequenceCost(state_slots=(2 if prefix_caching else 1) + draft, state_bytes=state,
                        state_groups=-(-linear_layers // group), attention_groups=-(-attention_layers // group),
                        group_size=group, block_size=block, page_bytes=block * kv_per_token,
                        kv_bytes_per_token=kv_per_token, tokens=tokens)


def weight_bytes(model: str, engine_kwargs: dict) -> int:
    """The language model's weights as vLLM loads them: parameters counted on the meta device from config.json (no
    file is read, so dummy-weight shapes work), at the run's dtype, plus the MTP head (one decoder layer and its 2h x h
    projection) when speculative_config uses it. A quantized checkpoint is counted at its dtype's width, not its own."""
    import torch  # heavy: imported on use
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: imported on use

    config = AutoConfig.from_pretrained(model).get_text_config()
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in lm.parameters())
    if mtp_tokens(engine_kwargs):
        layers = lm.model.layers
        types = getattr(config, "layer_types", None) or ["full_attention"] * len(layers)
        full = [layer for layer, kind in zip(layers, types) if kind == "full_attention"] or list(layers)
        params += sum(p.numel() for p in full[0].parameters()) + 2 * config.hidden_size ** 2
    dtype = engine_kwargs.get("dtype") if engine_kwargs.get("dtype") not in (None, "auto") else getattr(
        config, "torch_dtype", None) or getattr(config, "dtype", None) or "bfloat16"
    return params * _dtype_bytes(dtype)


def reserve_bytes(model_config: dict, engine_kwargs: dict) -> int:
    """vLLM's start-up profile besides weights, cache and what each sequence adds (row_bytes): one
    max_num_batched_tokens prefill's activations (the MLP's gate/up output and its product, and four hidden-size
    buffers, bf16; vLLM profiles one forward) and FIXED_RESERVE. The 27B: 1.69 + 1.9 = 3.59 GiB."""
    text = target.text_config(model_config)
    tokens = int(engine_kwargs.get("max_num_batched_tokens") or 8192)
    hidden, inner = int(text["hidden_size"]), int(text.get("intermediate_size") or 4 * text["hidden_size"])
    return tokens * (2 * inner + 4 * hidden) * 2 + FIXED_RESERVE


def row_bytes(model_config: dict, engine_kwargs: dict) -> int:
    """What one more sequence in max_num_seqs takes from the pool outside its cache (ROW_BYTES_PER_VOCAB): the 27B
    with MTP 2, 3 rows x 248,320 x 40 B = 28.4 MiB."""
    return (1 + mtp_tokens(engine_kwargs)) * int(target.text_config(model_config)["vocab_size"]) * ROW_BYTES_PER_VOCAB


@dataclass(frozen=True)
class Sizing:
    max_num_seqs: int
    pool_bytes: int
    cost: SequenceCost
    why: str  # the sums, for the log


def gpu_pool(device: tuple[str, int], model_config: dict, engine_kwargs: dict, weights: int) -> tuple[int, str]:
    """A GPU's cache pool by the sums before what each sequence adds outside its cache (row_bytes, taken in
    choose): tensor_parallel_size x (total x gpu_memory_utilization - reserve) - weights."""
    name, total = device
    tp = int(engine_kwargs.get("tensor_parallel_size") or 1)
    utilization = float(engine_kwargs.get("gpu_memory_utilization") or 0.9)
    reserve = reserve_bytes(model_config, engine_kwargs)
    pool = int(tp * (total * utilization - reserve) - weights)
    return pool, (f"{tp} x {name} {total / GIB:.1f} GiB x {utilization} - weights {weights / GIB:.1f} GiB - "
                  f"reserve {tp} x {reserve / GIB:.1f} GiB = {pool / GIB:.1f} GiB")


def device_pool(model: str, model_config: dict, engine_kwargs: dict, device: tuple[str, int] | None = None
                ) -> tuple[int, str]:
    """Bytes of cache the engine will have, and how they were worked out. GPU: total memory of the first visible
    device (one engine per GPU, or per tensor-parallel group of equal GPUs) x gpu_memory_utilization - weights -
    reserve, read through vLLM's platform (NVML: no CUDA context is made in the actor before vLLM makes its own);
    CPU: VLLM_CPU_KVCACHE_SPACE GiB, which vLLM's CPU build allocates as it is. `device`: (name, total bytes) to
    work it out for another GPU type (docs, tests)."""
    from vllm.platforms import current_platform  # heavy: imported on use

    if device is not None or current_platform.is_cuda_alike():
        device = device or (current_platform.get_device_name(0), current_platform.get_device_total_memory(0))
        return gpu_pool(device, model_config, engine_kwargs, weight_bytes(model, engine_kwargs))
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if not space:
        raise ValueError("engine_kwargs.max_num_seqs: auto on a CPU needs VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) "
                         "in env_vars: the CPU build's cache is that size")
    pool = int(float(space) * GIB)
    return pool, f"VLLM_CPU_KVCACHE_SPACE {space} GiB"


def sizing_tokens(kv_tokens_per_seq: int, max_model_len: int, longest_seq: int | None = None) -> int:
    """Tokens each sequence is sized for: the run's length mix (`kv_tokens_per_seq`), never more than the longest a
    sequence can be (`longest_seq`: its prompt + sampling.max_tokens, where the caller knows it) or max_model_len."""
    return max(1, min(int(kv_tokens_per_seq), int(max_model_len), int(longest_seq or max_model_len)))


def auto_max_num_seqs(model: str, engine_kwargs: dict, kv_tokens_per_seq: int, device: tuple[str, int] | None = None,
                      longest_seq: int | None = None, source: str = "") -> Sizing:
    """Every sequence whose cache fits the device's pool, within MIN_SEQS..MAX_SEQS (module docstring).
    `kv_tokens_per_seq`: the tokens a sequence holds on average (length_mix.sizing_tokens); `source`: where they came
    from, for the log."""
    model_config = target.config_json(model)
    if not model_config:
        raise ValueError(f"engine_kwargs.max_num_seqs: auto needs the model's config.json ({model} has none here)")
    max_model_len = engine_kwargs.get("max_model_len") or target.text_config(model_config).get(
        "max_position_embeddings") or kv_tokens_per_seq
    from vllm.platforms import current_platform  # heavy: imported on use

    on_gpu = device is not None or current_platform.is_cuda_alike()
    cost = sequence_cost(model_config, engine_kwargs, sizing_tokens(kv_tokens_per_seq, max_model_len, longest_seq),
                         BLOCK_ALIGN["cuda" if on_gpu else "cpu"])
    pool, pool_why = device_pool(model, model_config, engine_kwargs, device)
    sizing = choose(pool, cost, pool_why, row_bytes(model_config, engine_kwargs) if on_gpu else 0)
    return dataclasses.replace(sizing, why=f"{sizing.why}; sized for {source}") if source else sizing


def choose(pool: int, cost: SequenceCost, pool_why: str, per_seq_extra: int = 0) -> Sizing:
    """The number n of `cost`'s sequences a pool of `pool` bytes holds once each of them has also taken
    `per_seq_extra` (row_bytes) outside the cache: n x (cost + extra) <= pool, within MIN_SEQS..MAX_SEQS. The pool
    recorded is what vLLM should allocate at that n."""
    fits = max(0, pool) // (cost.bytes() + per_seq_extra)
    chosen = max(MIN_SEQS, min(MAX_SEQS, fits))
    left = pool - chosen * per_seq_extra
    extra = (f" - {chosen} x {per_seq_extra / 2 ** 20:.1f} MiB sampler rows and graphs = {left / GIB:.1f} GiB"
             if per_seq_extra else "")
    why = (f"engine_kwargs.max_num_seqs auto = {chosen}: pool {pool_why}{extra}; {cost.describe()}; {fits} fit"
           + (f", kept within {MIN_SEQS}..{MAX_SEQS}" if chosen != fits else ""))
    return Sizing(max_num_seqs=chosen, pool_bytes=left, cost=cost, why=why)


_AVAILABLE = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
_BLOCK = re.compile(r"Setting attention block size to (\d+) tokens")


def check_against_vllm(sizing: Sizing, num_blocks: int | None, logged: str = "") -> tuple[str, int]:
    """The sums set beside the pool vLLM allocated (`num_blocks`, which its engine reports to the client after start)
    and how many sequences of `kv_tokens_per_seq` tokens that pool holds, in the layout the sums assume. `logged`:
    the engine's start-up log, for its own figures where it printed them (INFO level): memory available for the
    cache, and the attention block size it chose (a different one means the layout differs from the sums).
    No block count: the chosen number, unchecked."""
    if not num_blocks:
        return "engine_kwargs.max_num_seqs auto: vLLM reported no cache size to check against", sizing.max_num_seqs
    holds = num_blocks // sizing.cost.blocks()
    available = _AVAILABLE.findall(logged)
    block = _BLOCK.findall(logged)
    said = f" (vLLM: {float(available[-1]):.1f} GiB available)" if available else ""
    note = (f"; vLLM's attention blocks are {block[-1]} tokens, the sums assumed {sizing.cost.block_size}"
            if block and int(block[-1]) != sizing.cost.block_size else "")
    line = (f"engine_kwargs.max_num_seqs auto, checked: vLLM's pool is {num_blocks:,} blocks = "
            f"{num_blocks * sizing.cost.block_bytes / GIB:.1f} GiB{said}, predicted {sizing.pool_bytes / GIB:.1f} GiB; "
            f"it holds {holds} sequences of {sizing.cost.tokens:,} tokens; chose {sizing.max_num_seqs}{note}")
    if holds > sizing.max_num_seqs:  # the sums erred low: vLLM's own figure, for the operator to pin
        line += (f"; {holds - sizing.max_num_seqs} more would fit (engine_kwargs.max_num_seqs: {holds} pins vLLM's "
                 f"figure on this GPU type)")
    return line, holds


def device_name() -> str:
    """The accelerator an engine runs on, as its driver names it ("NVIDIA H200"), or "cpu"."""
    from vllm.platforms import current_platform  # heavy: imported on use

    return current_platform.get_device_name(0) if current_platform.is_cuda_alike() else "cpu"


def is_auto(engine_kwargs: dict) -> bool:
    return str(engine_kwargs.get("max_num_seqs", "")).lower() == AUTO
