-- The headers and trailers a call's handler set, replayed with its result.
-- NULL when it set none. (completed_at is no longer written: since this
-- version a key's row is written once, when its call finishes, so
-- created_at is that moment.)
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS metadata bytea;
