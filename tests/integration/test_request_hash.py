"""An idempotent request's stored digest is keyed: a guessed prompt matches nothing.

The digest tells a replay (same key, same request) from a reuse (same key,
another request). It is stored with the reservation, so a bare SHA-256 of
the messages let whoever reads the table confirm a guessed prompt. It is now
an HMAC under a key derived from the server's own key (outage_id_key), which
only the service role reads; replays still match, on any worker.
"""

from __future__ import annotations

import hashlib
import hmac
import json

import asyncpg

from llmquota.admission.limiter import Limiter
from llmquota.config import Settings
from tests.integration.support import put

MESSAGES = [{"role": "user", "content": "What is our Q3 revenue forecast?"}]


def _canonical(fields: list[object]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), default=repr).encode()


async def test_the_stored_digest_is_an_hmac_and_a_guessed_prompt_matches_no_row(
    limiter: Limiter, db: asyncpg.Connection, database_dsn: str, settings: Settings
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=100_000, token_burst=10_000)
    request = {
        "tenant": "acme",
        "model": "gpt-4o",
        "messages": MESSAGES,
        "max_tokens": 100,
        "idempotency_key": "job-1",
    }
    first = await limiter.admit(**request)  # type: ignore[arg-type]
    stored = await db.fetchval(
        "SELECT request_hash FROM reservations WHERE reservation_id = $1",
        first.reservation_id,
    )
    guessed = _canonical([None, "gpt-4o", 100, None, None, MESSAGES])
    assert stored != hashlib.sha256(guessed).hexdigest()
    server_key = await db.fetchval("SELECT key FROM outage_id_key")
    derived = hmac.new(server_key, b"llmquota request_hash v1", hashlib.sha256).digest()
    assert stored == hmac.new(derived, guessed, hashlib.sha256).hexdigest()
    # Another worker (another Limiter on the same database) replays it as the same request.
    other = await Limiter.connect(database_dsn, settings)
    try:
        again = await other.admit(**request)  # type: ignore[arg-type]
    finally:
        await other.close()
    assert again.reservation_id == first.reservation_id
    assert await db.fetchval("SELECT count(*) FROM reservations") == 1
