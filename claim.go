package idempotency

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
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
	// pair holds the claim's batch, and commitBatch the commit's: the two
	// every call sends, in storage of the attempt's.
	pair        batchPair
	commitBatch pgx.Batch
}

// batchPair is a batch of two statements that allocates nothing of its
// own beyond its arguments.
type batchPair struct {
	b    pgx.Batch
	q    [2]pgx.QueuedQuery
	p    [2]*pgx.QueuedQuery
	args [9]any
}

// of returns the batch of first (with args) and second, which takes none.
func (p *batchPair) of(first string, args []any, second string) *pgx.Batch {
	n := copy(p.args[:], args)
	p.q = [2]pgx.QueuedQuery{{SQL: first, Arguments: p.args[:n:n]}, {SQL: second}}
	p.p = [2]*pgx.QueuedQuery{&p.q[0], &p.q[1]}
	p.b = pgx.Batch{QueuedQueries: p.p[:]}
	return &p.b
}

// claim opens the call's transaction with the claim (see
// statements.claim): one round trip. inserted reports that the claim's row
// is in: the key is this call's.
func (a *attempt) claim(ctx context.Context) (inserted bool, err error) {
	b := a.pair.of(a.begin, nil, a.st.claim)
	b.QueuedQueries[1].Arguments = append(a.pair.args[:0], a.call.Scope, a.key, a.call.Method, a.call.Fingerprint, a.call.TTL.Microseconds())
	// Until the claim's answer says otherwise, the transaction may be open
	// and the session may hold the lock (but never behind a pooler: see
	// renderStatements).
	a.open, a.session = true, !a.s.pooled.Load()
	br := a.conn.SendBatch(ctx, b)
	var snapshotLevel bool
	if _, err = br.Exec(); err == nil {
		err = br.QueryRow().Scan(&a.ctid, &snapshotLevel, &a.claimed.xact, &a.claimed.pid, &a.claimed.at)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			err = nil
		case err == nil:
			inserted = true
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
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
		// The connection lost the engine's prepared statements (a handler's
		// DEALLOCATE in a function pgx could not see): pgx prepares them
		// again on the next use, and the connection, whose other prepared
		// statements are gone too, is not used again. A pooler that does
		// not carry prepared statements fails the same way twice.
		a.reset = "its prepared statements vanished"
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
		b := &pgx.Batch{}
		if err := a.endTx(rctx, b); err != nil {
			reset = "it could not be cleaned up"
		} else if a.session {
			b.Queue(a.st.unlockIfHeld, a.call.Scope, a.key)
		}
		if reset == "" {
			cleanup := len(b.QueuedQueries)
			a.queueEndSession(b)
			br := a.conn.SendBatch(rctx, b)
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
func (a *attempt) endTx(ctx context.Context, b *pgx.Batch) error {
	if err := a.rollbackAborted(ctx); err != nil || !a.open {
		return err
	}
	b.Queue("ROLLBACK")
	return nil
}

// rollbackAborted replaces a transaction that a failed statement aborted
// with a new one, in a round trip of its own: PostgreSQL runs nothing but
// a ROLLBACK in an aborted transaction, and pgx parses a statement new to
// the connection in a round trip before the statements that use it. AND
// CHAIN keeps the session inside a transaction, so that a transaction
// pooler keeps the server connection, and the session's lock, with it
// until the round trip that ends it.
func (a *attempt) rollbackAborted(ctx context.Context) error {
	if !a.open || a.conn.PgConn().TxStatus() != 'E' {
		return nil
	}
	_, err := a.conn.Exec(ctx, "ROLLBACK AND CHAIN")
	return err
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
