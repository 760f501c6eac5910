"""Greedy generation over the engine's K/V pages: the prompt is stored chunk by chunk (stage 1 without
gradients, as ``eval_loss`` runs it), then each new token attends to the pages and is written into them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..core.config import ChunkConfig
from ..core.schedule import ChunkedSequence
from ..integrations.transformers import causal_lm


@dataclass
class GenerateOutput:
    """What ``generate(..., output_logprobs=True)`` returns.

    sequences: (B, T_prompt + n) int64, the prompt and the n new tokens, as ``generate`` returns alone.
    logprobs: (B, n) float32, the log-probability (natural log) of each new token under the model's
        distribution at its step: log_softmax of the final logits, what transformers'
        ``compute_transition_scores(sequences, scores, normalize_logits=True)`` gives for greedy search (where a
        sequence of a batch has ended, that of its padding token, as there).
    """

    sequences: torch.Tensor
    logprobs: torch.Tensor


def _eos_ids(eos_token_id: int | list[int] | None, lm: nn.Module) -> list[int]:
    if eos_token_id is None:
        eos_token_id = getattr(lm.generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]


def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int | None = None,
    eos_token_id: int | list[int] | None = None,
    *,
    pad_token_id: int | None = None,
    output_logprobs: bool = False,
    stop: Callable[[torch.Tensor], bool] | None = None,
    config: ChunkConfig | None = None,
    **options: Any,
) -> torch.Tensor | GenerateOutput:
    """Greedy decoding, as ``model.generate(input_ids, do_sample=False, max_new_tokens=..., eos_token_id=...)``
    with no logits processor (no repetition penalty, no minimum length: plain argmax), the prompt stored in
    the engine's pages one chunk at a time.

    input_ids: (B, T_prompt) int64 token ids; B >= 1 prompts of one length, none padded (there is no
    attention_mask: left-padded batches are refused by their shape, not supported). max_new_tokens: the most new
    tokens per sequence. eos_token_id: one id or a list; None: the model's generation_config's. Generation stops
    when every sequence has produced an EOS token or after max_new_tokens; a sequence that ended early gets
    ``pad_token_id`` (None: the generation config's, else the first EOS id) at its later steps, as
    transformers pads. Returns (B, T_prompt + n) int64, n <= max_new_tokens, on input_ids' device; with
    ``output_logprobs`` a ``GenerateOutput`` (sequences and the chosen tokens' log-probabilities).
    stop: called after each step with the (B, n) new tokens so far; True ends the decoding there (a stopping
    criterion such as lm-eval's stop strings, which only the caller's tokenizer can read).
    config, options: the ``ChunkConfig`` of the forward (chunk_size, page_size, offload, sparse, ...), as
    ``eval_loss`` takes them. Memory: the K/V pages of T_prompt + max_new_tokens tokens and one chunk's
    activations; logits of one position per sequence at a time.
    """
    lm = causal_lm(model)
    if "attention_mask" in options:  # the transformers habit; the pages hold every position of every sequence
        raise ValueError("generate takes unpadded prompts of one length and no attention_mask; generate prompts "
                         "of other lengths one call each")
    eos = _eos_ids(eos_token_id, lm)
    if max_new_tokens is None:
        raise ValueError("generate needs max_new_tokens (the most new tokens per sequence), got None")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] < 1 \
            or input_ids.shape[1] < 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be (batch, prompt_len) token ids of B >= 1 unpadded prompts of one "
                         f"length, got {shape}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must hold token ids (int64 or int32), got dtype {input_ids.dtype}")
    batch, prompt = input_ids.shape
    total = prompt + max_new_tokens
    positions = getattr(lm.config, "max_position_embeddings", None)
    if positions is not None and total > positions:
        raise ValueError(f"a prompt of {prompt} tokens and max_new_tokens={max_new_tokens} reach position {total}, "
                         f"beyond the model's max_position_embeddings {positions}")
    if pad_token_id is None:
        pad_token_id = getattr(lm.generation_config, "pad_token_id", None)
    if pad_token_id is None and eos:
        pad_token_id = eos[0]
    config = ChunkConfig.build(config, **options)
    # Every position the decoding may reach is in the sequence from the start: the placement and the page table
    # are those of T_prompt + max_new_tokens tokens, and the tokens past the prompt are written as chosen.
    ids = torch.cat([input_ids.long(), input_ids.new_zeros(batch, max_new_tokens, dtype=torch.long)], dim=1)
    seq = ChunkedSequence(model, ids, config=config, training=False)
    chosen: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] = []
    finished = torch.zeros(batch, dtype=torch.bool, device=ids.device)
    eos_t = torch.tensor(eos, dtype=torch.long, device=ids.device)
    try:
        # Bound once: the model's attention goes to the sequence for every token, not rebound per token.
        with seq.bound():
            logits = seq.extend(prompt, keep_last=1)[:, -1]  # (B, V)
            for step in range(max_new_tokens):
                scores = torch.log_softmax(logits.float(), dim=-1)
                token = logits.argmax(dim=-1)
                if pad_token_id is not None:
                    token = torch.where(finished, torch.full_like(token, pad_token_id), token)
                logprob = scores.gather(1, token[:, None])[:, 0]
                chosen.append(token)
                logprobs.append(logprob)
                if eos:
                    finished |= torch.isin(token, eos_t)
                    if bool(finished.all()):
                        break
                if stop is not None and stop(torch.stack(chosen, dim=1)):
                    break
                if step + 1 == max_new_tokens:
                    break
                ids[:, prompt + step] = token
                logits = seq.extend(prompt + step + 1, keep_last=1)[:, -1]
    finally:
        seq.release()
    sequences = torch.cat([input_ids.long(), torch.stack(chosen, dim=1)], dim=1)
    if not output_logprobs:
        return sequences
    return GenerateOutput(sequences=sequences, logprobs=torch.stack(logprobs, dim=1))
