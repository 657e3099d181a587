// Package idempotency makes non-idempotent gRPC calls safe to retry.
//
// # The guarantee
//
// For every idempotency key, the handler's database writes commit if and
// only if the key and the handler's result commit with them, in one
// PostgreSQL transaction. So a key never exists without its result, a
// result never exists without its key, and a crash at any point before the
// commit leaves nothing behind: the client's retry runs the call at once, as
// if it were the first. After the commit, every retry with the same key gets
// the stored response instead of running the handler again.
//
// This holds across restarts and across any number of replicas sharing the
// database, because the only state is the key table: a key is claimed with
// INSERT ... ON CONFLICT DO NOTHING under the table's primary key
// (scope, key), never by checking first and inserting later.
//
// # Server
//
// Create a [Store] on a pgx pool, migrate it once, and install
// [UnaryServerInterceptor]. Handlers write through the call's transaction,
// which they get from [TxFromContext]:
//
//	store, err := idempotency.NewStore(pool)
//	...
//	err = store.Migrate(ctx)
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
// A handler that calls another system (a payment provider, another
// service) cannot take that system's effect into the transaction: it must
// pass the same key downstream so that the other system deduplicates too.
//
// # Outcomes
//
// The status codes a client can see from this package; each of these
// carries a google.rpc.ErrorInfo detail whose domain is [ErrorDomain]:
//
//   - a retry of a finished call: the stored response (or stored error),
//     with the trailer "idempotency-replayed: true";
//   - the key is held by a call still running: codes.Aborted with RetryInfo
//     ([ErrInProgress]);
//   - the key was used for another request or method:
//     codes.FailedPrecondition with PreconditionFailure ([ErrKeyReused]);
//   - the key is malformed, sent twice, or required and missing:
//     codes.InvalidArgument with BadRequest ([ErrInvalidKey], [ErrMissingKey]);
//   - the database is unreachable or failing: codes.Unavailable
//     ([ErrStoreUnavailable]); a retry with the same key is safe.
//
// # Without gRPC
//
// [Store.Execute] is the engine under the interceptor and works for any
// transport, such as at-least-once message consumers deduplicating by
// message ID.
package idempotency
