-- Moves HTTP and message keys back into the shared namespace, except where
-- a key of the same name already holds it (the older version could not
-- tell them apart): those rows stay where an older version does not look,
-- and expire.
UPDATE {{table}} k SET key = substr(k.key, length('message ') + 1)
WHERE k.key LIKE 'message %'
AND NOT EXISTS (SELECT 1 FROM {{table}} o WHERE o.scope = k.scope AND o.key = substr(k.key, length('message ') + 1));
UPDATE {{table}} k SET key = substr(k.key, length('http ') + 1)
WHERE k.key LIKE 'http %'
AND NOT EXISTS (SELECT 1 FROM {{table}} o WHERE o.scope = k.scope AND o.key = substr(k.key, length('http ') + 1));
