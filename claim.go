package idempotency

import (
	"context"
	"crypto/rand"
	"errors"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// attempt makes one try at running the call on a connection of its own,
// in phases: claim the key, run fn, check what fn did, commit.
func (c *callRun) attempt(ctx context.Context, fn Func) (result, attemptNext, error) {
	pc, err := c.s.db.Acquire(ctx)
	if err != nil {
		res, err := c.failed(ctx, "acquire connection", err)
		return res, attemptDone, err
	}
	a := &attempt{callRun: c, pc: pc, conn: pc.Conn()}
	a.params.read(a.conn.PgConn())
	a.savepoint = claimSavepointOf(a.conn.PgConn())
	defer a.end(ctx)
	if a.baseline, err = a.loadBaseline(ctx); err != nil {
		res, err := c.failed(ctx, "read the session's settings", err)
		return res, attemptDone, err
	}

	start := c.tp.trace.now()
	inserted, err := a.claim(ctx)
	c.tp.trace.since(phaseClaim, start)
	switch {
	case err != nil:
		return a.claimFailed(ctx, err)
	case !inserted:
		return a.missed(ctx)
	}
	h := a.run(ctx, fn)
	defer c.tp.trace.since(phaseCommit, c.tp.trace.now())
	return a.finish(ctx, h)
}

// attempt is one attempt's hold on a connection.
type attempt struct {
	*callRun
	pc   *pgxpool.Conn
	conn *pgx.Conn
	// released: pc went back to the pool before the attempt ended (its
	// connection died, and settling the key needs another).
	released bool
	// open: the connection may be inside a transaction (the call's, or one
	// the handler began), to be rolled back before it goes back to the pool.
	open bool
	// session: the session may hold the key's lock, to be released before
	// the connection goes back to the pool.
	session bool
	// ctid is the address of the claim's row, valid once the call's
	// transaction inserted it.
	ctid pgtype.TID
	// savepoint is the connection's claim savepoint (see claim).
	savepoint *claimSavepoint
	// atClaim: the connection may still be in the claim's transaction,
	// at or past its savepoint: the claim inserted the key's row, and
	// since then the engine has neither ended the transaction nor found
	// the savepoint gone (fn ended the claim's transaction itself).
	atClaim bool
	// claimed is who made the claim: its transaction and session, which
	// say whether anything of the attempt committed when its connection
	// cannot (see claimFate).
	claimed claimant
	// ran: fn ran, so what the key stores from here on is this attempt's
	// answer (see settle).
	ran bool
	// rawConn: the handler had the connection itself (tx.Conn()).
	rawConn bool
	// ended: fn left the connection outside any transaction.
	ended bool
	// reset, when set, says why the connection must be closed when the
	// attempt ends rather than serve another call: the handler left the
	// session in a state the engine does not reset (see session.go).
	reset string
	// params are the settings PostgreSQL reports, as the attempt found them.
	params sessionParams
	// baseline is what the pool made of the session, which the reset after
	// a commit sets again (see session.go).
	baseline *sessionBaseline
	// batch holds the statements of the claim's round trip, and then of
	// the commit's, in storage of the attempt's.
	batch stmtBatch
}

// claim opens the call's transaction with the claim (see
// statements.claim), and ends the round trip with the claim's savepoint,
// after which fn runs: ROLLBACK TO it undoes fn's work and nothing of the
// claim's. An outcome stored without fn's writes (a final error) is then
// written over the claim in the claim's own transaction, whose row and
// locks hold the key until its COMMIT (see settle); and a failed
// transaction block goes back to it when the block is the claim's
// transaction, and only then (see rollbackAborted). One round trip.
// inserted reports that the claim's row is in: the key is this call's.
func (a *attempt) claim(ctx context.Context) (inserted bool, err error) {
	b := a.batch.reset()
	b.queue(a.begin)
	b.queue(a.st.claim, a.call.Scope, a.key, a.call.Method, a.call.Fingerprint, a.call.TTL.Microseconds())
	b.queue(a.savepoint.set)
	// Until the claim's answer says otherwise, the transaction may be open
	// and the session may hold the lock (but never behind a pooler: see
	// renderStatements).
	a.open, a.session = true, !a.s.pooled.Load()
	br := roundTrip(ctx, a.conn, &b.b)
	var snapshotLevel bool
	if _, err = br.Exec(); err == nil {
		err = br.QueryRow().Scan(&a.ctid, &snapshotLevel, &a.claimed.xact, &a.claimed.pid, &a.claimed.at)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			err = nil
		case err == nil:
			inserted = true
		}
		if err == nil {
			_, err = br.Exec() // the savepoint
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	a.atClaim = inserted && err == nil
	if inserted && a.inherited {
		a.s.defaultSnapshot.Store(snapshotLevel)
	}
	return inserted, err
}

// missed answers a claim that inserted nothing, in one round trip: the
// call's transaction is rolled back, the key's expired row (if the
// session got the lock) deleted, the session's lock released if it got
// it, and the key probed, as a duplicate's probe does.
func (a *attempt) missed(ctx context.Context) (result, attemptNext, error) {
	b := &pgx.Batch{}
	b.Queue("ROLLBACK")
	b.Queue(a.st.deleteExpiredIfHeld, a.call.Scope, a.key)
	if a.session {
		b.Queue(a.st.unlockIfHeld, a.call.Scope, a.key)
	}
	b.Queue(a.st.probe, a.call.Scope, a.key)
	br := a.conn.SendBatch(ctx, b)
	var err error
	for i := 0; i < len(b.QueuedQueries)-1 && err == nil; i++ {
		_, err = br.Exec()
	}
	var rec *record
	var free bool
	if err == nil {
		rec, err = scanRecord(br.QueryRow(), &free)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		res, err := a.failed(ctx, "claim", err)
		return res, attemptDone, err
	}
	a.open, a.session = false, false
	switch {
	case rec != nil && !rec.expired && rec.state == stateRunning:
		// A claim that its handler committed: nothing can change its
		// outcome, which is settled now.
		return a.settle(ctx, nil, nil, nil)
	case rec != nil && !rec.expired:
		res, err := a.replay(*rec)
		return res, attemptDone, err
	case free:
		// The key's row expired and is gone, or its holder finished
		// without one: claim again.
		return result{}, attemptAgain, nil
	}
	return result{}, attemptWait, nil
}

// claimFailed answers a claim the database refused; nothing ran.
func (a *attempt) claimFailed(ctx context.Context, err error) (result, attemptNext, error) {
	switch sqlState(err) {
	case sqlSerializationFailure:
		// At REPEATABLE READ and SERIALIZABLE, the INSERT met a row
		// committed after the transaction's snapshot: look again.
		return result{}, attemptAgain, nil
	case sqlReadOnlyTransaction:
		return a.readOnly(ctx, "the call's transaction is read-only", false)
	case sqlInvalidStatementName:
		// The connection lost the engine's prepared statements since its
		// last call (a DEALLOCATE pgx could not see, or pgx's DeallocateAll
		// outside the engine): they are prepared again on the next use.
		// Sent through pgx's own batch, the connection, whose other
		// statements pgx keeps are gone too, is not used again; sent
		// through the engine's (see roundTrip), whose record the error
		// dropped, it is, so that a pool that deallocates everything on
		// release (AfterRelease) keeps its connections. A pooler that does
		// not carry prepared statements fails the same way twice.
		if !connStatementsOf(a.conn).prepares {
			a.reset = "its prepared statements vanished"
		}
		res, err := a.failed(ctx, "claim", err)
		return res, attemptRetry, err
	}
	res, err := a.failed(ctx, "claim", err)
	return res, attemptDone, err
}

// end ends the attempt on every path, panics included: whatever is still
// open is rolled back, the session's lock released and the session reset
// (see session.go), in one round trip, even when ctx is cancelled (until
// then the key stays locked). A connection that cannot be cleaned up is
// closed, which releases both; so is one whose session the handler left in
// a state the engine does not reset (see session.go), so that nothing of
// the call reaches a later one.
func (a *attempt) end(ctx context.Context) {
	if a.released {
		return
	}
	reset := a.resetReason()
	if reset == "" && !a.open && !a.session {
		a.pc.Release() // the common case: committed, nothing left to do
		return
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), a.s.opts.finishTimeout)
	defer cancel()
	if reset == "" {
		b := a.batch.reset()
		if err := a.endTx(rctx, b); err != nil {
			reset = "it could not be cleaned up"
		} else if a.session {
			b.queue(a.st.unlockIfHeld, a.call.Scope, a.key)
		}
		if reset == "" {
			cleanup := b.len()
			a.queueEndSession(b)
			br := roundTrip(rctx, a.conn, &b.b)
			var err error
			for range cleanup {
				if _, err = br.Exec(); err != nil {
					break
				}
			}
			if err == nil {
				err = a.readEndSession(br)
			}
			if cerr := br.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				reset = "it could not be cleaned up"
			} else {
				reset = a.resetReason()
			}
		}
	}
	if reset != "" {
		_ = a.conn.Close(rctx)
	}
	a.pc.Release()
}

// endTx ends the connection's open transaction: it queues the ROLLBACK at
// the head of b (see rollbackAborted).
func (a *attempt) endTx(ctx context.Context, b *stmtBatch) error {
	if err := a.rollbackAborted(ctx); err != nil || !a.open {
		return err
	}
	b.queue("ROLLBACK")
	a.atClaim = false
	return nil
}

// inClaim reports whether the connection may be in the claim's
// transaction, at or past its savepoint (see atClaim).
func (a *attempt) inClaim() bool {
	return a.atClaim && a.open && a.conn.PgConn().TxStatus() != 'I'
}

// rollbackAborted leaves a transaction block that a failed statement
// aborted, in a round trip of its own: PostgreSQL runs nothing but a
// ROLLBACK in an aborted transaction, and pgx parses a statement new to the
// connection in a round trip before the statements that use it.
//
// In the claim's transaction, it rolls back to the claim's savepoint:
// fn's work is undone, and the claim's row and the key's locks stay, so
// that the key is settled before anyone can claim it, behind a pooler too.
// A savepoint that is not there (invalid_savepoint_specification) is proof
// that the failed block is not the claim's transaction: fn ended that one
// itself, and began another, which may have followed writes committed on
// their own; atClaim is then false. Otherwise ROLLBACK AND CHAIN replaces
// the failed block with a new transaction, keeping the session inside one,
// so that a transaction pooler keeps the server connection with it until
// the round trip that ends it. Both go in the simple protocol (pgx's
// statements without arguments do), which parses nothing ahead.
func (a *attempt) rollbackAborted(ctx context.Context) error {
	if !a.open || a.conn.PgConn().TxStatus() != 'E' {
		return nil
	}
	if a.inClaim() {
		_, err := a.conn.Exec(ctx, a.savepoint.rollbackTo)
		if sqlState(err) != sqlInvalidSavepoint {
			return err
		}
		a.atClaim = false
	}
	_, err := a.conn.Exec(ctx, "ROLLBACK AND CHAIN")
	return err
}

// claimSavepoint is the savepoint that ends a claim's round trip, under a
// name of its connection's own. The name is random, made at the
// connection's first call, so that no handler knows it: a savepoint of a
// handler's under the same name, made after the engine's, would stop a
// ROLLBACK TO short of fn's writes before it. Which transaction a ROLLBACK
// TO lands in never rests on the name: a transaction is the claim's when
// its id is (statements.releaseCheck), or when it wrote the claim's row
// (statements.finish). One name per connection keeps pgx's statement cache
// to one statement of each per connection.
type claimSavepoint struct{ set, rollbackTo string }

// savepointKey keys a connection's claimSavepoint in its CustomData.
const savepointKey = "idempotency.claimSavepoint"

// claimSavepointOf returns conn's claimSavepoint, made at its first use.
func claimSavepointOf(conn *pgconn.PgConn) *claimSavepoint {
	data := conn.CustomData()
	if sp, ok := data[savepointKey].(*claimSavepoint); ok {
		return sp
	}
	name := "idempotency_claim_" + strings.ToLower(rand.Text())
	sp := &claimSavepoint{set: "SAVEPOINT " + name, rollbackTo: "ROLLBACK TO SAVEPOINT " + name}
	data[savepointKey] = sp
	return sp
}

// releaseConn hands a dead connection back to the pool at once, so that a
// pool whose every connection is held (a pool of one) can give the attempt
// another to settle the key on.
func (a *attempt) releaseConn() {
	if !a.released {
		a.released, a.open, a.session = true, false, false
		a.pc.Release()
	}
}
