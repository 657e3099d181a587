\set r random(1, 9000000000000000000)
\startpipeline
BEGIN;
SELECT pg_try_advisory_xact_lock(hashtextextended('key-' || :client_id || '-' || :r, hashtextextended('', 'keys_lib'::regclass::oid::bigint))), now(), current_setting('transaction_isolation') IN ('repeatable read', 'serializable'), current_setting('transaction_read_only')::bool;
SELECT method, fingerprint, state, response_type, response, status, metadata, expires_at <= now() FROM keys_lib WHERE scope = '' AND key = 'key-' || :client_id || '-' || :r;
SAVEPOINT idempotency_call;
\endpipeline
INSERT INTO ledger (amount) VALUES (100);
\startpipeline
INSERT INTO keys_lib (scope, key, method, fingerprint, state, response_type, response, status, metadata, created_at, expires_at) SELECT '', 'key-' || :client_id || '-' || :r, '/bench.v1.Bench/Required', '\x0102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f20', 'succeeded', 'google.protobuf.BytesValue', decode(repeat('ab', 256), 'hex'), NULL, NULL, c.t, c.t + 86400000000 * interval '1 microsecond' FROM (SELECT clock_timestamp() AS t) c WHERE 1 / (now() = now())::int = 1;
COMMIT;
\endpipeline
