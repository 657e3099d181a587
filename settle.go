package idempotency

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// settled is what settling a key found and did.
type settled struct {
	// rec is what the key holds once settled, nil when nothing is
	// committed for it (another session holds its lock, and its call is
	// still running).
	rec *record
	// abandoned: the key held a claim that a handler's own COMMIT made
	// durable, and the settle stored its error (errAbandoned).
	abandoned bool
	// inserted: the settle stored the row it was given.
	inserted bool
}

// settleOn stores row as the key's outcome, on conn, in a READ COMMITTED
// transaction of its own, queued in b after whatever b holds (the ROLLBACK
// of the call's transaction): one round trip. A claim that a handler
// committed is settled first (statements.abandon), so that its error wins;
// row is written unless the key has a row then, or another session holds
// the key's lock (a duplicate took over the key); and the key's row is read
// back, which is the answer of every caller. unlock releases the session's
// lock on the key, after the transaction has taken it. row nil only
// settles. a, when set, is the attempt whose connection conn is: its
// session is reset after the COMMIT (see session.go).
func (c *callRun) settleOn(ctx context.Context, conn *pgx.Conn, b *pgx.Batch, row *keyRow, unlock bool, a *attempt) (s settled, err error) {
	head := len(b.QueuedQueries)
	// READ WRITE: a handler may have made the session's transactions
	// read-only by default; on a standby this fails, as it must.
	b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED READ WRITE")
	b.Queue(c.st.deleteExpiredKey, c.call.Scope, c.key)
	b.Queue(c.st.abandon, c.call.Scope, c.key, abandonedStatus)
	if row != nil {
		b.Queue(c.st.insertFinal, row.args()...)
	}
	b.Queue(c.st.lookup, c.call.Scope, c.key)
	if unlock {
		b.Queue(c.st.unlockIfHeld, c.call.Scope, c.key)
	}
	b.Queue("COMMIT")
	if a != nil {
		a.queueEndSession(b)
	}
	br := conn.SendBatch(ctx, b)
	exec := func() error { _, err := br.Exec(); return err }
	for i := 0; i <= head && err == nil; i++ {
		err = exec() // the ROLLBACK, if any, and the BEGIN
	}
	if err == nil {
		err = exec() // the expired row's DELETE
	}
	if err == nil {
		tag, e := br.Exec()
		s.abandoned, err = tag.RowsAffected() == 1, e
	}
	if err == nil && row != nil {
		tag, e := br.Exec()
		s.inserted, err = tag.RowsAffected() == 1, e
	}
	if err == nil {
		s.rec, err = scanRecord(br.QueryRow())
	}
	if err == nil && unlock {
		err = exec()
	}
	if err == nil {
		var commit interface{ String() string }
		if commit, err = br.Exec(); err == nil && commit.String() != "COMMIT" {
			err = fmt.Errorf("settling the key rolled back: COMMIT returned %s", commit)
		}
	}
	if err == nil && a != nil {
		if rerr := a.readEndSession(br); rerr != nil {
			// The key is settled: a session that could not be reset is the
			// connection's to pay for (see end), not the call's.
			a.resetFailed(rerr)
			_ = br.Close()
			return s, nil
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return s, err
}

// answer is a settled key's answer to this call: what it stored, or what
// the key holds, the same for every caller.
func (c *callRun) answer(s settled, ran bool, row *keyRow, resp proto.Message, returned error) (result, error) {
	switch {
	case s.inserted:
		return result{Result: Result{Response: resp, Outcome: OutcomeExecuted}, metadata: row.metadata, ownAnswer: row.own}, returned
	case s.rec == nil:
		return result{Result: Result{Outcome: OutcomeInProgress}}, inProgress("another call took over the key", c.s.opts.retryDelay)
	}
	res, err := c.replay(*s.rec)
	if ran && s.abandoned {
		res.Outcome = OutcomeExecuted // this call's handler committed the claim
	}
	return res, err
}

// settle stores row as the call's outcome outside the call's transaction,
// on the attempt's connection (see settleOn): the call's transaction is
// rolled back, fn's writes with it, in the same round trip. returned is
// the error the caller gets when row is stored. row nil only settles a
// claim found committed.
func (a *attempt) settle(ctx context.Context, row *keyRow, resp proto.Message, returned error) (result, attemptNext, error) {
	b := &pgx.Batch{}
	if err := a.endTx(ctx, b); err != nil {
		return a.finishFailed(ctx, err)
	}
	s, err := a.settleOn(ctx, a.conn, b, row, a.session, a)
	if err != nil {
		return a.finishFailed(ctx, err)
	}
	a.open, a.session = false, false
	res, err := a.answer(s, a.ran, row, resp, returned)
	return res, attemptDone, err
}

// settleWith stores st, an error of the engine's, as the call's final
// error (see settle).
func (a *attempt) settleWith(ctx context.Context, st *grpcstatus.Status) (result, attemptNext, error) {
	row, err := a.keyRow(nil, st, false)
	if err != nil {
		return result{Result: Result{Outcome: OutcomeReleased}}, attemptDone, err
	}
	return a.settle(ctx, &row, nil, Final(st.Err()))
}

// settleElsewhere is settleOn on a connection of its own, for a call whose
// attempt has no connection (it died) or none yet (a duplicate's probe).
func (c *callRun) settleElsewhere(ctx context.Context, row *keyRow) (settled, error) {
	pc, err := c.s.db.Acquire(ctx)
	if err != nil {
		return settled{}, c.s.finishError("settle the key", err)
	}
	defer pc.Release()
	s, err := c.settleOn(ctx, pc.Conn(), &pgx.Batch{}, row, false, nil)
	if err != nil {
		return s, c.s.finishError("settle the key", err)
	}
	return s, nil
}

// release rolls the call's transaction back, releases the key and resets
// the session (see session.go), in one round trip, for a call whose fn
// failed. abandoned reports that fn had
// committed the claim (it ended the transaction itself first), which the
// same round trip settles.
func (a *attempt) release(ctx context.Context) (res result, abandoned bool, err error) {
	b := &pgx.Batch{}
	if err := a.endTx(ctx, b); err != nil {
		return result{}, false, err
	}
	b.Queue(a.st.abandon, a.call.Scope, a.key, abandonedStatus)
	if a.session {
		b.Queue(a.st.unlockIfHeld, a.call.Scope, a.key)
	}
	release := len(b.QueuedQueries)
	a.queueEndSession(b)
	br := a.conn.SendBatch(ctx, b)
	for i := 0; i < release && err == nil; i++ {
		tag, e := br.Exec()
		if err = e; b.QueuedQueries[i].SQL == a.st.abandon {
			abandoned = tag.RowsAffected() == 1
		}
	}
	if err == nil {
		err = a.readEndSession(br)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return result{}, false, err
	}
	a.open, a.session = false, false
	if abandoned {
		res = result{Result: Result{Outcome: OutcomeExecuted}}
		err = Final(grpcstatus.Error(codes.Internal, errAbandoned))
	}
	return res, abandoned, err
}

// releaseWith releases the key for fn's error (see release) and passes the
// error on, told truthfully: the caller's cancellation, a serialization
// failure or deadlock (retry with the same key), a read-only transaction.
func (a *attempt) releaseWith(ctx, fctx context.Context, fnErr error) (result, attemptNext, error) {
	if sqlState(fnErr) == sqlReadOnlyTransaction {
		return a.readOnly(fctx, "a statement of the handler's failed because the call's transaction is read-only", true)
	}
	if res, abandoned, err := a.release(fctx); abandoned {
		return res, attemptDone, err
	}
	// A failed release leaves the connection to be closed (see end), which
	// releases the key all the same.
	res := result{Result: Result{Outcome: OutcomeReleased}, ownAnswer: true}
	if ctx.Err() != nil && errors.Is(fnErr, ctx.Err()) {
		return res, attemptDone, contextError{ctx.Err()}
	}
	return res, attemptDone, handlerError(fnErr)
}

// lost answers a call whose connection died while fn ran. Whatever the
// transaction held is gone with the session, unless fn had committed the
// claim itself, which is settled on another connection; so is the key of
// a call whose fn had the connection (tx.Conn()), which may have committed
// anything on it: it keeps an error. Otherwise nothing committed, and the
// key is free again.
func (a *attempt) lost(ctx, fctx context.Context, h handled) (result, attemptNext, error) {
	a.releaseConn()
	if !a.rawConn && h.err != nil && ctx.Err() != nil {
		// The caller's deadline (or cancellation) cut fn short, and pgx
		// closed the connection to stop fn's statement: nothing committed,
		// a retry is safe. That is not an outage.
		return result{Result: Result{Outcome: OutcomeReleased}}, attemptDone, contextError{ctx.Err()}
	}
	var row *keyRow
	if a.rawConn {
		r, err := a.keyRow(nil, grpcstatus.New(codes.Internal, errLostRawConn), false)
		if err != nil {
			return result{Result: Result{Outcome: OutcomeReleased}}, attemptDone, err
		}
		row = &r
	}
	s, err := a.settleElsewhere(fctx, row)
	switch {
	case err != nil:
		return result{Result: Result{Outcome: outcomeOf(err)}}, attemptDone, err
	case s.rec == nil && row == nil:
		// The database connection died under fn: report an outage, not fn's
		// raw driver error, so clients retry.
		return result{Result: Result{Outcome: OutcomeUnavailable}}, attemptDone, ErrStoreUnavailable.with("connection lost during the call", h.err)
	}
	res, err := a.answer(s, true, row, nil, Final(grpcstatus.Error(codes.Internal, errLostRawConn)))
	return res, attemptDone, err
}
