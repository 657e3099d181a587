-- Since this version the keys of HTTP requests and the IDs of messages are
-- stored in namespaces of their own, 'http ' and 'message ' before the key
-- (a key has no spaces), so that no client's key can ever take another
-- transport's: an HTTP key cannot squat the ID of a message yet to come.
-- gRPC calls and Store.Execute keep theirs as it is. This moves the rows
-- written before into their namespaces, so that they still replay.
UPDATE {{table}} SET key = 'message ' || key
WHERE method = 'idempotency/message' AND key NOT LIKE '% %';
UPDATE {{table}} SET key = 'http ' || key
WHERE method ~ '^[A-Z]+ /' AND response_type = 'google.protobuf.BytesValue' AND key NOT LIKE '% %';
