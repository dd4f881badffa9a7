"""Prompts on their way into a decoder: chat encoding, the ids that end a reply, padding and
length-sorted batching. The one owner of each, for generation, speculative decoding, evaluation,
regeneration and the draft vocabulary alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def encode_prompt(tokenizer, messages, enable_thinking=None) -> list[int]:
    """Chat messages -> prompt token ids, ending with the generation prompt of the chat template."""
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(t) for t in out]


def stop_token_ids(
    target_config, tokenizer=None, *, end_of_turn: bool = False, eot_token: str | None = None
) -> tuple[int, ...]:
    """The ids that end a reply, sorted and deduplicated: the target's EOS ids, the tokenizer's EOS
    id (when a tokenizer is given) and, with ``end_of_turn``, the chat template's end-of-turn token
    (``eot_token``, else the one the template shows; left out when it cannot be found or is unknown
    to the tokenizer)."""
    ids = {int(i) for i in getattr(target_config, "eos_token_ids", ()) or ()}
    if tokenizer is None:
        return tuple(sorted(ids))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if end_of_turn:
        from dflash_jax.data.chat import ChatTemplateError, end_of_turn_token

        try:
            eot = eot_token or end_of_turn_token(tokenizer)
        except (ChatTemplateError, ValueError):
            eot = None
        if eot is not None:
            eot_id = tokenizer.convert_tokens_to_ids(eot)
            if eot_id is not None and eot_id != tokenizer.unk_token_id:
                ids.add(int(eot_id))
    return tuple(sorted(ids))


def bucket_length(n: int, multiple: int = 64) -> int:
    """Round a length up to a multiple, so a few compiled shapes serve all prompts."""
    return max(multiple, -(-n // multiple) * multiple)


def pad_prompts(prompts, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists into ``[rows, bucket_length(longest)]`` ids plus their lengths
    (rows past the prompts are dummies of length 1)."""
    P = bucket_length(max(len(p) for p in prompts))
    ids = np.zeros((rows, P), np.int32)
    lengths = np.ones((rows,), np.int32)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = p
        lengths[r] = len(p)
    return ids, lengths


def length_sorted_batches(prompts: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
    """Prompt indices in batches of ``batch_size``, shortest prompts first (equal lengths keep their
    order), so each batch pads to few tokens and similar lengths share a compiled shape."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    return [order[s : s + batch_size] for s in range(0, len(order), batch_size)]


def in_prompt_order(batches: Sequence[Sequence[int]], batch_results: Sequence[Sequence]) -> list:
    """The results of ``length_sorted_batches``' batches (one sequence per batch, one result per
    index) back in the order of the prompts."""
    out = [None] * sum(len(b) for b in batches)
    for idx, results in zip(batches, batch_results, strict=True):
        for i, result in zip(idx, results, strict=True):
            out[i] = result
    return out
