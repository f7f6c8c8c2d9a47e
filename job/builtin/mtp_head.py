"""The hybrid's MTP head, trained briefly on the frozen language model, so that `speculative_config: {method: mtp}`
is a real baseline for `python -m job worth` (a random head accepts nothing, and any draft would beat it).

The head is Qwen3.5's as vLLM's qwen3_5_mtp serves it: at slot p it takes the token x[p+1] and the target's final
(normed) hidden state at p, `fc([pre_fc_norm_embedding(embed(x[p+1])); pre_fc_norm_hidden(h[p])])`, runs one
full-attention decoder layer over the slots (causal, at position p) and the final `norm`, and predicts x[p+2]
with the target's (tied) LM head. For the first drafted token vLLM feeds it exactly this: the target's token ids
shifted by one, its positions and its returned hidden states, which Qwen3.5 returns after the final norm. For the
second and later ones (k > 1) vLLM chains the head on its own normed output instead of the target's state, a step
this training never shows it: served at k = 3 its acceptance falls with the position (0.48, 0.32, 0.25 on an H100,
docs/BENCHMARKS.md), more than a head trained on its chained steps would.

Trained with the language model frozen: cross-entropy on the token two ahead, over the completions of fresh synthetic
chats of the same corpus. The decoder layer starts from a copy of the target's own full-attention layer, the norms at
identity and `fc` random. One MTP layer (MTP_NUM_LAYERS), as Qwen3.5/3.6 ship.
"""

from __future__ import annotations

import time

from job.builtin.training import warmup_cosine

# 300 steps of 8 chats in ~32 s on 2 cores, the language model's states of the chats computed once first (~8 s):
# loss 15.1 -> 1.7 (the language model's own next-token loss is ~1.3). On 108 chats it never saw, the head's top
# token is then the target's own greedy token two ahead at 67 % of completion slots, against 0.1 % for a random head
# (tests/test_tiny_model.py holds it above 40 %).
MTP_TRAIN_STEPS = 300
MTP_CHATS_PER_STEP = 8
MTP_LEARNING_RATE = 2e-3
# Distinct chats the steps draw from (each seen ~4 times): the language model's states are computed once per chat.
MTP_NUM_CHATS = 600


class MtpHead:
    """The head's modules in torch (transformers' Qwen3.5 decoder layer and norm: the (1 + w) convention vLLM's
    Qwen3_5RMSNorm uses), run over a batch of right-padded chats."""

    def __init__(self, text_config, full_attention_layer: int):
        import torch  # heavy: imported on use
        from transformers.models.qwen3_5.modeling_qwen3_5 import (  # heavy: imported on use
            Qwen3_5DecoderLayer,
            Qwen3_5RMSNorm,
        )

        hidden = text_config.hidden_size
        self.layer = Qwen3_5DecoderLayer(text_config, full_attention_layer)
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.norms = torch.nn.ModuleDict({name: Qwen3_5RMSNorm(hidden, eps=text_config.rms_norm_eps)
                                          for name in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding")})
        self.modules = torch.nn.ModuleDict({"layer": self.layer, "fc": self.fc, "norms": self.norms})

    def state_dict(self) -> dict:
        """As the checkpoint names them, under `mtp.`."""
        out = {f"mtp.layers.0.{k}": v for k, v in self.layer.state_dict().items()}
        out["mtp.fc.weight"] = self.fc.weight
        out.update({f"mtp.{name}.weight": norm.weight for name, norm in self.norms.items()})
        return out

    def load(self, tensors: dict) -> None:
        """From a checkpoint's `mtp.*` tensors (strict: a key vLLM would load must be here)."""
        self.layer.load_state_dict({k.removeprefix("mtp.layers.0."): v for k, v in tensors.items()
                                    if k.startswith("mtp.layers.0.")}, strict=True)
        self.fc.weight.data.copy_(tensors["mtp.fc.weight"])
        for name, norm in self.norms.items():
            norm.weight.data.copy_(tensors[f"mtp.{name}.weight"])

    def logits(self, text_model, input_ids, hidden):
        """Logits for x[p+2] at every slot p (the last slot's has no target): input_ids (B, T), the target's final
        hidden states (B, T, H); text_model a causal LM whose language model `language_model()` finds."""
        import torch  # heavy: imported on use

        batch, length = input_ids.shape
        lm = language_model(text_model)
        embedded = lm.embed_tokens(input_ids[:, 1:])
        fused = self.fc(torch.cat([self.norms["pre_fc_norm_embedding"](embedded),
                                   self.norms["pre_fc_norm_hidden"](hidden[:, :-1])], dim=-1))
        positions = torch.arange(length - 1).expand(batch, -1)
        rotary = lm.rotary_emb(fused, positions[None].expand(3, batch, -1))  # text-only M-RoPE
        # Causal, given explicitly (every attention implementation honours a mask; not all infer one from None).
        # Right padding never reaches a real slot before it.
        causal = torch.full((length - 1, length - 1), float("-inf")).triu(1)[None, None].expand(batch, 1, -1, -1)
        out = self.layer(fused, position_embeddings=rotary, attention_mask=causal, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        return text_model.lm_head(self.norms["norm"](out))


def language_model(model):
    """The text decoder (embed_tokens, rotary_emb, layers, norm) of Qwen3_5ForCausalLM or of the whole
    Qwen3_5ForConditionalGeneration."""
    return getattr(model.model, "language_model", model.model)


def _padded(chats, pad_id: int):
    import torch  # heavy: imported on use

    length = max(len(ids) for ids, _ in chats)
    input_ids = torch.full((len(chats), length), pad_id, dtype=torch.long)
    loss_from = torch.full((len(chats), length), False)
    for row, (ids, completion_start) in enumerate(chats):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        loss_from[row, completion_start:len(ids)] = True  # the completion's tokens are the ones predicted
    return input_ids, loss_from


def _final_hidden(text_model, chats, pad_id: int, batch: int = 16) -> list:
    """The frozen language model's final (normed) hidden states per chat, computed once: [(input_ids, loss_from,
    hidden)] in batches of `batch` chats of similar length (padding is wasted work)."""
    import torch  # heavy: imported on use

    order = sorted(range(len(chats)), key=lambda i: len(chats[i][0]))
    batches = []
    with torch.no_grad():
        for start in range(0, len(order), batch):
            group = [chats[i] for i in order[start:start + batch]]
            input_ids, loss_from = _padded(group, pad_id)
            # Right padding: the GDN scan and causal attention never carry a pad back into a real token.
            hidden = language_model(text_model)(input_ids=input_ids, use_cache=False).last_hidden_state
            batches.append((input_ids, loss_from, hidden))
    return batches


def _loss(head, text_model, input_ids, loss_from, hidden):
    import torch  # heavy: imported on use

    logits = head.logits(text_model, input_ids, hidden)[:, :-1]  # slot p predicts x[p+2]
    targets, weights = input_ids[:, 2:], loss_from[:, 2:]
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                               reduction="none").view_as(targets)
    return (losses * weights).sum() / weights.sum()


def train_mtp_head(text_model, text_config, full_attention_layer: int, chats, pad_id: int, seed: int,
                   log, steps: int = MTP_TRAIN_STEPS) -> dict:
    """The head's tensors (bf16, `mtp.*`), trained on `chats` [(token ids, completion start)] with the language model
    frozen."""
    import random

    import torch  # heavy: imported on use

    torch.manual_seed(seed)
    text_model = text_model.float().eval()
    for p in text_model.parameters():
        p.requires_grad_(False)
    head = MtpHead(text_config, full_attention_layer)
    # A copy of the target's own full-attention layer as the start (the head's layer is one of its kind).
    head.layer.load_state_dict(language_model(text_model).layers[full_attention_layer].state_dict())
    started = time.monotonic()
    batches = _final_hidden(text_model, chats, pad_id, MTP_CHATS_PER_STEP)
    log(f"MTP head: the language model's states of {len(chats)} chats in {time.monotonic() - started:.0f}s")
    params = list(head.modules.parameters())
    optimizer = torch.optim.AdamW(params, lr=MTP_LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.0)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps))  # the language model's schedule
    order = random.Random(seed).sample(range(len(batches)), len(batches))
    head.modules.train()
    for step in range(steps):
        loss = _loss(head, text_model, *batches[order[step % len(order)]])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            log(f"MTP head: step {step + 1}/{steps}  loss {loss.item():.3f}  {time.monotonic() - started:.0f}s")
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}


def greedy_agreement(model_dir: str, chats, pad_id: int) -> float:
    """The share of completion slots where the saved MTP head's top token is the target's own greedy token two
    ahead (the one it predicts from the prefix up to x[p+1]): the first drafted token's greedy acceptance, teacher
    forced. Reads the checkpoint as vLLM does (`mtp.*` beside the language model)."""
    import torch  # heavy: imported on use
    from safetensors.torch import load_file  # heavy: imported on use
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: imported on use

    config = AutoConfig.from_pretrained(model_dir)
    text_config = config.get_text_config()
    text_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    head = MtpHead(text_config, list(text_config.layer_types).index("full_attention"))
    head.load({k: v.float() for k, v in load_file(f"{model_dir}/model.safetensors").items() if k.startswith("mtp.")})
    agree = total = 0
    with torch.no_grad():
        for input_ids, loss_from, hidden in _final_hidden(text_model, chats, pad_id):
            target_next = text_model.lm_head(hidden).argmax(-1)  # the target's greedy token after each prefix
            drafted = head.logits(text_model, input_ids, hidden)[:, :-1].argmax(-1)  # slot p: x[p+2]
            mask = loss_from[:, 2:]
            agree += int(((drafted == target_next[:, 1:-1]) & mask).sum())
            total += int(mask.sum())
    return agree / max(1, total)
