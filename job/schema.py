"""Column names and Arrow schemas, declared once and imported everywhere.

Writers always pass these schemas explicitly: an inferred schema changes with the first batch (an all-null
column becomes `null` typed) and shards written by different actors would then not concatenate.
"""

from __future__ import annotations

import json

import pyarrow as pa

# ---------------------------------------------------------------------------------------------------------------
# Input prompt shards (parquet, JSONL, Arrow: job/generate/inputs.py)
# ---------------------------------------------------------------------------------------------------------------
ID = "id"
MESSAGES = "messages"  # OpenAI chat messages: role, content, and name / tool_calls / tool_call_id
PROMPT = "prompt"
CONVERSATIONS = "conversations"  # ShareGPT: from (human/gpt/system/tool), value; mapped in job/generate/prompts.py
TOOLS = "tools"  # per-row tool definitions (OpenAI function schema), passed to the chat template
CONVERSATION_COLUMNS = (PROMPT, MESSAGES, CONVERSATIONS)  # an input needs at least one of these

# ---------------------------------------------------------------------------------------------------------------
# Completion shards (stage 1)
# ---------------------------------------------------------------------------------------------------------------
PROMPT_TOKEN_IDS = "prompt_token_ids"
OUTPUT_TOKEN_IDS = "output_token_ids"
REASONING = "reasoning"
ANSWER = "answer"
FINISH_REASON = "finish_reason"
NUM_PROMPT_TOKENS = "num_prompt_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
NUM_REASONING_TOKENS = "num_reasoning_tokens"
NUM_ANSWER_TOKENS = "num_answer_tokens"
SEED = "seed"
TURN = "turn"  # which assistant turn of the conversation was generated (0-based; generate.regenerate)
ORIGINAL_TURN_TOKENS = "original_turn_tokens"  # tokens of the data's own text of that turn; null if it had none
VARIANT = "variant"  # index into generate.sampling_variants of the settings the row was sampled with; null: none
ERROR = "error"

# Quality flags (job/generate/quality.py computes them). One boolean column each; null on error rows.
FLAG_TOO_SHORT = "too_short"
FLAG_UNCLOSED_THINK = "unclosed_think"
FLAG_EMPTY_ANSWER = "empty_answer"
FLAG_TRUNCATED = "truncated"
FLAG_REPETITION = "repetition"
FLAG_TEMPLATE_MISMATCH = "template_mismatch"
QUALITY_FLAGS = (
    FLAG_TOO_SHORT,
    FLAG_UNCLOSED_THINK,
    FLAG_EMPTY_ANSWER,
    FLAG_TRUNCATED,
    FLAG_REPETITION,
    FLAG_TEMPLATE_MISMATCH,
)

# The columns stage 1 produces, in order. Carried input columns (everything in the prompt shard except `id`)
# are appended after these, with their input types.
COMPLETION_FIELDS = [
    pa.field(ID, pa.string(), nullable=False),  # input ids are normalised to strings: one type for every shard
    pa.field(PROMPT_TOKEN_IDS, pa.list_(pa.int32())),
    pa.field(OUTPUT_TOKEN_IDS, pa.list_(pa.int32())),
    pa.field(REASONING, pa.string()),
    pa.field(ANSWER, pa.string()),
    pa.field(FINISH_REASON, pa.string()),
    pa.field(NUM_PROMPT_TOKENS, pa.int32()),
    pa.field(NUM_OUTPUT_TOKENS, pa.int32()),
    pa.field(NUM_REASONING_TOKENS, pa.int32()),
    pa.field(NUM_ANSWER_TOKENS, pa.int32()),
    pa.field(SEED, pa.int64()),
    pa.field(TURN, pa.int32()),
    pa.field(ORIGINAL_TURN_TOKENS, pa.int32()),
    pa.field(VARIANT, pa.int32()),
    *[pa.field(flag, pa.bool_()) for flag in QUALITY_FLAGS],
    pa.field(ERROR, pa.string()),
]
COMPLETION_COLUMNS = [f.name for f in COMPLETION_FIELDS]


# An input column named like a completion column (GSM8K's `answer`, an `error` or `seed` of the source data) is
# carried under this prefix instead of being dropped or overwritten: `answer` → `input_answer`.
CARRIED_PREFIX = "input_"


def carried_columns(carried: pa.Schema) -> list[tuple[str, pa.Field]]:
    """(input column name, its field in the completion shard) for every input column carried through: all but
    `id` (the completion's own), renamed with CARRIED_PREFIX where the name is taken."""
    taken = set(COMPLETION_COLUMNS) | set(carried.names)
    out = []
    for f in carried:
        if f.name == ID:
            continue
        name = f.name
        if name in COMPLETION_COLUMNS:
            while name in taken:
                name = CARRIED_PREFIX + name
            taken.add(name)
        out.append((f.name, f.with_name(name)))
    return out


def completion_schema(carried: pa.Schema | None = None) -> pa.Schema:
    """Schema of a completion shard: the fixed columns, then the input columns carried through."""
    fields = list(COMPLETION_FIELDS)
    if carried is not None:
        fields += [field for _, field in carried_columns(carried)]
    return pa.schema(fields)


# ---------------------------------------------------------------------------------------------------------------
# Hidden-state shards (stage 2)
# ---------------------------------------------------------------------------------------------------------------
INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
HIDDEN_STATES = "hidden_states"  # bf16 bits stored as fixed-size binary per token, see hidden_states_schema below
HIDDEN_STATE_SCALES = "hidden_state_scales"  # FP8 storage only: float32 scale per token and layer
NUM_TOKENS = "num_tokens"
CLIPPED = "clipped"  # true when prompt + completion was longer than max_length and was cut
ORIGINAL_NUM_TOKENS = "original_num_tokens"

# Bytes one token takes in a hidden-state shard: its features (layers × hidden × the dtype's item size), plus its
# input id (int32) and loss-mask value (uint8) stored next to them.
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
BYTES_PER_TOKEN_EXTRA = 4 + 1
FP8 = "float8_e4m3fn"  # hidden_states.dtype that stores FP8 (job.config.FP8_STORAGE; job/hidden_states/fp8.py)
FP8_SCALE_BYTES = 4  # float32, one per token and layer (job/hidden_states/fp8.py)


def hidden_state_bytes_per_token(num_layers: int, hidden_size: int, dtype: str) -> int:
    scales = num_layers * FP8_SCALE_BYTES if dtype == FP8 else 0
    return num_layers * hidden_size * ITEMSIZE[dtype] + scales + BYTES_PER_TOKEN_EXTRA


# Schema metadata key of a completion shard: a fresh id per commit. A shard regenerated under the same name has
# another one, so whatever was made from the old content (stage 2's parts and marker) is known to be stale.
META_SHARD_ID = b"shard_id"
META_COUNTS = b"counts"  # a completion shard's row counts and sums (scan.shard_counts), so a footer answers `status`

# Schema metadata keys of hidden-state shards.
META_SOURCE_SHARD_ID = b"source_shard_id"  # the completion shard's META_SHARD_ID this part was made from
META_MODEL = b"model"
META_LAYER_IDS = b"layer_ids"
META_LAYER_CONVENTION = b"layer_convention"
META_DTYPE = b"dtype"
META_HIDDEN_SIZE = b"hidden_size"
META_NUM_MODEL_LAYERS = b"num_model_layers"  # decoder layers of the model: which id is the last one
META_LAST_LAYER_NORM = b"last_layer_norm"  # LAST_AFTER_NORM or LAST_BEFORE_NORM
META_VLLM_LAYER_IDS = b"vllm_layer_ids"  # the same layers in vLLM's / speculators' convention (id = ours + 1)
# transformers applies the model's final norm to its last hidden_states entry, so by default the last layer is
# stored after that norm, exactly as output_hidden_states returns it (and as SpecForge's EAGLE-3 `hidden_state`
# wants it). `hidden_states.last_layer_before_norm` stores the final decoder layer's own output instead, before the
# norm: what vLLM's aux hidden states and vLLM speculators' last slot hold.
LAST_AFTER_NORM = "after_norm"
LAST_BEFORE_NORM = "before_norm"
LAYER_CONVENTION = ("layer k = output of decoder layer k (0-based) = transformers output_hidden_states[k + 1]; "
                    "the last layer is after the final norm")
LAYER_CONVENTION_BEFORE_NORM = ("layer k = output of decoder layer k (0-based) = transformers "
                                "output_hidden_states[k + 1], except the last layer, which is the final decoder "
                                "layer's output before the final norm; vLLM/speculators id = k + 1")


def hidden_states_schema(*, model: str, layer_ids: list[int], hidden_size: int, dtype: str,
                         num_model_layers: int | None = None, last_layer_before_norm: bool = False) -> pa.Schema:
    """One row per sample. `hidden_states` is list<fixed_size_binary(num_layers × hidden × itemsize)>: one
    fixed-size value per token holding that token's [num_layers, hidden] features as raw `dtype` bits, so a
    sample's features are one contiguous, uncompressed [num_tokens, num_layers, hidden] block in the file.

    Metadata records both layer-id conventions: ours (`layer_ids`) and vLLM's (`vllm_layer_ids`, ours + 1), and
    whether the model's last layer, when captured, is stored after the final norm or before it. With `dtype`
    float8_e4m3fn, `hidden_state_scales` (list<fixed_size_binary(num_layers × 4)>, aligned with `hidden_states`)
    holds each token's float32 scale per layer: features = fp8 value × scale."""
    width = len(layer_ids) * hidden_size * ITEMSIZE[dtype]
    metadata = {
        META_MODEL: model,
        META_LAYER_IDS: json.dumps(layer_ids),
        META_VLLM_LAYER_IDS: json.dumps([k + 1 for k in layer_ids]),
        META_LAYER_CONVENTION: (LAYER_CONVENTION_BEFORE_NORM if last_layer_before_norm
                                       else LAYER_CONVENTION),
        META_LAST_LAYER_NORM: LAST_BEFORE_NORM if last_layer_before_norm else LAST_AFTER_NORM,
        META_DTYPE: dtype,
        META_HIDDEN_SIZE: str(hidden_size),
    }
    if num_model_layers is not None:
        metadata[META_NUM_MODEL_LAYERS] = str(num_model_layers)
    return pa.schema([
        pa.field(ID, pa.string(), nullable=False),
        pa.field(INPUT_IDS, pa.list_(pa.int32())),
        pa.field(LOSS_MASK, pa.list_(pa.uint8())),
        pa.field(NUM_TOKENS, pa.int32()),
        pa.field(ORIGINAL_NUM_TOKENS, pa.int32()),
        pa.field(CLIPPED, pa.bool_()),
        pa.field(HIDDEN_STATES, pa.list_(pa.binary(width))),
    ] + ([pa.field(HIDDEN_STATE_SCALES, pa.list_(pa.binary(len(layer_ids) * FP8_SCALE_BYTES)))] if dtype == FP8
         else []), metadata=metadata)
