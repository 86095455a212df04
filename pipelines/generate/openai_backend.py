"""``backend: openai``: answers from an OpenAI-compatible server (vLLM, SGLang) that serves the target.

Chats go to ``/chat/completions`` with the conversation so far (the server applies its chat
template; ``chat_template_kwargs`` is sent as vLLM and SGLang accept it), continuations to
``/completions`` with the prompt text. At most ``max_in_flight`` requests are open at once (a
thread each; the stdlib's HTTP client, no extra dependency). A request that fails with a network
error, a timeout, 429 or 5xx is retried after ``backoff_seconds``, doubled each time; when the
retries run out the run stops (a rerun resumes), since a server that is down would otherwise
reject every record. Any other 4xx is the record's fault: a ``generation_error`` rejection.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipelines.generate.engine import BatchCallback
from pipelines.generate.manifest import GenerationError
from pipelines.generate.prompts import FINISH_LENGTH, FINISH_STOP, Answer, Request
from pipelines.generate.recipe import OpenAISection, SamplingSection

logger = logging.getLogger(__name__)

_RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class RequestRejected(Exception):
    """The server refused the request itself (a 4xx other than 429): the record is at fault."""


class OpenAIGenerator:
    """The worker's backend for an OpenAI-compatible endpoint; ``generate`` as BatchGenerator's."""

    def __init__(
        self,
        settings: OpenAISection,
        sampling: SamplingSection,
        model_name: str,
        tokenizer: Any,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.settings = settings
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.sampling = sampling
        self.model_name = settings.model or model_name
        self.tokenizer = tokenizer
        self.base_url = settings.base_url.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if settings.api_key_env:
            key = os.environ.get(settings.api_key_env)
            if not key:
                raise GenerationError(
                    f"openai.api_key_env={settings.api_key_env}, but that variable is not set"
                )
            self.headers["Authorization"] = f"Bearer {key}"
        self.pool = ThreadPoolExecutor(settings.max_in_flight, thread_name_prefix="openai")

    def generate(self, requests: Sequence[Request], on_batch: BatchCallback | None = None) -> list[Answer]:
        """Every request answered (or its error kept in the Answer); order kept."""
        futures = [self.pool.submit(self._answer, r) for r in requests]
        answers = []
        for future in futures:
            answer = future.result()
            if on_batch is not None:
                on_batch(1, answer.num_new_tokens)
            answers.append(answer)
        return answers

    def body(self, request: Request) -> tuple[str, dict[str, Any]]:
        """The endpoint and JSON body of a request."""
        sampling = self.sampling
        body: dict[str, Any] = {
            "model": self.model_name,
            "max_tokens": request.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": request.seed % (1 << 31),  # servers take a 32-bit seed
        }
        if sampling.top_k:
            body["top_k"] = sampling.top_k
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
        if request.messages is not None:
            endpoint = "/chat/completions"
            body["messages"] = [dict(m) for m in request.messages]
            if self.chat_template_kwargs:
                body["chat_template_kwargs"] = dict(self.chat_template_kwargs)
        else:
            endpoint = "/completions"
            body["prompt"] = request.prompt_text
        body.update(self.settings.extra_body)
        return endpoint, body

    def _answer(self, request: Request) -> Answer:
        endpoint, body = self.body(request)
        try:
            reply = self._post(endpoint, body)
        except RequestRejected as err:
            return Answer(text="", num_new_tokens=0, finish_reason="error", error=str(err))
        try:
            choice = reply["choices"][0]
            text = choice["message"]["content"] if request.messages is not None else choice["text"]
            finish = choice.get("finish_reason") or "stop"
        except (KeyError, IndexError, TypeError) as err:
            raise GenerationError(
                f"{self.base_url}{endpoint}: the reply is not an OpenAI completion ({err!r}): "
                f"{json.dumps(reply)[:300]}"
            ) from err
        text = text or ""
        usage = reply.get("usage") or {}
        num_new = usage.get("completion_tokens")
        if not isinstance(num_new, int):
            num_new = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return Answer(
            text=text,
            num_new_tokens=num_new,
            finish_reason=FINISH_LENGTH if finish == "length" else FINISH_STOP,
        )

    def _post(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        url = f"{self.base_url}{endpoint}"
        data = json.dumps(body).encode("utf-8")
        wait = self.settings.backoff_seconds
        for attempt in range(self.settings.max_retries + 1):
            request = urllib.request.Request(url, data=data, headers=self.headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.settings.timeout_seconds) as reply:
                    return json.loads(reply.read())
            except urllib.error.HTTPError as err:
                detail = err.read()[:300].decode("utf-8", errors="replace")
                if err.code not in _RETRY_STATUS:
                    raise RequestRejected(f"{url}: HTTP {err.code}: {detail}") from err
                problem = f"HTTP {err.code}: {detail}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as err:
                problem = f"{type(err).__name__}: {err}"
            if attempt == self.settings.max_retries:
                raise GenerationError(
                    f"{url}: failed {attempt + 1} times, last: {problem}; check the server and "
                    "rerun (committed units are kept)"
                )
            logger.warning("%s: %s; retry %d in %.1f s", url, problem, attempt + 1, wait)
            time.sleep(wait)
            wait *= 2
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
