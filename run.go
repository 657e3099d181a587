package idempotency

import (
	"context"

	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// handled is what fn did.
type handled struct {
	resp proto.Message
	err  error
	// refused names what the engine refused fn (a COMMIT sent through tx,
	// rows left open); "" when nothing.
	refused string
}

// run runs fn on the call's transaction, which is dead once fn returns.
func (a *attempt) run(ctx context.Context, fn Func) handled {
	htx := &callTx{conn: a.conn, attempt: a}
	a.ran = true
	start := a.tp.trace.now()
	var h handled
	func() {
		defer func() {
			p := recover()
			// Closed as soon as fn returns (or panics): a goroutine fn left
			// behind must not write into what follows.
			htx.close()
			if p != nil {
				a.settlePanic(ctx)
				panic(p) // from here, so that the panic's trace shows fn's frames
			}
		}()
		h.resp, h.err = fn(withCall(ctx, htx), htx)
	}()
	a.tp.trace.since(phaseHandler, start)
	h.refused = htx.refusal()
	return h
}

// settlePanic ends a call whose fn panicked: its writes roll back and the
// key is released, as for an error, unless fn committed the claim (it
// ended the call's transaction itself), or had the connection and lost it:
// then the key keeps an error and fn never runs again. The panic then goes
// on.
func (a *attempt) settlePanic(ctx context.Context) {
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), a.s.opts.finishTimeout)
	defer cancel()
	if a.conn.IsClosed() {
		_, _, _ = a.lost(ctx, fctx, handled{})
		return
	}
	_, _, _ = a.release(fctx)
}

// Messages of the errors stored for what a handler must not do.
const (
	errHandlerEndedTx = "idempotency: the handler ended the call's transaction itself (a COMMIT or ROLLBACK sent to PostgreSQL, " +
		"on tx.Conn() or through tx), so its writes may have been committed without the call's result; " +
		"the key is kept with this error so that the call does not run again. Handlers must not end the transaction"
	errAbandoned = "idempotency: a previous attempt's handler ended the call's transaction itself (a COMMIT sent to PostgreSQL, " +
		"on tx.Conn() or through tx), which committed the claim of the key with whatever it had written, without a result. " +
		"The key is kept with this error so that the call never runs again: inspect the handler's effects, then forget the key " +
		"(Store.Forget, or the idempotency command's forget) if it must run again"
	errLostRawConn = "idempotency: the connection closed after the handler used tx.Conn(), so its writes may have been committed " +
		"without the key; the key is kept with this error so that the call does not run again"
	errIgnoredFailure = "idempotency: the handler returned success, but one of its statements had failed and aborted the call's transaction, " +
		"so none of its writes could be committed; the key is kept with this error so that the call does not run again. " +
		"Return the statement's error (or roll back a nested transaction of tx) instead"
	errStatementsVanished = "idempotency: the connection's prepared statements vanished while the handler ran (a DEALLOCATE, " +
		"perhaps in a function or a DO block), so the call's result could not be written; nothing was committed, and the key is kept " +
		"with this error so that the call does not run again. Handlers must not deallocate the connection's prepared statements"
)

// abandonedStatus is errAbandoned as stored: the status abandon writes over
// a committed claim.
var abandonedStatus = func() []byte {
	b, err := marshalStatus(grpcstatus.New(codes.Internal, errAbandoned))
	if err != nil {
		panic(err)
	}
	return b
}()
