"""Tokenise a conversation with the target's own chat template, with a loss mask on the replies.

What is trained (``loss_mask == 1``) in each assistant turn: everything the model itself would
generate after its prompt, up to and including the template's end-of-turn token. Concretely the
trained span of turn ``i`` starts where ``apply_chat_template(messages[:i],
add_generation_prompt=True, enable_thinking=...)`` ends inside the full rendering, and ends after
the first end-of-turn token that follows the reply's content. Role headers, user/system turns,
the newline after the end-of-turn token and anything the template adds before the reply are
not trained.

Qwen3: the template puts an empty ``<think>\\n\\n</think>\\n\\n`` before the *last* reply and
none before earlier replies. With ``enable_thinking=False`` that block is part of the generation
prompt, so it is not trained (the model never generates it) and every reply trains exactly its
content + ``<|im_end|>``. With ``enable_thinking=True``/``None`` the model would write the think
block itself, so for the last reply it is trained too. Use ``enable_thinking=False`` for
non-reasoning data (ShareGPT); replies that carry their own ``<think>...</think>`` are trained
with their reasoning wherever the template renders it.

Templates whose rendering is not prefix-stable (the prompt of turn ``i`` is not a prefix of the
full text) fall back to locating the reply's content in the rendered text, in order.

Tool calling: ``tools`` (the record's tool schemas) is passed to every rendering, turns keep their
``tool_calls`` / ``tool_call_id`` / ``name``, and a reply with ``tool_calls`` trains the calls the
template renders up to its end-of-turn token (like any reply). Tool results (role ``tool``) are
prompt, never trained. A reply that is only tool calls has no content to locate, so it needs a
prefix-stable template.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

_TOOL_KEYS = ("tool_calls", "tool_call_id", "name")  # turn keys templates read for tool calling
_PROBE = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong-7f3a"}]
_EOT_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ChatTemplateError(ValueError):
    """The chat template cannot be used to build a loss mask for this conversation."""


def _render(tokenizer, messages, *, add_generation_prompt: bool, chat_template, kwargs) -> str:
    out = tokenizer.apply_chat_template(
        list(messages),
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        **kwargs,
    )
    if not isinstance(out, str):
        raise ChatTemplateError(f"apply_chat_template returned {type(out).__name__}, expected str")
    return out


def _added_token_strings(tokenizer) -> list[str]:
    toks = set(getattr(tokenizer, "all_special_tokens", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    toks.update(t.content if hasattr(t, "content") else str(t) for t in decoder.values())
    return sorted((t for t in toks if t), key=len, reverse=True)


def _special_token_strings(tokenizer) -> list[str]:
    return [t for t in getattr(tokenizer, "all_special_tokens", []) or [] if t]


def end_of_turn_token(tokenizer, *, chat_template: str | None = None) -> str:
    """The string the chat template closes an assistant turn with (e.g. ``<|im_end|>``).

    Found by rendering a probe conversation and taking the first added/special token after the
    reply; falls back to ``eos_token`` when it follows the reply.
    """
    per_tok = _EOT_CACHE.setdefault(tokenizer, {})
    key = chat_template or "<default>"
    if key in per_tok:
        return per_tok[key]
    text = _render(tokenizer, _PROBE, add_generation_prompt=False, chat_template=chat_template, kwargs={})
    at = text.rfind(_PROBE[1]["content"])
    if at < 0:
        raise ChatTemplateError(
            "chat template does not render the assistant content verbatim; pass eot_token"
        )
    after = text[at + len(_PROBE[1]["content"]) :]
    best = None
    for tok in _added_token_strings(tokenizer):
        j = after.find(tok)
        if j >= 0 and (best is None or j < best[0]):
            best = (j, tok)
    if best is None:
        eos = getattr(tokenizer, "eos_token", None)
        if eos and eos in after:
            best = (after.find(eos), eos)
    if best is None:
        raise ChatTemplateError(
            f"cannot find an end-of-turn token after the assistant reply in {after!r}; pass eot_token"
        )
    per_tok[key] = best[1]
    return best[1]


def _content_variants(content: str) -> list[str]:
    """Forms in which a template may render a reply (verbatim, trimmed, reasoning split off)."""
    out = [content, content.strip()]
    if "</think>" in content:
        out.append(content.split("</think>")[-1].strip())
    seen, uniq = set(), []
    for v in out:
        if v and v not in seen:
            seen.add(v)
            uniq.append(v)
    return uniq


def _find_first(text: str, variants: Sequence[str], start: int) -> tuple[int, int] | None:
    """Earliest occurrence at/after ``start`` of any variant -> (begin, end)."""
    best = None
    for v in variants:
        j = text.find(v, start)
        if j >= 0 and (best is None or j < best[0] or (j == best[0] and j + len(v) > best[1])):
            best = (j, j + len(v))
    return best


def assistant_char_spans(
    tokenizer,
    messages: Sequence[Mapping[str, str]],
    *,
    enable_thinking: bool | None = None,
    chat_template: str | None = None,
    eot_token: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages``; return the text and the trained ``[start, end)`` char span per reply."""
    msgs = [{k: m[k] for k in ("role", "content", *_TOOL_KEYS) if k in m} for m in messages]
    base: dict[str, Any] = {"tools": list(tools)} if tools else {}
    kwargs = base if enable_thinking is None else {**base, "enable_thinking": enable_thinking}
    full = _render(tokenizer, msgs, add_generation_prompt=False, chat_template=chat_template, kwargs=kwargs)
    eot = eot_token or end_of_turn_token(tokenizer, chat_template=chat_template)
    specials = [t for t in _special_token_strings(tokenizer) if t != eot]
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(msgs):
        variants = _content_variants(m["content"])
        if m["role"] != "assistant":
            # Advance past this turn so a reply is never matched inside an earlier prompt.
            hit = _find_first(full, variants, cursor)
            if hit is not None:
                cursor = hit[1]
            continue
        start = None
        for kw in [kwargs, base] if kwargs != base else [kwargs]:
            try:
                prompt = _render(
                    tokenizer, msgs[:i], add_generation_prompt=True, chat_template=chat_template, kwargs=kw
                )
            except Exception:  # noqa: BLE001 - some templates reject e.g. an empty prefix
                continue
            if len(prompt) >= cursor and full.startswith(prompt):
                start = len(prompt)
                break
        hit = _find_first(full, variants, cursor if start is None else start)
        if hit is None and not variants and start is not None and m.get("tool_calls"):
            hit = (start, start)  # only tool calls: the reply is what follows the prompt
        if hit is None:
            raise ChatTemplateError(f"message {i}: the chat template does not render the assistant content")
        if start is None:
            start = hit[0]
        eot_at = full.find(eot, hit[1])
        if eot_at < 0:
            raise ChatTemplateError(f"message {i}: no end-of-turn token {eot!r} after the assistant content")
        tail = full[hit[1] : eot_at]
        if any(s in tail for s in specials):
            raise ChatTemplateError(
                f"message {i}: another special token appears between the assistant content and {eot!r}"
            )
        end = eot_at + len(eot)
        spans.append((start, end))
        cursor = end
    return full, spans


def tokenize_conversation(
    tokenizer,
    messages: Sequence[Mapping[str, str]],
    *,
    enable_thinking: bool | None = None,
    chat_template: str | None = None,
    eot_token: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Messages (and the record's ``tools``) -> ``(input_ids int32 [T], loss_mask bool [T])`` with
    the target's chat template.

    A token is trained iff its characters overlap a reply span (see the module docstring). Needs a
    fast tokenizer (character offsets). Raises :class:`ChatTemplateError` when the template hides
    or rewrites a reply so that it cannot be located.
    """
    full, spans = assistant_char_spans(
        tokenizer,
        messages,
        enable_thinking=enable_thinking,
        chat_template=chat_template,
        eot_token=eot_token,
        tools=tools,
    )
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # The Rust tokenizer directly: same ids as tokenizer(text, add_special_tokens=False), and a
        # read-only call, so pipeline threads can share one tokenizer.
        enc = backend.encode(full, add_special_tokens=False)
        ids_list, offsets_list = enc.ids, enc.offsets
    else:
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        if "offset_mapping" not in enc:
            raise ChatTemplateError(
                "tokenizer gives no character offsets; a fast (Rust) tokenizer is required"
            )
        ids_list, offsets_list = enc["input_ids"], enc["offset_mapping"]
    ids = np.asarray(ids_list, dtype=np.int32)
    offsets = np.asarray(offsets_list, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(ids.shape, dtype=bool)
    for s, e in spans:
        mask |= (offsets[:, 0] < e) & (offsets[:, 1] > s)
    return ids, mask
