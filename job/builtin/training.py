"""The brief training on CPU: synthetic chats tokenized and packed into rows, a loss weighted after sentence
boundaries, a fixed thread count (two builds must be byte-identical), and the train loop.
"""

from __future__ import annotations

import contextlib
import math
import random
import time

from job.builtin.corpus import Corpus, synthesize_chat
from job.builtin.tokenizer import render_prompt

# ---------------------------------------------------------------------------------------------------------------
# Training recipe
# ---------------------------------------------------------------------------------------------------------------
# 400 steps of one 1024-token row (~5 chats) is 410K tokens: 0.2 s a step, ~80 s on 2 idle cores (several times
# longer when other processes keep the cores busy: the OpenMP threads then wait on each other). Learning is
# limited by the number of optimizer steps, not tokens: 60 steps of 4 rows stayed at loss 5 and word salad, 400
# of 1 row reach loss ~2 and the format. 300 steps gave as many well-formed outputs but almost no long ones.
# Tests that only need a loadable model use ~5 steps.
DEFAULT_TRAIN_STEPS = 400
# The hybrid trains ~3x slower per step on CPU (transformers' torch reference path for the conv and the gated delta
# rule), so it gets fewer steps: enough for the answer format most of the time, which keeps its completions short
# (an untrained model runs every completion to max_tokens).
DEFAULT_HYBRID_TRAIN_STEPS = 200
ROWS_PER_STEP = 1
# Chats are packed into rows of this many tokens; it is above nearly every chat the synthesizer makes (up to 40
# reasoning sentences), so chats are learned in full, including their <|im_end|>. 768-token rows (capping
# reasoning at 30 sentences) were 25% cheaper but closed the think block twice far more often.
ROW_TOKENS = 1024
# 1e-2 with 1-row steps; 5e-3 reached the same loss but closed the think block twice more often.
LEARNING_RATE = 1e-2
BOUNDARY_LOSS_WEIGHT = 3.0
WARMUP_STEPS = 10
# Threads are fixed during training: the reduction order of CPU kernels depends on the thread count, and two
# builds must be byte-identical.
TRAIN_THREADS = 2


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------
def training_examples(tokenizer, chat_template: str, corpus: Corpus, num_tokens: int, rng: random.Random):
    """(token ids, index where the completion starts) for synthetic chats, in a fixed order, until num_tokens."""
    examples, total = [], 0
    while total < num_tokens:
        messages, completion = synthesize_chat(rng, corpus)
        prompt_ids = tokenizer.encode(render_prompt(chat_template, messages)).ids
        completion_ids = tokenizer.encode(completion).ids
        ids = (prompt_ids + completion_ids)[:ROW_TOKENS]
        examples.append((ids, len(prompt_ids)))
        total += len(ids)
    return examples


def _packed_rows(examples, pad_id: int):
    """Chats packed back to back into rows of ROW_TOKENS, in order (no padding between chats: ~2% is wasted at
    row ends instead of ~40% with one padded chat per row). Position ids restart at 0 for every chat; with
    attention_mask=None transformers turns that into a block-diagonal causal mask, so a chat never attends to the
    one before it and training sees exactly what inference sees."""
    # heavy: keeps python -m job --help fast
    import torch  # heavy: imported on use

    rows, row = [], []
    for ids, completion_start in examples:
        if sum(len(i) for i, _ in row) + len(ids) > ROW_TOKENS:
            rows.append(row)
            row = []
        row.append((ids, completion_start))
    rows.append(row)
    input_ids = torch.full((len(rows), ROW_TOKENS), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), ROW_TOKENS), dtype=torch.long)
    labels = torch.full((len(rows), ROW_TOKENS), -100, dtype=torch.long)  # -100: no loss
    for r, row in enumerate(rows):
        offset = 0
        for ids, completion_start in row:
            end = offset + len(ids)
            input_ids[r, offset:end] = torch.tensor(ids)
            position_ids[r, offset:end] = torch.arange(len(ids))
            # Loss on the completion only: prompts never need predicting, all capacity goes to the answer.
            labels[r, offset + completion_start : end] = input_ids[r, offset + completion_start : end]
            offset = end
        # The padded tail is one more "sequence" (positions from 0), cut off from the chats, without loss.
        position_ids[r, offset:] = torch.arange(ROW_TOKENS - offset)
    return input_ids, position_ids, labels


def _boundary_tokens(tokenizer, vocab_size: int):
    """Bool per token id: the token ends a sentence or a line. The prediction after it is where the model decides
    to go on, close the think block or stop."""
    # heavy: keeps python -m job --help fast
    import torch  # heavy: imported on use

    is_boundary = torch.zeros(vocab_size, dtype=torch.bool)
    for token_id in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        is_boundary[token_id] = text.rstrip(" ").endswith((".", "?", "!", "\n"))
    return is_boundary


def _weighted_loss(logits, input_ids, labels, is_boundary):
    """Cross-entropy over the completion, with BOUNDARY_LOSS_WEIGHT on predictions made right after a boundary
    token. Those few positions (~1 in 12) carry the whole answer format (go on, close the think block, stop), so
    they count 3x; the weight was chosen, not tuned, and costs nothing."""
    # heavy: keeps python -m job --help fast
    import torch  # heavy: imported on use

    logits, targets = logits[:, :-1].float(), labels[:, 1:]
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="none"
    ).view_as(targets)
    weights = torch.where(is_boundary[input_ids[:, :-1]], BOUNDARY_LOSS_WEIGHT, 1.0) * (targets != -100)
    return (losses * weights).sum() / weights.sum()


def warmup_cosine(train_steps: int, warmup: int = WARMUP_STEPS):
    """The learning-rate factor by step: linear warmup, then cosine decay to 10 % (LambdaLR's function)."""

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, train_steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return lr_factor


@contextlib.contextmanager
def fixed_threads(num_threads: int):
    # heavy: keeps python -m job --help fast
    import torch  # heavy: imported on use

    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def train(make_model, vocab_size: int, tokenizer, examples, pad_id: int, train_steps: int, seed: int,
           log) -> dict:
    # heavy: keeps python -m job --help fast
    import torch  # heavy: imported on use

    torch.manual_seed(seed)
    model = make_model().float()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.0)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(train_steps))
    input_ids, position_ids, labels = _packed_rows(examples, pad_id)
    is_boundary = _boundary_tokens(tokenizer, vocab_size)
    started = time.monotonic()
    for step in range(train_steps):
        rows = slice(step * ROWS_PER_STEP, (step + 1) * ROWS_PER_STEP)
        # use_cache=False: with a cache transformers would not build the per-chat (packed) attention mask.
        logits = model(input_ids=input_ids[rows], position_ids=position_ids[rows], use_cache=False).logits
        loss = _weighted_loss(logits, input_ids[rows], labels[rows], is_boundary)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == train_steps - 1:
            log(f"step {step + 1}/{train_steps}  loss {loss.item():.3f}  {time.monotonic() - started:.0f}s")
    # Tied embeddings: lm_head.weight is the embedding table, and checkpoints of tied models leave it out.
    return {
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in sorted(model.state_dict().items())
        if name != "lm_head.weight"
    }
