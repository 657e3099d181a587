package idempotency

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// Accessors for the idempotent call running in a context: the server side
// of a call (a gRPC handler, a message handler), never the client side. The
// client side chooses a key with [WithOutgoingKey].

// runningCall is what a context holds of the call running in it.
type runningCall struct {
	tx         pgx.Tx
	scope, key string
	// stored is the key as stored, with its transport's namespace: what
	// downstream keys derive from, so that a gRPC call, an HTTP request and
	// a message with the same key never share them.
	stored     string
	downstream *downstreamCalls // per run of the handler: a re-run counts from 0
}

type runningCallKey struct{}

// withCall returns ctx carrying the transaction, scope and key (as the
// client sent it, and as stored) of a running call, and the counters of
// its downstream calls, new for each run.
func withCall(ctx context.Context, tx pgx.Tx, scope, key, stored string, downstream *downstreamCalls) context.Context {
	return context.WithValue(ctx, runningCallKey{}, runningCall{tx: tx, scope: scope, key: key, stored: stored, downstream: downstream})
}

// TxFromContext returns the transaction of the idempotent call running in
// ctx. Handlers write through it so their business changes commit together
// with the stored response. The transaction's Commit and Rollback return
// [ErrTxOwned]; nested transactions (savepoints) work as usual.
func TxFromContext(ctx context.Context) (pgx.Tx, bool) {
	c, ok := ctx.Value(runningCallKey{}).(runningCall)
	return c.tx, ok
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

// CallKeyFromContext returns the idempotency key of the call running in ctx
// (the key the client sent, or the message's ID), on the server side. A
// handler that calls another system (a payment provider, another service)
// cannot take that system's effect into its transaction; the key it sends
// there is best derived from this one ([DownstreamKey], which the client
// interceptor and [HTTPTransport] use), so that a re-run sends the same key and
// the other system deduplicates too.
//
// It does not read keys set for outgoing calls with [WithOutgoingKey].
func CallKeyFromContext(ctx context.Context) (string, bool) {
	c, ok := ctx.Value(runningCallKey{}).(runningCall)
	return c.key, ok
}
