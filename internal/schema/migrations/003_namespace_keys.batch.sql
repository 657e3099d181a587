-- 003_namespace_keys.up.sql, one batch at a time, for Store.Migrate: the
-- same rows moved to the same keys, by the same tests, in transactions short
-- enough to run while calls go on. A batch is the $3 rows after ($1, $2)
-- in the order of the primary key (keys are never empty, so ('', '') comes
-- before every row); it returns the last of them, where the next batch
-- starts, and no row once none is left. A row it moved has a space in its
-- key and is never moved again, so a walk cut anywhere is simply started
-- over. The two UPDATEs of the up file are one here: a row is a message's
-- or an HTTP request's, never both, and no two rows move to one key. The
-- rows are found by their addresses, read with the batch (a join on the
-- key would have the planner scan the whole table for every batch), and
-- the tests are in the UPDATE's own WHERE, so that a row another
-- transaction changed meanwhile is tested again as it is now.
WITH batch AS MATERIALIZED (
    SELECT ctid, scope, key FROM {{table}}
    WHERE (scope, key) > ($1::text, $2::text)
    ORDER BY scope, key
    LIMIT $3::int
), moved AS (
    UPDATE {{table}} k SET key = CASE WHEN k.method = 'idempotency/message' THEN 'message ' ELSE 'http ' END || k.key
    WHERE k.ctid = ANY (ARRAY(SELECT ctid FROM batch)) AND k.key NOT LIKE '% %'
    AND (k.method = 'idempotency/message'
      OR (k.method ~ '^[!#$%&''*+.^_`|~0-9A-Za-z-]+ /'
        AND ((k.response_type = 'google.protobuf.BytesValue' AND substring(k.metadata FROM 1 FOR 1) = '\x08'::bytea)
          OR (k.state = 'failed' AND k.response IS NULL AND k.metadata IS NULL))))
    AND NOT EXISTS (SELECT 1 FROM {{table}} o WHERE o.scope = k.scope
      AND o.key = CASE WHEN k.method = 'idempotency/message' THEN 'message ' ELSE 'http ' END || k.key)
)
SELECT scope, key FROM batch ORDER BY scope DESC, key DESC LIMIT 1
