-- The response cache's statements (sql/cache.sql has the functions; see
-- src/llmquota/store/response_cache.py), as named blocks.

-- cache_serve --
-- Serve a request from the cache (exact key, else nearest of its context) and
-- write the hit's ledger row (and a priced hit's charges, $13 the key that
-- asked, $14 the request's reservation when admitted first); no row: a miss.
SELECT * FROM lq_cache_serve($1::text, $2::text, $3::text, $4::text, $5::bytea, $6::bytea,
                             $7::real[], $8::bigint, $9::integer, $10::double precision,
                             $11::numeric, $12::integer, $13::bigint, $14::uuid)

-- cache_store --
-- Keep an answer, within its namespace's max_entries: how many entries went.
SELECT lq_cache_store($1::text, $2::text, $3::text, $4::text, $5::bytea, $6::bytea,
                      $7::real[], $8::bigint, $9::bytea, $10::bigint, $11::bigint,
                      $12::integer, $13::integer) AS removed

-- cache_sweep --
-- Delete up to $1 expired cache entries: how many.
SELECT lq_cache_sweep($1::integer) AS removed
