"""Regeneration through an OpenAI-compatible server (``regen.backend: server``).

The user's own serving engine (vLLM, SGLang, ``transformers serve``, ...) answers the prompts, so
regeneration runs at serving speed and on the machines that already serve the target. A server is
reached through the ``openai`` client at one or several base URLs (``regen.base_urls``, taken in
turn); a request that fails for a transient reason (no connection, timeout, 429, 5xx) is retried at
the next URL after an exponential backoff, ``regen.retries`` times.

Before a single prompt is sent, :func:`connect` checks that every server serves the run's target:
its ``/v1/models`` name must be the target's (the target directory's name, ``org/name`` for a hub
cache snapshot) or ``regen.model``, and a probe conversation must cost the server as many prompt
tokens as the local tokenizer and chat template give it: another model, tokenizer or template (whose
answers would train the drafter on another distribution) is refused with both names in the error.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_jax.cli import UserError
from dflash_jax.decoding.prompts import encode_prompt

log = logging.getLogger(__name__)

# Text in several scripts, digits, code and an emoji: two tokenizers rarely split all of it alike.
PROBE_MESSAGES = (
    {"role": "system", "content": "You are a helpful assistant."},
    {
        "role": "user",
        "content": "Zürich, 東京 and Café: what is 12345 * 678? def f(x):\n    return x**2  # 🙂",
    },
)

BACKOFF_S = 0.5  # first wait before a retry; doubled each time, 30 s at most


class ServerError(UserError):
    """A server that cannot be used: unreachable after the retries, or serving another model."""


@dataclass(frozen=True)
class ServerAnswer:
    content: str
    reasoning: str | None  # reasoning content the server returned apart (vLLM / SGLang parsers)
    stopped: bool  # ended by the model (finish_reason "stop"), not by the token limit
    prompt_tokens: int | None


def target_names(target_dir: str | os.PathLike) -> set[str]:
    """Names a server may give the target in ``/v1/models``: its directory as given and resolved,
    the directory's name, and ``org/name`` (and ``name``) for a hub cache snapshot
    (``models--org--name/snapshots/<revision>``)."""
    p = Path(target_dir).expanduser()
    names = {str(target_dir), str(p), str(p.resolve()), p.name, p.resolve().name}
    for q in (p, p.resolve()):
        if q.parent.name == "snapshots" and q.parent.parent.name.startswith("models--"):
            repo = q.parent.parent.name.removeprefix("models--").replace("--", "/")
            names |= {repo, repo.split("/")[-1]}
    return {n for n in names if n and n != "."}


def _same_model(served: str, expected: set[str]) -> bool:
    """``served`` names one of ``expected``: exactly, or by its last path component (a server
    started with ``--model org/name`` and a local directory ``.../name``), case-insensitively."""
    fold = {e.casefold() for e in expected} | {e.rstrip("/").split("/")[-1].casefold() for e in expected}
    return served.casefold() in fold or served.rstrip("/").split("/")[-1].casefold() in fold


class ChatServer:
    """OpenAI-compatible chat completions at ``base_urls``, taken in turn, thread-safe."""

    def __init__(self, base_urls, *, timeout_s: float, retries: int, api_key: str | None = None):
        import openai

        self._openai = openai
        # Local servers take any key; vLLM's --api-key / a gateway read OPENAI_API_KEY.
        key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.clients = {
            url: openai.OpenAI(base_url=url, api_key=key, timeout=timeout_s, max_retries=0)
            for url in base_urls
        }
        self.retries = retries
        self._turn = itertools.cycle(list(self.clients))
        self._lock = threading.Lock()

    def _next_url(self) -> str:
        with self._lock:
            return next(self._turn)

    def _call(self, fn, what: str, url: str | None = None):
        """``fn(client)`` at ``url`` (or the next URL in turn), retried with backoff on transient
        failures; a request the server rejects (4xx other than 408/429) is not retried."""
        o = self._openai
        transient = (o.APIConnectionError, o.RateLimitError, o.InternalServerError, o.ConflictError)
        last = None
        for attempt in range(self.retries + 1):
            at = url or self._next_url()
            try:
                return fn(self.clients[at])
            except transient as e:
                last = (at, e)
                if attempt < self.retries:
                    wait = min(30.0, BACKOFF_S * 2**attempt)
                    log.warning("%s at %s failed (%s); retry %d in %.1f s", what, at, e, attempt + 1, wait)
                    time.sleep(wait)
            except o.APIStatusError as e:
                if e.status_code == 408 and attempt < self.retries:
                    last = (at, e)
                    continue
                raise
        at, e = last
        raise ServerError(
            f"regen.base_urls: {what} failed {self.retries + 1} times (regen.retries={self.retries}), "
            f"last at {at}: {type(e).__name__}: {e}"
        )

    def models(self, url: str) -> list[str]:
        return [m.id for m in self._call(lambda c: list(c.models.list()), "GET /v1/models", url)]

    def chat(
        self,
        model: str,
        messages: list[dict],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        enable_thinking: bool | None = None,
        url: str | None = None,
    ) -> ServerAnswer:
        extra = (
            {} if enable_thinking is None else {"chat_template_kwargs": {"enable_thinking": enable_thinking}}
        )
        kwargs = {"seed": seed} if seed is not None and temperature > 0 else {}

        def create(client):
            return client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                extra_body=extra or None,
                **kwargs,
            )

        resp = self._call(create, "POST /v1/chat/completions", url)
        choice = resp.choices[0]
        msg = choice.message
        extra_fields = msg.model_extra or {}
        reasoning = extra_fields.get("reasoning_content") or extra_fields.get("reasoning")
        return ServerAnswer(
            content=msg.content or "",
            reasoning=reasoning or None,
            stopped=choice.finish_reason == "stop",
            prompt_tokens=resp.usage.prompt_tokens if resp.usage is not None else None,
        )


def connect(regen, target_dir, tokenizer, enable_thinking: bool | None) -> tuple[ChatServer, str]:
    """-> (the server, the model name to request), after checking that every URL of
    ``regen.base_urls`` serves the run's target (see the module's docstring); a
    :class:`ServerError` naming the URL, the served and the expected model otherwise."""
    server = ChatServer(regen.base_urls, timeout_s=regen.timeout_s, retries=regen.retries)
    expected = {regen.model} if regen.model else target_names(target_dir)
    what = f"regen.model={regen.model}" if regen.model else f"the run's target {target_dir}"
    local = len(encode_prompt(tokenizer, list(PROBE_MESSAGES), enable_thinking))
    chosen = None
    for url in server.clients:
        served = server.models(url)
        match = [m for m in served if _same_model(m, expected)]
        if not match:
            raise ServerError(
                f"regen.base_urls: {url} serves {served}, not {what}: start it on the target's weights, "
                "or set regen.model=NAME when it names the same weights otherwise"
            )
        if chosen is not None and match[0] != chosen:
            raise ServerError(f"regen.base_urls: {url} serves {match[0]!r}, another URL {chosen!r}")
        chosen = match[0]
        probe = server.chat(
            chosen, list(PROBE_MESSAGES), max_tokens=1, enable_thinking=enable_thinking, url=url
        )
        if probe.prompt_tokens is None:
            log.warning("%s reports no token usage: the tokenizer check was not made", url)
        elif probe.prompt_tokens != local:
            raise ServerError(
                f"regen.base_urls: {url} ({chosen!r}) reads a probe conversation as {probe.prompt_tokens} "
                f"prompt tokens, the run's tokenizer {getattr(tokenizer, 'name_or_path', '')!r} and chat "
                f"template as {local}: the server has another tokenizer or chat template than "
                f"{what}, and its answers would not be the target's"
            )
        log.info("%s serves %r (probe: %d prompt tokens, as here)", url, chosen, local)
    return server, chosen


__all__ = ["ChatServer", "ServerAnswer", "ServerError", "connect", "target_names"]
