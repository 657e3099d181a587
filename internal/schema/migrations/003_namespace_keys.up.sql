-- Since this version the keys of HTTP requests and the IDs of messages are
-- stored in namespaces of their own, 'http ' and 'message ' before the key
-- (a key has no spaces), so that no client's key can ever take another
-- transport's: an HTTP key cannot squat the ID of a message yet to come.
-- gRPC calls and Store.Execute keep theirs as it is. This moves the rows
-- written before into their namespaces, so that they still replay.
--
-- A message's row has the method 'idempotency/message'. An HTTP request's
-- has a method of an HTTP method and a path ('POST /v1/charges'), which no
-- gRPC method has (they start with '/'), and either the stored response
-- (its body as a google.protobuf.BytesValue, its status and headers as
-- metadata whose first byte is the status's tag) or, for an error the
-- engine stored (the handler ended the transaction), neither response nor
-- metadata. A Store.Execute call given such a method and a final error
-- with no response would be taken for one. A row whose new key is taken
-- already (left by a downgrade and an upgrade) stays where it is and
-- expires.
UPDATE {{table}} k SET key = 'message ' || k.key
WHERE k.method = 'idempotency/message' AND k.key NOT LIKE '% %'
AND NOT EXISTS (SELECT 1 FROM {{table}} o WHERE o.scope = k.scope AND o.key = 'message ' || k.key);
UPDATE {{table}} k SET key = 'http ' || k.key
WHERE k.method ~ '^[!#$%&''*+.^_`|~0-9A-Za-z-]+ /' AND k.key NOT LIKE '% %'
AND ((k.response_type = 'google.protobuf.BytesValue' AND substring(k.metadata FROM 1 FOR 1) = '\x08'::bytea)
  OR (k.state = 'failed' AND k.response IS NULL AND k.metadata IS NULL))
AND NOT EXISTS (SELECT 1 FROM {{table}} o WHERE o.scope = k.scope AND o.key = 'http ' || k.key);
