-- One row per idempotency key. A row only ever becomes visible to other
-- transactions together with the business writes of the call that claimed it,
-- so a committed row is always finished ('succeeded' or 'failed'). ('running'
-- was written by the first engine, and seen only inside the claiming
-- transaction.)
{{create_schema}}CREATE TABLE IF NOT EXISTS {{table}} (
    scope         text        NOT NULL,
    key           text        NOT NULL,
    method        text        NOT NULL,
    fingerprint   bytea       NOT NULL,
    state         text        NOT NULL CHECK (state IN ('running', 'succeeded', 'failed')),
    response_type text,
    response      bytea,
    status        bytea,
    created_at    timestamptz NOT NULL DEFAULT now(),
    completed_at  timestamptz,
    expires_at    timestamptz NOT NULL,
    PRIMARY KEY (scope, key)
);

-- Lets the expiry cleaner find old keys without scanning the table.
CREATE INDEX IF NOT EXISTS {{expires_index}} ON {{table}} (expires_at);
