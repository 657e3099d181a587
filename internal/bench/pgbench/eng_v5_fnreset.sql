\set r random(1, 9000000000000000000)
\startpipeline
BEGIN;
INSERT INTO keys_lib (scope, key, method, fingerprint, state, created_at, expires_at) SELECT '', 'key-' || :client_id || '-' || :r, '/bench.v1.Bench/Required', '\x0102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f20', 'running', t.now, t.now + 86400000000 * interval '1 microsecond' FROM (SELECT clock_timestamp() AS now) t WHERE pg_try_advisory_lock(hashtextextended('key-' || :client_id || '-' || :r, hashtextextended('', 'keys_lib'::regclass::oid::bigint))) AND pg_try_advisory_xact_lock(hashtextextended('key-' || :client_id || '-' || :r, hashtextextended('', 'keys_lib'::regclass::oid::bigint))) ON CONFLICT (scope, key) DO NOTHING RETURNING ctid, current_setting('transaction_isolation') IN ('repeatable read', 'serializable'), txid_current(), pg_backend_pid(), (extract(epoch FROM now()) * 1000000)::bigint;
SAVEPOINT idempotency_claim_0123456789abcdef;
\endpipeline
INSERT INTO ledger (amount) VALUES (100);
\startpipeline
WITH u AS (UPDATE keys_lib SET state = 'succeeded', response_type = 'google.protobuf.BytesValue', response = decode(repeat('ab', 256), 'hex'), status = NULL, metadata = NULL, completed_at = clock_timestamp() WHERE scope = '' AND key = 'key-' || :client_id || '-' || :r AND xmin = pg_current_xact_id()::xid RETURNING pg_advisory_unlock(hashtextextended('key-' || :client_id || '-' || :r, hashtextextended('', 'keys_lib'::regclass::oid::bigint)))) SELECT 1 / count(*)::int, pg_advisory_unlock_all() IS NULL, EXISTS (SELECT FROM pg_prepared_statements WHERE from_sql) FROM u;
COMMIT;
SELECT idempotency_bench.reset_session();
\endpipeline
