"""Counting input tokens off the event loop, fairly between tenants.

A megabyte of prompt takes a few hundred milliseconds of CPU to count. On
the event loop that time is stolen from every other request of the worker
(and once made healthy databases look down). So text above a small size is
counted on a thread pool (tiktoken releases the GIL while it encodes), each
count has a CPU budget past which the rest is bounded instead of encoded,
and each tenant counts one request at a time per worker: a tenant flooding
big prompts waits behind its own, while another tenant's count takes the
next free thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Unpack

from llmquota.config import Settings
from llmquota.domain.admit_request import (
    AdmitArguments,
    prepare_admit_request,
    request_hash_key,
)
from llmquota.domain.records import AdmitRequest
from llmquota.domain.tokens import TokenCountError, message_chars


class TokenCounter:
    """Prepares admission requests, counting big ones on a thread pool."""

    def __init__(
        self, settings: Settings, server_key: Callable[[], bytes | None] = lambda: None
    ) -> None:
        # The server's key as loaded from the database (None until it is):
        # idempotent requests' digests are keyed by what it derives.
        self._server_key = server_key
        self._keyed_from: bytes | None = None
        self._hash_key: bytes | None = None
        self._estimate_factors = settings.estimate_factors
        self._cpu_seconds = settings.token_count_cpu_budget_ms / 1000.0
        self._inline_chars = settings.token_count_inline_chars
        self._pool = ThreadPoolExecutor(
            max_workers=settings.token_count_workers, thread_name_prefix="llmquota-count"
        )
        # Per tenant: (its turn, how many hold or wait for it); dropped when idle.
        self._turns: dict[str, tuple[asyncio.Lock, int]] = {}

    def prepare(self, **request: Unpack[AdmitArguments]) -> AdmitRequest:
        """Validate and count here and now (small requests, and callers without a loop)."""
        return prepare_admit_request(
            estimate_factors=self._estimate_factors,
            count_cpu_seconds=self._cpu_seconds,
            request_hash_key=self._request_hash_key(),
            **request,
        )

    def _request_hash_key(self) -> bytes | None:
        server_key = self._server_key()
        if server_key is not self._keyed_from:
            self._keyed_from = server_key
            self._hash_key = None if server_key is None else request_hash_key(server_key)
        return self._hash_key

    def inline(self, request: AdmitArguments) -> bool:
        """Whether `request` is counted here and now (prepare), not on the pool."""
        return not _large(request.get("messages"), self._inline_chars)

    async def prepare_off_loop(self, **request: Unpack[AdmitArguments]) -> AdmitRequest:
        """Validate and count; text over the inline size is counted on the pool."""
        if self.inline(request):
            return self.prepare(**request)
        job = functools.partial(self.prepare, **request)
        async with self._turn(str(request.get("tenant"))):
            return await asyncio.get_running_loop().run_in_executor(self._pool, job)

    @contextlib.asynccontextmanager
    async def _turn(self, tenant: str) -> AsyncIterator[None]:
        """One count of `tenant` at a time on this worker."""
        lock, users = self._turns.get(tenant, (asyncio.Lock(), 0))
        self._turns[tenant] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._turns[tenant]
            if users == 1:
                del self._turns[tenant]
            else:
                self._turns[tenant] = (lock, users - 1)

    def close(self) -> None:
        """Stop the pool; counts in progress finish, queued ones are dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _large(messages: Sequence[Mapping[str, Any]] | None, inline_chars: int) -> bool:
    """Whether counting `messages` is worth a trip to the pool."""
    if messages is None:
        return False  # input_tokens given: nothing to count
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        return False  # nothing to count, or a shape prepare() refuses at once
    try:
        return message_chars(messages) > inline_chars
    except TokenCountError:
        return False  # prepare() refuses it at once, with the reason
