"""The tiny models' tokenizer: the Qwen3 special tokens, byte-level BPE trained on the corpus, tokenizer_config.json,
and the chat template (`data/chat_template.jinja`) compiled and rendered as transformers renders it.
"""

from __future__ import annotations

import functools
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_TEMPLATE_PATH = Path(__file__).parent / "data" / "chat_template.jinja"

# BPE with min_frequency=1 on the ~37 KB corpus stops at ~3.8K tokens, by then nearly every corpus word is one
# token: the model learns word sequences instead of spelling (with 2K tokens it spent most of its training on
# word fragments). The cap is not reached; it keeps a bigger corpus from growing the embedding table.
TOKENIZER_MAX_VOCAB = 4096

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, THINK_START, THINK_END)


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------
def train_tokenizer(corpus_path: Path):
    """Byte-level BPE (GPT-2 / Qwen style: every byte is a token, so any text encodes) over the corpus."""
    # heavy: keeps python -m job --help fast
    # heavy: imported on use
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_MAX_VOCAB,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in corpus_path.read_text(encoding="utf-8").splitlines() if not line.startswith("# ")]
    # The role names follow <|im_start|> in every example; they deserve whole tokens.
    scaffolding = [f"{role}\n" for role in ("system", "user", "assistant", "tool")] * 4
    tokenizer.train_from_iterator(lines + scaffolding, trainer)
    # Added after the BPE vocabulary, as in Qwen3 (ids len(bpe)..len(bpe)+4), each one token that text never
    # splits. As in Qwen3, <think> and </think> are *not* special: decoding with skip_special_tokens=True (vLLM's
    # default) keeps them in the text, so reasoning and answer can be told apart in the output text.
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS[:3]])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in SPECIAL_TOKENS[3:]])
    return tokenizer


def tokenizer_config(tokenizer, chat_template: str, model_max_length: int) -> dict:
    return {
        # The generic fast class loads in transformers 4.x and 5.x alike (5.x maps it to TokenizersBackend).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(token)): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": token not in (THINK_START, THINK_END),
            }
            for token in SPECIAL_TOKENS
        },
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "chat_template": chat_template,
    }


@functools.lru_cache(maxsize=4)
def _compiled_template(chat_template: str):
    """Compiled like transformers' apply_chat_template compiles it (same Jinja options), once per build."""
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(chat_template)


def render_prompt(chat_template: str, messages: list[dict]) -> str:
    return _compiled_template(chat_template).render(messages=messages, add_generation_prompt=True)
