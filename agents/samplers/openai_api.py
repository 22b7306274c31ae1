"""`Sampler` over an OpenAI-compatible `/v1/completions` endpoint, to evaluate hosted or served models.

Requests go through the `openai` client (`pip install openai`), which retries a connection error, a timeout and a
408/409/429/5xx answer ``max_retries`` times with its own backoff (0.5 s doubling, jittered, or the server's
Retry-After). Prompts travel as text (the token ids decoded with the given tokenizer, special tokens included), one
request per row, a few rows in flight at once. Completions come back as text and are mapped to token ids in one of
two ways:
- exact, when the server returns its tokens as ids (vLLM's `return_tokens_as_token_ids`, sent through
  `extra_body`): the sampled ids and their log-probs as the server reports them;
- otherwise the text is tokenized with the given tokenizer, and the server's log-probs are kept only when
  its token count matches ours (NaN per token when not: they cannot be aligned).

Each attempt must be answered in full within ``timeout_s``, the client's timeout applied to the whole exchange (the
client's own timeouts bound each socket read alone, so a server that drips its answer would hold a row as long as it
drips): `_DeadlineTransport` fails the attempt at its deadline, and a retry gets a deadline of its own. So a row
takes at most ``timeout_s * (max_retries + 1)`` seconds plus the backoff.

OpenAI-style servers drop the stop string from the text; it is put back so `text` ends with it, as with
the other samplers: from vLLM's `stop_reason` when the server sends one, else (OpenAI) by closing the
tag that is still open when the stop strings are closing tags such as `</search>`.

    sampler = OpenAISampler("http://127.0.0.1:8000/v1", "Qwen/Qwen2.5-7B-Instruct", tokenizer,
                            extra_body={"return_tokens_as_token_ids": True})   # a vLLM server
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpcore
import httpx

from agents.records import Completion, SamplingParams
from agents.samplers.base import TokenizerContext, cut_at_stop, overflow
from retrievers.http import TRANSPORT_ERRORS, DeadlinePool

_TOKEN_ID = re.compile(r"token_id:(\d+)")


def _openai() -> Any:
    try:
        import openai
    except ImportError as err:
        raise ImportError("OpenAISampler needs the openai client: pip install openai") from err
    return openai


class _DeadlineTransport(httpx.BaseTransport):
    """An httpx transport under the `openai` client that reads each exchange whole (status line, headers and body)
    within its deadline, or fails it with a timeout that the client retries (`retrievers.http.DeadlinePool`
    underneath). The deadline is the request's own timeout (the client's ``timeout``).

    Hand-written because the client's timeouts bound each socket operation alone: a server that sends a byte every
    half second never trips them (`tests/test_bounded_waits.py` shows the client alone still waiting long past its
    timeout). httpx, not the httpx2 that `openai` 3 uses by default: every `openai` release since 1.0 takes an
    ``httpx.Client``, and httpx is already a dependency.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pool = DeadlinePool()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = [t for t in (request.extensions.get("timeout") or {}).values() if t is not None]
        deadline = max(timeouts, default=self.timeout_s)
        try:
            answer = self._pool.request(
                request.method, str(request.url), timeout=deadline, headers=dict(request.headers),
                content=request.read(),
            )  # fmt: skip
        except httpcore.TimeoutException as err:
            raise httpx.ReadTimeout(str(err), request=request) from err
        except TRANSPORT_ERRORS as err:  # no connection, or a broken exchange: the client retries both
            kind = httpx.ConnectError if isinstance(err, httpcore.ConnectError) else httpx.TransportError
            raise kind(f"{type(err).__name__}: {err}", request=request) from err
        return httpx.Response(
            answer.status, headers=answer.headers, stream=httpx.ByteStream(answer.content), request=request
        )

    def close(self) -> None:
        self._pool.close()


class OpenAISampler(TokenizerContext):
    """`Sampler` that calls an OpenAI-compatible completions endpoint over HTTP.

    Args:
        base_url: the API root, e.g. "http://127.0.0.1:8000/v1" (requests go to `{base_url}/completions`).
        model: the model name the server expects.
        tokenizer: a Hugging Face tokenizer matching the served model (decodes prompts, encodes replies).
        api_key: bearer token; None reads $OPENAI_API_KEY, and without it the client sends "EMPTY".
        max_context: the served model's context length; longer prompts are left-truncated.
        timeout_s: seconds allowed for each attempt of a request as a whole (connect, send, and the whole answer).
        max_retries: the client's retries of a request after a connection error, a timeout or a 408/409/429/5xx
            answer (its backoff); other errors fail the row at once.
        max_concurrency: requests in flight at once.
        extra_body: extra JSON fields sent with every request (server extensions).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        tokenizer: Any,
        *,
        api_key: str | None = None,
        max_context: int = 8192,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        max_concurrency: int = 8,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        self.url = base_url.rstrip("/") + "/completions"
        self.model = model
        self._tokenizer = tokenizer
        self._max_context = max_context
        self.max_retries = max_retries
        self.max_concurrency = max_concurrency
        self.extra_body = dict(extra_body or {})
        if not timeout_s > 0 or not math.isfinite(timeout_s) or max_retries < 0:
            raise ValueError(f"need a finite timeout_s > 0 and max_retries >= 0, got {timeout_s} and {max_retries}")
        self.timeout_s = timeout_s
        openai = _openai()
        api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self._client = openai.OpenAI(
            base_url=base_url.rstrip("/"),
            # the client needs a key; a server started without one ignores it (vLLM's docs send "EMPTY")
            api_key=api_key or "EMPTY",
            timeout=timeout_s,
            max_retries=max_retries,
            http_client=httpx.Client(transport=_DeadlineTransport(timeout_s)),
        )

    def close(self) -> None:
        """Close the client and its connections."""
        self._client.close()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """Sample one completion per prompt; a failing request becomes that row's error completion.

        Args:
            prompts: token-id lists, one per row.
            params: sampling parameters; with a seed, row i is sent seed + i (so equal prompts differ), or
                ``row_seeds[i]`` when given.

        Returns:
            One `Completion` per prompt, in order.
        """
        if not prompts:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(prompts))) as pool:
            return list(pool.map(lambda item: self._one(item[0], item[1], params), enumerate(prompts)))

    def _one(self, index: int, prompt: Sequence[int], params: SamplingParams) -> Completion:
        try:
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError("empty prompt: nothing to condition on")
            ids = ids[overflow(len(ids), params.max_new_tokens, self.max_context) :]
            optional: dict[str, Any] = {}
            if params.stop:
                optional["stop"] = list(params.stop)
            if params.row_seeds is not None:
                optional["seed"] = int(params.row_seeds[index])
            elif params.seed is not None:
                optional["seed"] = params.seed + index
            reply = self._client.completions.create(
                model=self.model,
                prompt=self._tokenizer.decode(ids, skip_special_tokens=False),
                max_tokens=min(params.max_new_tokens, self.max_context - len(ids)),
                temperature=params.temperature,
                top_p=params.top_p,
                logprobs=1,
                extra_body=self.extra_body or None,
                **optional,
            )
            # as the server sent it, with the fields the client does not know (vLLM's stop_reason)
            return self._parse(reply.choices[0].model_dump(exclude_unset=True), params)
        except Exception as err:  # a failing row must not fail the batch
            cause = f" ({type(err.__cause__).__name__}: {err.__cause__})" if err.__cause__ is not None else ""
            return Completion("", (), (), "error", f"{type(err).__name__}: {err}{cause}")

    def _parse(self, choice: Mapping[str, Any], params: SamplingParams) -> Completion:
        text = choice.get("text") or ""
        reason = "length" if choice.get("finish_reason") == "length" else "stop"
        if reason == "stop" and params.stop:
            text = _restore_stop(text, params.stop, choice.get("stop_reason", ...))
        text, _ = cut_at_stop(text, params.stop)
        logprobs = choice.get("logprobs") or {}
        server_tokens = list(logprobs.get("tokens") or [])
        server_logps = [math.nan if x is None else float(x) for x in logprobs.get("token_logprobs") or []]
        matches = [_TOKEN_ID.fullmatch(t) for t in server_tokens]
        if server_tokens and all(matches) and len(server_logps) == len(matches):
            token_ids = tuple(int(m.group(1)) for m in matches)  # type: ignore[union-attr]
            return Completion(text, token_ids, tuple(server_logps), reason)
        token_ids = tuple(self._tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(server_logps) != len(token_ids):
            server_logps = [math.nan] * len(token_ids)
        return Completion(text, token_ids, tuple(server_logps), reason)


def _restore_stop(text: str, stop: Sequence[str], stop_reason: Any) -> str:
    """Put back the stop string that an OpenAI-style server removed from the end of `text`.

    Args:
        text: the completion as the server sent it.
        stop: the stop strings of the request.
        stop_reason: vLLM's `stop_reason` (the matched string, a token id or None for an end-of-turn
            token), or Ellipsis when the server sends no such field.
    """
    if any(text.endswith(s) for s in stop if s):
        return text
    if isinstance(stop_reason, str):
        return text + stop_reason if stop_reason in stop else text
    if stop_reason is not ...:
        return text  # ended on a token, not on a stop string
    open_at = {s: text.rfind("<" + s[2:]) for s in stop if s.startswith("</")}
    open_at = {s: at for s, at in open_at.items() if at > text.rfind(s)}
    return text + max(open_at, key=open_at.__getitem__) if open_at else text
