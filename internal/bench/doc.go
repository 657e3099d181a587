// Command bench measures what the idempotency interceptor (and, beside it,
// the HTTP middleware) costs a real service on a real PostgreSQL, and where
// that cost goes.
//
//	go run ./internal/bench                        # fresh, engine, replay, contended, nokey, http: 6 rounds x 5 s per variant, about 10 minutes
//	go run ./internal/bench -short                 # a few seconds; checks only that it works
//	go run ./internal/bench -scenarios fresh,engine,replay -duration 4s
//	go run ./internal/bench -scenarios fresh -handlers payments -duration 2s -rounds 4
//	go run ./internal/bench -preload 10000000 -cleaner -scenarios preload
//
// It starts gRPC servers on loopback ports in this process, one with the
// interceptor, one without (plain) and one that writes the floor's key row
// without the interceptor, on a pgx pool to the database named by -url
// (default: DATABASE_URL, else the local test database), in a schema of its
// own that it drops at the end. It also starts a net/http server on a
// loopback port that serves the trivial handler as JSON, on one route
// through HTTPMiddleware and on another without it. Client goroutines,
// each with its own connection to each server (an http.Client with a
// transport of its own, kept alive, for HTTP), call as fast as they can
// for -duration.
//
// Two handlers do the business write (-handlers): trivial inserts one
// ledger row; payments, the shape of examples/payments, upserts the balance
// of one of -accounts accounts and inserts a charge row in one statement.
// Their variants are named bare and with "/payments".
//
// Variants (see variants.go):
//
//	fresh       every call has a new key; the handler writes in the interceptor's transaction
//	floor       no interceptor; BEGIN, the handler's write, then [INSERT the key row the engine would; COMMIT]:
//	            the physical floor of a durable key, with no lock, lookup or deduplication
//	plain       no interceptor; the same handler writes in its own BEGIN/write/COMMIT
//	engine:execute, engine:floor, engine:plain
//	            the same three without gRPC: -clients goroutines call Store.Execute, the floor
//	            or pgx.BeginFunc directly, on the same pool
//	replay      every call repeats a finished key, marked as a retry (x-retry-attempt: 1)
//	unmarked-replay  the same without the marker: the claim's transaction finds the result
//	no-db       no interceptor; a handler that touches no database
//	contended   -contended-keys groups of clients march through shared keys, so duplicates are in flight
//	no-key      calls without a key through the interceptor, to the no-database handler
//	http-fresh  POST through HTTPMiddleware, a new Idempotency-Key per call; the trivial handler
//	            writes in the request's transaction and answers JSON of about -response-bytes
//	http-plain  the same handler without the middleware, in its own pgx.BeginFunc
//	fresh-N     fresh, on a key table preloaded with -preload keys
//	fresh-N+cleaner  the same, with Store.RunCleaner deleting expired keys meanwhile
//
// Each round runs every variant of the chosen scenarios once, in a fixed
// order, so a variant and its baseline alternate (A, B, A, B, ...) and
// slow drift of the machine affects both alike. Throughput and latency are
// medians over rounds; ratios are ratios of medians, with the median and
// the range of the per-round ratios beside them. The targets use the
// medians of the per-round ratios.
//
// For every call it also reports what the database did, from two sides:
// the client side counts round trips on the pool's sockets (the ground
// truth, whatever pgx API sent them) and, with a pgx tracer, the
// statements, batches, commits and rollbacks pgx was asked for; the server
// side reads PostgreSQL's statistics: transactions committed and rolled
// back in the database, WAL bytes (pg_current_wal_lsn) and WAL fsyncs
// (pg_stat_wal), transaction IDs assigned, and dead tuples left in the key
// and business tables (pg_stat_user_tables). WAL, fsync and transaction ID
// figures are cluster-wide: any other work on the server shows up in them,
// and the report says when it saw some. Finally it runs a few calls of each
// variant one at a time and lists the round trips of one call, statement by
// statement.
//
// Exit status: 0 when every call succeeded and did what its variant says
// (each fresh call executed, as the interceptor's or the middleware's
// outcome hook reports it, each replay replayed, ...), 1 otherwise, 2 for
// bad flags. Numbers are never checked against the targets; they are
// reported. BENCHMARKS.md, at the root of the repository, describes the
// method in full, what limits each figure, and the latest results.
package main
