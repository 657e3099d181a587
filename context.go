package idempotency

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// Accessors for the idempotent call running in a context: the server side
// of a call (a gRPC handler, a message handler), never the client side. The
// client side chooses a key with [WithOutgoingKey].

// runningCallKey keys the *callTx of the call running in a context: its
// transaction, and through its attempt the call's scope and key, and the
// key as stored (with its transport's namespace: what downstream keys
// derive from, so that a gRPC call, an HTTP request and a message with the
// same key never share them).
type runningCallKey struct{}

// withCall returns ctx carrying the running call of tx, whose downstream
// counters are new for each run.
func withCall(ctx context.Context, tx *callTx) context.Context {
	return context.WithValue(ctx, runningCallKey{}, tx)
}

// callFrom returns the call running in ctx.
func callFrom(ctx context.Context) (*callTx, bool) {
	t, ok := ctx.Value(runningCallKey{}).(*callTx)
	return t, ok
}

// TxFromContext returns the transaction of the idempotent call running in
// ctx. Handlers write through it so their business changes commit together
// with the stored response. The transaction's Commit and Rollback return
// [ErrTxOwned]; nested transactions (savepoints) work as usual. It also has
// a method Config() *pgxpool.Config, the pool's configuration, so that a
// library that reads the connection's settings gets them without taking
// the connection (Conn, which costs it): River's InsertTx works on it as
// it is.
func TxFromContext(ctx context.Context) (pgx.Tx, bool) {
	t, ok := callFrom(ctx)
	if !ok {
		return nil, false
	}
	return t, true
}

// MustTxFromContext is [TxFromContext] for code that only runs inside an
// idempotent call. It panics when ctx has no transaction: the call is not
// protected (no key, or the interceptor is missing) and writing outside the
// transaction would break the exactly-once guarantee.
func MustTxFromContext(ctx context.Context) pgx.Tx {
	tx, ok := TxFromContext(ctx)
	if !ok {
		panic("idempotency: no idempotent call in context: is the interceptor installed and did the call carry a key?")
	}
	return tx
}

// IncomingKey returns the idempotency key of the call running in ctx
// (the key the client sent, or the message's ID), on the server side. A
// handler that calls another system (a payment provider, another service)
// cannot take that system's effect into its transaction; the key it sends
// there is best derived from this one ([EffectKey], which the client
// interceptor, [HTTPTransport] and [HTTPClient] send for a call named with
// [WithEffect]), so that a re-run sends the same key and the other system
// deduplicates too.
//
// It does not read keys set for outgoing calls with [WithOutgoingKey].
func IncomingKey(ctx context.Context) (string, bool) {
	t, ok := callFrom(ctx)
	if !ok {
		return "", false
	}
	return t.attempt.call.Key, true
}

// IncomingScope returns the scope of the call running in ctx, as its
// transport set it (WithScope, WithHTTPScope, a consumer's scope): what a
// job enqueued by the call needs to record its work under the call's
// scope, with [KeyedStep].
func IncomingScope(ctx context.Context) (string, bool) {
	t, ok := callFrom(ctx)
	if !ok {
		return "", false
	}
	return t.attempt.call.Scope, true
}
