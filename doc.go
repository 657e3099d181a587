// Package idempotency makes non-idempotent calls safe to retry: gRPC calls,
// HTTP requests, and messages of at-least-once streams.
//
// # The guarantee
//
// Whatever a client sends (retry markers, headers) and whatever a handler
// does, a key that has a stored result never runs its handler again, and
// every caller of one key gets the same answer.
//
// For every idempotency key, the handler's database writes commit if and
// only if the key and the handler's result commit with them, in one
// PostgreSQL transaction. So a key never exists without its result, a
// result never exists without its key, and a crash at any point before the
// commit leaves nothing behind: the client's retry runs the call at once, as
// if it were the first. After the commit, every retry with the same key gets
// the stored result instead of running the handler again.
//
// This holds across restarts and across any number of replicas sharing the
// database, and whatever the handler does to its transaction: the call's
// transaction begins with the claim, the key's row inserted behind its
// advisory lock, and the table's primary key (scope, key) decides, never a
// check first and an insert later. docs/guarantee.md in the repository says
// how the database keeps it, and what a fresh call costs.
//
// # Server
//
// Create a [Store] on a pgx pool, migrate it once, and install
// [UnaryServerInterceptor]. Handlers write through the call's transaction,
// which they get from [TxFromContext]:
//
//	store, err := idempotency.NewStore(pool, idempotency.WithTracer(idempotency.LogTracer(slog.Default())))
//	...
//	err = store.Migrate(ctx)
//	...
//	go store.RunCleaner(ctx, time.Minute, 1000, nil)
//	...
//	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
//		idempotency.UnaryServerInterceptor(store, idempotency.WithScope(callerID)),
//	))
//
//	func (s *server) Charge(ctx context.Context, req *pb.ChargeRequest) (*pb.ChargeResponse, error) {
//		tx := idempotency.MustTxFromContext(ctx)
//		_, err := tx.Exec(ctx, `INSERT INTO ledger ...`)
//		...
//	}
//
// A handler's error rolls its writes back. An error whose code says the
// request was decided (NotFound, FailedPrecondition, ...:
// [DefaultFinalCodes], changed with [WithFinalCodes]) is final: it is
// stored with the key and replayed. Any other error releases the key, so a
// retry runs again; InvalidArgument is not in DefaultFinalCodes and
// releases the key too, so that the corrected request can reuse it.
//
// The transaction belongs to the call: a handler must not end it. SQL sent
// through it that would (COMMIT, ROLLBACK, BEGIN, SET TRANSACTION) is
// refused with an error wrapping [ErrTxOwned], and the call then fails with
// codes.Internal, stored, so that it never runs again; so does a call whose
// handler ends the transaction on tx.Conn(), returns success after one of
// its statements failed, or leaves a query's rows open. The refusal only
// makes the error clearer: what gets past it (a COMMIT in a disguise the
// check does not read) is caught by the claim all the same. Nested
// transactions (tx.Begin) are savepoints and work as usual, and so do the
// handler's own savepoints, under any name. What a handler
// leaves in its session past the transaction (settings and role, temporary
// tables, session advisory locks, statements prepared with PREPARE, cursors
// WITH HOLD, sequences' current values, LISTEN), however it set it, is
// reset on every outcome in the round trip that ends the call, behind a
// transaction pooler too, so that no later call inherits it; SET LOCAL and
// set_config(..., true) cost nothing. A handler that uses tx.Conn() costs its connection: it is closed
// after the call rather than returned to the pool.
//
// The transaction runs at the database's default isolation level, or at
// the one chosen with [WithIsolation], [Call.Isolation], the isolation field
// of the method's proto option or [WithHTTPIsolation]. Every guarantee holds
// at every level. At REPEATABLE READ and SERIALIZABLE a key committed after
// the transaction's snapshot was taken makes the claim fail with a
// serialization failure, and the engine claims again; the engine's reads
// and writes of the key table read no index page inside the call's
// transaction, so SERIALIZABLE never fails a call for another key's sake. A
// serialization failure or deadlock of the handler's work is returned as
// codes.Aborted: nothing committed, retry with the same key. A final error
// is committed in the call's transaction too, whose reads PostgreSQL
// counts even once rolled back to a savepoint: one decided on reads that
// do not serialize is answered the same way, nothing stored.
//
// Which methods need a key is written in the .proto files: the
// (idempotency.v1.method) option of proto/idempotency/v1/idempotency.proto,
// and protobuf's own idempotency_level (NO_SIDE_EFFECTS and IDEMPOTENT
// methods need none).
//
// # Calling other systems
//
// A call that runs under a key (a gRPC call through [UnaryServerInterceptor],
// a request through [HTTPMiddleware], a message through
// [Store.ProcessMessage], any [Store.Execute]) may call other systems: a
// payment provider, another service. Their effects cannot join the call's
// transaction, so when the call runs again (its process died before the
// commit, or a transient error released its key) they would happen again,
// unless the second run sends them the keys the first run sent. A derived
// key is that key: a function of the operation the running call is (its
// store, scope, key with its transport, method and request) and of the
// downstream effect. Two operations never derive the same keys (two
// services receiving one client key, a corrected request sent again under
// a released key); a re-run of one operation derives the same ones.
//
// An outgoing call's key is, in order:
//
//   - explicit: [WithOutgoingKey], or the key already in the metadata or
//     the header;
//   - named: inside a running call, the key [EffectKey] gives for the
//     name of [WithEffect]. One name, one key: the same on every run,
//     whatever else the handler calls, in whatever order, concurrently or
//     not, and across the handler's own retries of that effect;
//   - outside a running call, [UnaryClientInterceptor] and [HTTPClient]
//     generate one per logical call and keep it across that call's
//     retries; [HTTPTransport] sends none.
//
// Inside a running call, a call that needs a key (a POST or PATCH, a gRPC
// method that protobuf does not mark NO_SIDE_EFFECTS or IDEMPOTENT) and
// has neither a key nor a name is refused with [ErrUnnamedEffect], nothing
// sent: no key counted by call order is given silently, since a re-run
// that makes its calls otherwise (one only on some runs, concurrently, or
// a retry with a new request) would send it for another operation. Name
// every effect ("charge " + orderID). A call made with the context of a
// call that has ended (a goroutine the handler left running) is refused
// with [ErrCallEnded].
//
// The other way is an outbox: the handler writes the effect as a job in the
// call's transaction (the job exists if and only if the call committed),
// and a worker performs it under a key stored in the job, for example one
// from [EffectKey]; the worker's retries send that key again. River's
// InsertTx works on the call's transaction as it is (see [TxFromContext]).
//
// # Client
//
// [UnaryClientInterceptor] gives each logical call one key (a UUIDv7, or one
// chosen with [WithOutgoingKey]) and retries it under that key, with
// go-grpc-middleware's retry interceptor inside it, for up to 30 seconds:
//
//	conn, err := grpc.NewClient(target,
//		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor()))
//
// A client with retries of its own makes it the key alone with
// [WithMaxAttempts](1), and runs them below it.
//
// # Outcomes
//
// What a client can see:
//
//   - a retry of a finished call: the stored response (or stored final
//     error), with the trailer "idempotency-replayed: true" and no detail of
//     this package;
//   - the key is held by a call still running: codes.Aborted with RetryInfo
//     ([ErrInProgress]);
//   - the key was used for another request or method:
//     codes.FailedPrecondition with PreconditionFailure ([ErrKeyReused]);
//   - the key is malformed, sent twice, or required and missing:
//     codes.InvalidArgument with BadRequest ([ErrInvalidKey], [ErrMissingKey]);
//   - the database is unreachable or failing: codes.Unavailable
//     ([ErrStoreUnavailable]); a retry with the same key is safe.
//
// Each error of this package (not the replays, not a handler's own errors)
// carries a google.rpc.ErrorInfo detail whose domain is [ErrorDomain];
// clients read it with [IsInProgress], [IsKeyReused] and [RetryDelay].
//
// # HTTP
//
// [HTTPMiddleware] is the same engine for net/http, keyed by the
// Idempotency-Key header of the IETF draft: a replay returns the first
// response's status, body and body headers; 409 while the key's request
// runs, 422 when the key was used for another request. Handlers reach the
// transaction with TxFromContext(r.Context()).
//
// # Other RPC frameworks
//
// The package github.com/exactlyonce/idempotency/unary lends the engine
// UnaryServerInterceptor runs on, and the client's key and retries, to
// the adapters of other RPC frameworks' unary calls: the module
// github.com/exactlyonce/idempotency/idempotencyconnect runs connect-go's
// interceptors on it, so that a key sent through connect's protocols or
// to a grpc-go server on the same store and scope is one call.
//
// # Message consumers
//
// [Store.ProcessMessage] is the same engine for at-least-once streams (NATS
// JetStream, Kafka): it applies a message's effect once per message ID, in
// the transaction that records the ID, and returns the [Outcome]
// (executed, or replayed for a duplicate), and [DispositionOf] says
// whether to acknowledge, redeliver or dead-letter the message. The module
// github.com/exactlyonce/idempotency/idempotencykafka is a ready consumer
// for Kafka on franz-go. [Store.Execute] is the engine itself, for any
// other transport.
//
// # Operations
//
// A [Tracer] set with [WithTracer] sees every call of every transport and
// every cleaner batch, for metrics, traces and logs: [LogTracer] logs a
// line per call to a log/slog logger, and the module
// github.com/exactlyonce/idempotency/idempotencyotel reports them to
// OpenTelemetry. [Store.RunCleaner] deletes expired keys. [Store.Inspect],
// [Store.List] and [Store.Forget] look at keys and remove one, and
// cmd/idempotency does the same from a shell, applies the migrations or
// prints them ([Migrations]) for golang-migrate, goose or Atlas.
//
// Behind PgBouncer in transaction pooling, pgx's default query mode,
// cache_statement, needs a pooler that carries prepared statements
// (PgBouncer 1.21 or later with max_prepared_statements); describe_exec
// never works there, and a store refuses it when it sees a pooler; use
// default_query_exec_mode=cache_describe or exec.
//
// # Options
//
// Each constructor takes its own option type: [StoreOption] for [NewStore],
// [ServerOption] for [UnaryServerInterceptor], [ClientOption] for
// [UnaryClientInterceptor], [HTTPOption] for [HTTPMiddleware]. An invalid
// option makes NewStore return an error and the interceptor constructors
// panic, each message naming the option.
package idempotency
