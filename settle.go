package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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
func (c *callRun) settleOn(ctx context.Context, conn *pgx.Conn, b *stmtBatch, row *keyRow, unlock bool, a *attempt) (s settled, err error) {
	head := b.len()
	// READ WRITE: a handler may have made the session's transactions
	// read-only by default; on a standby this fails, as it must.
	b.queue("BEGIN ISOLATION LEVEL READ COMMITTED READ WRITE")
	b.queue(c.st.deleteExpiredKey, c.call.Scope, c.key)
	b.queue(c.st.abandon, c.call.Scope, c.key, abandonedStatus)
	if row != nil {
		b.queue(c.st.insertFinal, row.args()...)
	}
	b.queue(c.st.lookup, c.call.Scope, c.key)
	if unlock {
		b.queue(c.st.unlockIfHeld, c.call.Scope, c.key)
	}
	b.queue("COMMIT")
	if a != nil {
		a.queueEndSession(b)
	}
	br := conn.SendBatch(ctx, &b.b)
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

// settle stores row as the call's outcome, returned being the error the
// caller gets when row is stored; row nil only settles a claim found
// committed.
//
// In the claim's transaction, fn's work is rolled back to the claim's
// savepoint, and row written over the claim and committed, in one round
// trip (see write): the claim's row and the key's locks hold the key until
// that COMMIT, so that no duplicate claims it before row is stored, behind
// a pooler too. Outside it (fn ended the claim's transaction, or the
// engine did), row is stored in a transaction of its own, on the attempt's
// connection (see settleOn), the open transaction rolled back in the same
// round trip. A claim's savepoint found gone says that fn ended the
// claim's transaction itself: the key keeps the error that says so (see
// settleEnded).
func (a *attempt) settle(ctx context.Context, row *keyRow, resp proto.Message, returned error) (result, attemptNext, error) {
	if row != nil && a.inClaim() {
		if err := a.rollbackAborted(ctx); err != nil {
			return a.finishFailed(ctx, err)
		}
		if !a.atClaim {
			return a.settleEnded(ctx)
		}
		return a.write(ctx, row, resp, returned, true)
	}
	b := new(stmtBatch).reset()
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

// settleEnded settles a call whose fn ended the claim's transaction
// itself: whatever it committed, with the claim or on its own after it,
// the key keeps the error that says so (a committed claim is settled
// first, see settleOn), and the connection, whose session fn may have
// changed outside the call's transaction, is closed when the attempt ends.
func (a *attempt) settleEnded(ctx context.Context) (result, attemptNext, error) {
	a.atClaim, a.ended = false, true
	a.reset = "the handler ended the call's transaction"
	return a.settleWith(ctx, grpcstatus.New(codes.Internal, errHandlerEndedTx))
}

// settleWith stores st, an error of the engine's, as the call's final
// error (see settle).
func (a *attempt) settleWith(ctx context.Context, st *grpcstatus.Status) (result, attemptNext, error) {
	row, err := a.keyRow(nil, st, false)
	if err != nil {
		return result{Result: Result{Outcome: OutcomeReleased}}, attemptDone, err
	}
	return a.settle(ctx, &row, nil, storedFinal(st))
}

// settleElsewhere is settleOn on a connection of its own, for a call whose
// attempt has no connection (it died) or none yet (a duplicate's probe).
func (c *callRun) settleElsewhere(ctx context.Context, row *keyRow) (settled, error) {
	pc, err := c.s.db.Acquire(ctx)
	if err != nil {
		return settled{}, c.s.finishError("settle the key", err)
	}
	defer pc.Release()
	s, err := c.settleOn(ctx, pc.Conn(), new(stmtBatch).reset(), row, false, nil)
	if err != nil {
		return s, c.s.finishError("settle the key", err)
	}
	return s, nil
}

// release rolls the call's transaction back, releases the key and resets
// the session (see session.go), in one round trip, for a call whose fn
// failed. settled reports that the key was settled instead, res and err
// being its answer: fn had committed the claim (it ended the transaction
// itself first), which the same round trip settles, or had left the
// claim's transaction for another (see statements.releaseCheck), which may
// have committed anything: the key then keeps the error that says so.
func (a *attempt) release(ctx context.Context) (res result, settled bool, err error) {
	// A failed transaction block runs nothing but a ROLLBACK: it is left
	// first, for the claim's savepoint when it is the claim's
	// transaction, for a new transaction when it is not (see
	// rollbackAborted). Then the round trip checks that the transaction
	// is still the claim's, which no handler can fake, and only then
	// releases what the session holds (a session outside any transaction
	// fails the check too). abandon settles a claim that fn committed.
	b := new(stmtBatch).reset()
	check := a.ran && a.open
	if err := a.rollbackAborted(ctx); err != nil {
		return result{}, false, err
	}
	if check {
		b.queue(a.st.releaseCheck, a.claimed.xact)
	}
	if err := a.endTx(ctx, b); err != nil {
		return result{}, false, err
	}
	b.queue(a.st.abandon, a.call.Scope, a.key, abandonedStatus)
	if a.session && !check {
		b.queue(a.st.unlockIfHeld, a.call.Scope, a.key)
	}
	release := b.len()
	a.queueReleaseHeld(b, check)
	if a.ran {
		a.queueReset(b)
	}
	claims, abandoned, prepared := true, false, false
	br := a.conn.SendBatch(ctx, &b.b)
	for _, q := range b.b.QueuedQueries[:release] {
		switch q.SQL {
		case a.st.releaseCheck:
			var unlocked *bool
			err = br.QueryRow().Scan(&claims, &unlocked, &prepared)
		case a.st.abandon:
			var tag pgconn.CommandTag
			tag, err = br.Exec()
			abandoned = tag.RowsAffected() == 1
		default:
			_, err = br.Exec()
		}
		if err != nil {
			break
		}
	}
	if err == nil && check {
		err = a.readDeallocated(br, prepared)
	} else if err == nil {
		err = a.readReleaseHeld(br)
	}
	if err == nil && a.ran {
		err = a.readReset(br)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return result{}, false, err
	}
	a.open = false
	if claims {
		a.session = false // the check released the lock, or unlockIfHeld did
	}
	switch {
	case abandoned:
		return result{Result: Result{Outcome: OutcomeExecuted}}, true, storedFinal(grpcstatus.New(codes.Internal, errAbandoned))
	case !claims:
		// fn ended the claim's transaction, and the session still holds
		// what it held, the key's lock among them: settled as for a
		// handler that returns outside any transaction (see finish), the
		// session released in the settle's round trip.
		res, _, err := a.settleEnded(ctx)
		return res, true, err
	}
	return result{}, false, nil
}

// releaseWith releases the key for fn's error (see release) and passes the
// error on, told truthfully: the caller's cancellation, a serialization
// failure or deadlock (retry with the same key), a read-only transaction.
func (a *attempt) releaseWith(ctx, fctx context.Context, fnErr error) (result, attemptNext, error) {
	if sqlState(fnErr) == sqlReadOnlyTransaction {
		return a.readOnly(fctx, "a statement of the handler's failed because the call's transaction is read-only", true)
	}
	return a.releaseFor(fctx, func() (result, error) {
		res := result{Result: Result{Outcome: OutcomeReleased}, ownAnswer: true}
		if ctx.Err() != nil && errors.Is(fnErr, ctx.Err()) {
			return res, contextError{ctx.Err()}
		}
		return res, handlerError(fnErr)
	})
}

// releaseFor releases the key (see release) and answers with released,
// the caller's answer once nothing committed. A release that fails leaves
// that unknown: the connection is closed, and the claim's fate read on
// another (see afterLoss).
func (a *attempt) releaseFor(fctx context.Context, released func() (result, error)) (result, attemptNext, error) {
	res, settled, err := a.release(fctx)
	switch {
	case settled:
		return res, attemptDone, err
	case err != nil:
		_ = a.conn.Close(fctx)
		a.releaseConn()
		// The release's ROLLBACK may have run before the connection
		// failed: a session found outside the claim's transaction is no
		// sign of fn's.
		return a.afterLoss(fctx, false, released)
	}
	res, err = released()
	return res, attemptDone, err
}

// lost answers a call whose connection died while fn ran, or was closed
// under it (pgx closes a connection whose statement the caller's context
// ended), with the truth that afterLoss finds. Nothing committed: the
// caller's own deadline (or cancellation) cut fn short, which is not an
// outage; or the connection failed, and a retry is safe.
func (a *attempt) lost(ctx, fctx context.Context, h handled) (result, attemptNext, error) {
	a.releaseConn()
	return a.afterLoss(fctx, true, func() (result, error) {
		if ctx.Err() != nil && h.err != nil {
			return result{Result: Result{Outcome: OutcomeReleased}}, contextError{ctx.Err()}
		}
		return result{Result: Result{Outcome: OutcomeUnavailable}}, ErrStoreUnavailable.with("connection lost during the call", h.err)
	})
}

// afterLoss answers a call whose attempt has no connection to settle the
// key on, from what claimFate finds on another:
//
//   - The claim's transaction committed (fn committed it: a COMMIT, COMMIT
//     AND CHAIN): the key keeps the error that says so (abandon), the
//     answer of every caller.
//   - Its session had left it for other transactions (fn ended it: a
//     ROLLBACK AND CHAIN, a ROLLBACK and statements after it), which may
//     have committed anything; or fn had the connection itself
//     (tx.Conn()), whose statements are not seen: the key keeps an error,
//     and fn never runs again. leftIsFn says whether a session found outside
//     the claim's transaction is fn's doing (not the engine's own ROLLBACK).
//   - The transaction is still open (its session could not be ended, or
//     fn prepared it): the call is in progress, and so is the key.
//   - Nothing committed: released is the answer, and the key is free.
func (a *attempt) afterLoss(fctx context.Context, leftIsFn bool, released func() (result, error)) (result, attemptNext, error) {
	f, err := a.claimFate(fctx)
	if err != nil {
		err = a.s.finishError("learn whether the call committed after its connection was lost", err)
		return result{Result: Result{Outcome: outcomeOf(err)}}, attemptDone, err
	}
	var st *grpcstatus.Status
	switch {
	case f.status == "committed":
	case f.status == "in progress":
		return result{Result: Result{Outcome: OutcomeInProgress}}, attemptDone,
			inProgress("the call's transaction is still open in the database (its session could not be ended, or the handler prepared it)", a.s.opts.retryDelay)
	case f.status != "aborted":
		err := a.s.finishError("learn whether the call committed after its connection was lost", fmt.Errorf("txid_status returned %q", f.status))
		return result{Result: Result{Outcome: outcomeOf(err)}}, attemptDone, err
	case a.rawConn:
		st = grpcstatus.New(codes.Internal, errLostRawConn)
	case leftIsFn && f.left:
		st = grpcstatus.New(codes.Internal, errHandlerEndedTx)
	default:
		res, err := released()
		return res, attemptDone, err
	}
	var row *keyRow
	returned := error(nil)
	if st != nil {
		r, err := a.keyRow(nil, st, false)
		if err != nil {
			return result{Result: Result{Outcome: OutcomeUnavailable}}, attemptDone, err
		}
		row, returned = &r, storedFinal(st)
	}
	s, err := a.settleElsewhere(fctx, row)
	if err != nil {
		return result{Result: Result{Outcome: outcomeOf(err)}}, attemptDone, err
	}
	res, err := a.answer(s, true, row, nil, returned)
	return res, attemptDone, err
}

// fate is what became of an attempt's claim (see claimFate).
type fate struct {
	// status is the claim's transaction's: "committed", "aborted" or "in
	// progress" (txid_status).
	status string
	// left: the attempt's session was alive, and had left the claim's
	// transaction (see statements.endSession).
	left bool
}

// claimant is who made an attempt's claim, as the claim reported it.
type claimant struct {
	xact int64 // the call's transaction (txid_current)
	pid  int32 // the session's backend process
	at   int64 // the transaction's start, in microseconds since the epoch
}

// claimFate ends the attempt's session if it still lives (see
// statements.endSession), then reads what became of the claim's
// transaction, on a connection of its own. Once the session is gone,
// nothing of it can commit any more (a statement it was still running, a
// COMMIT queued behind it), so what the claim's transaction became is
// final, unless it is still in progress: its session could not be ended,
// or a handler prepared it (PREPARE TRANSACTION).
func (a *attempt) claimFate(ctx context.Context) (fate, error) {
	pc, err := a.s.db.Acquire(ctx)
	if err != nil {
		return fate{}, err
	}
	defer pc.Release()
	c, b := a.claimed, &pgx.Batch{}
	if serverMajor(pc.Conn().PgConn()) >= 14 {
		wait := a.s.opts.finishTimeout / 2
		if d, ok := ctx.Deadline(); ok {
			wait = time.Until(d) / 2
		}
		b.Queue(a.st.endSessionWait, c.pid, c.at, c.xact, max(wait.Milliseconds(), 1))
	} else {
		b.Queue(a.st.endSession, c.pid, c.at, c.xact)
	}
	b.Queue(a.st.claimStatus, c.xact)
	br := pc.Conn().SendBatch(ctx, b)
	var f fate
	var ended *bool
	if err = br.QueryRow().Scan(&f.left, &ended); errors.Is(err, pgx.ErrNoRows) {
		err = nil // the session is gone
	}
	if err == nil {
		var status *string
		if err = br.QueryRow().Scan(&status); status != nil {
			f.status = *status
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return f, err
}

// serverMajor is the major version of the server conn reached, 0 when it
// does not say.
func serverMajor(conn *pgconn.PgConn) int {
	v := conn.ParameterStatus("server_version")
	n := 0
	for _, r := range v {
		if r < '0' || r > '9' {
			break
		}
		n = n*10 + int(r-'0')
	}
	return n
}
