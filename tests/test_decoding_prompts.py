"""The single owners in decoding/prompts.py: length-sorted batching and the stop ids."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dflash_jax.decoding.prompts import in_prompt_order, length_sorted_batches, stop_token_ids


def test_length_sorted_batches_orders_by_length_and_in_prompt_order_inverts_it():
    prompts = [[1] * 5, [1] * 2, [1] * 9, [1] * 2, [1] * 1]  # lengths 5, 2, 9, 2, 1
    batches = length_sorted_batches(prompts, 2)
    # shortest first; the two prompts of length 2 keep their order (1 before 3)
    assert batches == [[4, 1], [3, 0], [2]]
    # each batch's results (here: the prompt's length, tagged) come back in prompt order
    results = [[("len", len(prompts[i])) for i in idx] for idx in batches]
    assert in_prompt_order(batches, results) == [("len", 5), ("len", 2), ("len", 9), ("len", 2), ("len", 1)]
    assert length_sorted_batches([], 4) == [] and in_prompt_order([], []) == []
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        length_sorted_batches(prompts, 0)
    with pytest.raises(ValueError):  # a batch whose results do not match its indices
        in_prompt_order(batches, [["a", "b"], ["c"], ["d"]])


class _Tokenizer:
    """The few tokenizer attributes the stop ids need."""

    eos_token_id = 2
    unk_token_id = 0
    vocab = {"<|eot|>": 9, "</s>": 2}

    def convert_tokens_to_ids(self, token):
        return self.vocab.get(token, self.unk_token_id)


def test_stop_token_ids_are_eos_and_end_of_turn_sorted_and_deduplicated(qwen):
    config = SimpleNamespace(eos_token_ids=(7, 2))
    tok = _Tokenizer()
    assert stop_token_ids(config) == (2, 7)  # no tokenizer: the target's EOS ids
    assert stop_token_ids(config, tok) == (2, 7)  # the tokenizer's EOS 2 counted once
    assert stop_token_ids(config, tok, end_of_turn=True, eot_token="<|eot|>") == (2, 7, 9)
    assert stop_token_ids(config, tok, end_of_turn=True, eot_token="</s>") == (2, 7)
    # an end-of-turn token the tokenizer does not know (its unk id) is left out
    assert stop_token_ids(config, tok, end_of_turn=True, eot_token="<|nope|>") == (2, 7)
    assert stop_token_ids(SimpleNamespace(eos_token_ids=()), tok) == (2,)

    # The real Qwen3 tokenizer: EOS and end-of-turn are both <|im_end|> (151645), found from the
    # chat template; the target's <|endoftext|> (151643) joins it.
    qwen_config = SimpleNamespace(eos_token_ids=(151645, 151643))
    assert stop_token_ids(qwen_config, qwen) == (151643, 151645)
    assert stop_token_ids(qwen_config, qwen, end_of_turn=True) == (151643, 151645)
    assert stop_token_ids(SimpleNamespace(eos_token_ids=()), qwen, end_of_turn=True) == (151645,)
