package idempotency

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// Execute runs fn at most once per (scope, key), in one transaction with the
// key:
//
//   - A new key: the call takes the key's lock (a transaction-scoped
//     advisory lock), looks the key up, fn runs, and its response is
//     written as the key's row in the same transaction as fn's own writes,
//     with the COMMIT. Result.Outcome is OutcomeExecuted.
//   - A finished key with the same method and fingerprint returns the stored
//     response, or the stored [Final] error, without running fn
//     (OutcomeReplayed), whatever Call.Retry says.
//   - A key held by a call still running: Execute waits, holding no
//     database connection, up to the store's in-progress wait for it to
//     finish, then returns its result, runs fn if the holder failed, or
//     returns [ErrInProgress].
//   - A finished key with another method or fingerprint: [ErrKeyReused].
//   - fn returns an error not marked [Final], or panics: everything rolls
//     back, no key is left behind, and the error (or panic) is passed on. A
//     serialization failure or deadlock of fn's statements is returned as
//     codes.Aborted: nothing committed, retry with the same key.
//   - fn does what the engine cannot make safe (ends the transaction, sends
//     COMMIT or SET TRANSACTION through tx, leaves rows open): the call
//     fails with codes.Internal saying what happened, that error is stored
//     as the key's result, and fn never runs again for the key.
//   - The database fails before the outcome is known: [ErrStoreUnavailable].
//
// The key's row is the only write of the engine: the primary key (scope,
// key) makes a second row for a key impossible, whoever writes it, and the
// lock only keeps duplicates from running fn while the first call runs.
// The result is committed with a context that ignores ctx's cancellation,
// so a caller that goes away after fn succeeded still finds its result
// stored when it retries.
func (s *Store) Execute(ctx context.Context, call Call, fn Func) (res Result, err error) {
	tp := &transport{kind: TransportDirect}
	if s.opts.tracer != nil {
		ctx, tp.trace = s.startCall(ctx, TransportDirect, call.Method, call.Key)
		defer tp.trace.endDeferred(ctx, &res.Outcome, &err)
	}
	r, err := s.execute(ctx, call, tp, fn)
	return r.Result, err
}

// execute is Execute for every transport: it validates the call, then
// makes attempts until one decides the call's outcome.
func (s *Store) execute(ctx context.Context, call Call, tp *transport, fn Func) (result, error) {
	c, err := s.newCallRun(ctx, call, tp)
	if err != nil {
		return result{Result: Result{Outcome: outcomeOf(err)}}, err
	}
	w := waiter{wait0: s.opts.inProgressWait, trace: tp.trace}
	probe := call.Retry
	for conflicts := 0; ; {
		if probe {
			res, found, err := c.probe(ctx, &w)
			if found || err != nil {
				return res, err
			}
		}
		res, then, err := c.attempt(ctx, fn)
		switch then {
		case attemptDone:
			return res, err
		case attemptWait:
			if err := w.wait(ctx); err != nil {
				return c.gaveUp(ctx)
			}
		case attemptAgain:
			// Another writer's row appeared where the lock said none
			// would, or a row expired while this call used it. Rare; look
			// again, a few times at most.
			if conflicts++; conflicts == 3 {
				return result{Result: Result{Outcome: OutcomeInProgress}}, inProgress("the key kept changing while it was being claimed", s.opts.retryDelay)
			}
		case attemptSnapshot:
			// The transaction's snapshot may predate the lock: claim again
			// with the key locked before the transaction begins.
			c.snapshot = true
			continue
		}
		probe = true
	}
}

// attemptNext says what execute does after an attempt.
type attemptNext int

const (
	attemptDone     attemptNext = iota
	attemptWait                 // another call holds the key's lock: wait, then probe
	attemptAgain                // look at the key again at once
	attemptSnapshot             // claim again, locking the key before the snapshot
)

// callRun is one call's state across its attempts.
type callRun struct {
	s    *Store
	call Call
	key  string // as stored: the transport's namespace and the call's key
	tp   *transport
	st   *statements
	// begin opens the call's transaction at its isolation level.
	begin string
	// snapshot: the call's transaction is REPEATABLE READ or SERIALIZABLE,
	// whose snapshot is taken at its first statement, so the key is locked
	// by the session before the transaction begins (see claim).
	snapshot bool
	// inherited: the level is the database's default, which the store
	// learns from the claims that run at it.
	inherited bool
}

func (s *Store) newCallRun(ctx context.Context, call Call, tp *transport) (*callRun, error) {
	if err := validateCall(&call); err != nil {
		return nil, err
	}
	level := call.Isolation
	if level == "" {
		level = s.opts.isolation
	}
	begin, ok := beginStatements[level]
	if !ok {
		return nil, grpcstatus.Errorf(codes.InvalidArgument, "idempotency: Call.Isolation %q is not an isolation level of pgx.TxIsoLevel", level)
	}
	st, err := s.statements(ctx)
	if err != nil {
		return nil, s.dbError(ctx, "find the key table", err)
	}
	c := &callRun{s: s, call: call, key: tp.namespace + call.Key, tp: tp, st: st, begin: begin, inherited: level == ""}
	c.snapshot = level == pgx.RepeatableRead || level == pgx.Serializable || (c.inherited && s.defaultSnapshot.Load())
	return c, nil
}

// beginStatements opens a call's transaction at each level; "" leaves it
// to the database's default.
var beginStatements = map[pgx.TxIsoLevel]string{
	"":                  "BEGIN",
	pgx.ReadCommitted:   "BEGIN ISOLATION LEVEL READ COMMITTED",
	pgx.ReadUncommitted: "BEGIN ISOLATION LEVEL READ UNCOMMITTED",
	pgx.RepeatableRead:  "BEGIN ISOLATION LEVEL REPEATABLE READ",
	pgx.Serializable:    "BEGIN ISOLATION LEVEL SERIALIZABLE",
}

// validateCall rejects what PostgreSQL cannot store, before anything is
// sent, and fills in the defaults.
func validateCall(call *Call) error {
	if err := ValidateKey(call.Key); err != nil {
		return err
	}
	if err := validateText("Call.Method", call.Method, maxMethodLen); err != nil {
		return err
	}
	if call.Method == "" {
		return grpcstatus.Error(codes.InvalidArgument, "idempotency: Call.Method is empty")
	}
	if err := validateText("scope", call.Scope, MaxScopeLen); err != nil {
		return err
	}
	if call.TTL <= 0 {
		call.TTL = DefaultTTL
	}
	if call.Fingerprint == nil {
		call.Fingerprint = []byte{}
	}
	return nil
}

// probe looks for the key's row outside any transaction, and waits while
// its lock is held. found is true when res is the call's outcome (a
// replay, or the end of the wait); false sends the call to an attempt.
func (c *callRun) probe(ctx context.Context, w *waiter) (res result, found bool, err error) {
	for {
		start := c.tp.trace.now()
		rec, free, err := c.probeOnce(ctx)
		c.tp.trace.since(phaseClaim, start)
		switch {
		case err != nil:
			res, err := c.failed(ctx, "look up key", err)
			return res, true, err
		case rec != nil && !rec.expired:
			res, err := c.replay(*rec)
			return res, true, err
		case free:
			return result{}, false, nil
		}
		if err := w.wait(ctx); err != nil {
			res, err := c.gaveUp(ctx)
			return res, true, err
		}
	}
}

// probeOnce reads the key's row and whether its lock is free, on a
// connection held only for that statement. Where the database's default is
// SERIALIZABLE (or REPEATABLE READ), the statement runs in a READ COMMITTED
// transaction of its own, so that conflict tracking never counts the
// engine's reads against the calls that write keys.
func (c *callRun) probeOnce(ctx context.Context) (rec *record, free bool, err error) {
	pc, err := c.s.db.Acquire(ctx)
	if err != nil {
		return nil, false, err
	}
	defer pc.Release()
	if !c.s.defaultSnapshot.Load() {
		rec, err = scanRecord(pc.QueryRow(ctx, c.st.probe, c.call.Scope, c.key), &free)
		return rec, free, err
	}
	b := &pgx.Batch{}
	b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED")
	b.Queue(c.st.probe, c.call.Scope, c.key)
	b.Queue("COMMIT")
	br := pc.SendBatch(ctx, b)
	if _, err = br.Exec(); err == nil {
		if rec, err = scanRecord(br.QueryRow(), &free); err == nil {
			_, err = br.Exec()
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return rec, free, err
}

// failed is the outcome of a database error of the engine's own
// statements.
func (c *callRun) failed(ctx context.Context, op string, err error) (result, error) {
	err = c.s.dbError(ctx, op, err)
	return result{Result: Result{Outcome: outcomeOf(err)}}, err
}

// gaveUp ends a wait for the key's holder: the caller's own cancellation,
// or ErrInProgress once the in-progress wait is over.
func (c *callRun) gaveUp(ctx context.Context) (result, error) {
	if ctxErr := ctx.Err(); ctxErr != nil {
		return result{Result: Result{Outcome: OutcomeCanceled}}, contextError{ctxErr}
	}
	return result{Result: Result{Outcome: OutcomeInProgress}}, inProgress("", c.s.opts.retryDelay)
}

// attempt makes one try at running the call on a connection of its own,
// in phases: claim the key, run fn, check what fn did, commit.
func (c *callRun) attempt(ctx context.Context, fn Func) (result, attemptNext, error) {
	pc, err := c.s.db.Acquire(ctx)
	if err != nil {
		res, err := c.failed(ctx, "acquire connection", err)
		return res, attemptDone, err
	}
	a := &attempt{callRun: c, pc: pc, conn: pc.Conn()}
	defer a.release(ctx)

	start := c.tp.trace.now()
	cl, err := a.claim(ctx)
	c.tp.trace.since(phaseClaim, start)
	switch {
	case err != nil:
		res, err := c.failed(ctx, "claim", err)
		return res, attemptDone, err
	case !cl.locked:
		return result{}, attemptWait, nil
	case cl.stale:
		return result{}, attemptSnapshot, nil
	case cl.rec != nil && !cl.rec.expired:
		res, err := c.replay(*cl.rec)
		return res, attemptDone, err
	case cl.readOnly:
		return a.readOnly(ctx, "the call's transaction is read-only", false)
	}
	h := a.run(ctx, fn)
	defer c.tp.trace.since(phaseCommit, c.tp.trace.now())
	return a.finish(ctx, h, cl.rec != nil)
}

// attempt is one attempt's hold on a connection.
type attempt struct {
	*callRun
	pc   *pgxpool.Conn
	conn *pgx.Conn
	// open: the connection may be inside a transaction (the call's, or one
	// the handler began), to be rolled back before it goes back to the pool.
	open bool
	// session: the session holds the key's lock, to be released before the
	// connection goes back to the pool.
	session bool
	// started is the start of the call's transaction, its now().
	started time.Time
	// failedStatement: a statement of fn's failed and aborted the
	// transaction, which the engine then rolled back to its savepoint.
	failedStatement bool
	// rawConn: the handler had the connection itself (tx.Conn()).
	rawConn bool
}

// release ends the attempt on every path, panics included: whatever is
// still open is rolled back and the session's lock released, in one round
// trip, even when ctx is cancelled (until then the key stays locked). A
// connection that cannot be cleaned up is closed, which releases both; so
// is one the handler had raw (tx.Conn()), so that nothing it kept of the
// call can reach a later one.
func (a *attempt) release(ctx context.Context) {
	if !a.open && !a.session && !a.rawConn {
		a.pc.Release() // the common case: committed, nothing left to do
		return
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), a.s.opts.finishTimeout)
	defer cancel()
	if a.open || a.session {
		b := &pgx.Batch{}
		if a.open {
			b.Queue("ROLLBACK")
		}
		if a.session {
			b.Queue(a.st.unlock, a.call.Scope, a.key)
		}
		if _, err := sendAll(rctx, a.conn, b); err != nil {
			_ = a.conn.Close(rctx)
		}
	}
	if a.rawConn {
		_ = a.conn.Close(rctx)
	}
	a.pc.Release()
}

// claimed is what a claim found.
type claimed struct {
	locked bool
	// stale: the transaction's snapshot was taken before the key's lock,
	// so a result committed in between would be missed.
	stale bool
	// readOnly: the transaction cannot write (a standby, or a read-only
	// default), so the result could never be stored.
	readOnly bool
	rec      *record
}

// claim opens the call's transaction, takes the key's lock without waiting
// for it, looks the key up once the lock is held (a statement after the
// lock's, so at READ COMMITTED it sees whatever the previous holder
// committed), and takes the savepoint that a final error rolls back to:
// one round trip.
//
// At REPEATABLE READ and SERIALIZABLE the transaction's snapshot is taken by
// its first statement, the lock's, a moment before the lock is granted: a
// holder committing in that moment would be missed. So the session takes
// the lock first and looks the key up, in a READ COMMITTED transaction of
// their own ended at once, and the call's transaction begins after them:
// its snapshot sees everything the key's previous holders committed, and
// SERIALIZABLE's conflict tracking never sees the engine's lookups (which
// would fail unrelated calls whose keys share an index page). Still one
// round trip, and one pipeline, so the lock never leaves the connection
// behind a transaction pooler.
func (a *attempt) claim(ctx context.Context) (claimed, error) {
	b := &pgx.Batch{}
	if a.snapshot {
		b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED")
		b.Queue(a.st.lockSession, a.call.Scope, a.key)
		b.Queue(a.st.lookup, a.call.Scope, a.key)
		b.Queue("COMMIT")
	}
	b.Queue(a.begin)
	b.Queue(a.st.lock, a.call.Scope, a.key)
	if !a.snapshot {
		b.Queue(a.st.lookup, a.call.Scope, a.key)
	}
	b.Queue(a.st.savepoint)
	a.open = true
	br := a.conn.SendBatch(ctx, b)
	cl, snapshotLevel, err := a.readClaim(br)
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return cl, err
	}
	if a.snapshot && !a.session {
		cl.locked = false // another call held the key when the session asked for it
	}
	if a.inherited {
		a.s.defaultSnapshot.Store(snapshotLevel)
	}
	cl.stale = snapshotLevel && !a.session && (cl.rec == nil || cl.rec.expired)
	return cl, nil
}

// readClaim reads the claim's results, in the order claim queued them.
// snapshotLevel reports the transaction's level is REPEATABLE READ or
// SERIALIZABLE.
func (a *attempt) readClaim(br pgx.BatchResults) (cl claimed, snapshotLevel bool, err error) {
	exec := func() error { _, err := br.Exec(); return err }
	if a.snapshot {
		if err = exec(); err == nil { // BEGIN ISOLATION LEVEL READ COMMITTED
			err = br.QueryRow().Scan(&a.session)
		}
		if err == nil {
			cl.rec, err = scanRecord(br.QueryRow(), nil)
		}
		if err == nil {
			err = exec() // COMMIT
		}
	}
	if err == nil {
		err = exec() // BEGIN
	}
	if err == nil {
		err = br.QueryRow().Scan(&cl.locked, &a.started, &snapshotLevel, &cl.readOnly)
	}
	if err == nil && !a.snapshot {
		cl.rec, err = scanRecord(br.QueryRow(), nil)
	}
	if err == nil {
		err = exec() // SAVEPOINT
	}
	return cl, snapshotLevel, err
}

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
// key is released, as for an error, unless fn had the connection itself
// (tx.Conn()) and ended the transaction there, or lost the connection: its
// writes may have committed, so the key keeps an error and fn never runs
// again. The panic then goes on.
func (a *attempt) settlePanic(ctx context.Context) {
	if !a.rawConn {
		return
	}
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), a.s.opts.finishTimeout)
	defer cancel()
	if a.conn.IsClosed() {
		a.session = false
		_, _, _ = a.storeOutsideOn(fctx, nil, grpcstatus.New(codes.Internal, errLostRawConn))
		return
	}
	if ended, err := a.handlerEndedTx(fctx, true); err == nil && ended {
		_, _, _ = a.storeOutside(fctx, grpcstatus.New(codes.Internal, errHandlerEndedTx))
	}
}

// finish decides the call's outcome from what fn did, and commits it: fn's
// writes with the key's row, the key's row alone (a final error, rolled
// back to the savepoint), or nothing (the key released). From here the
// outcome is known; it is finished even if the caller left, on a context
// of its own (see finishError).
func (a *attempt) finish(ctx context.Context, h handled, replacing bool) (result, attemptNext, error) {
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), a.s.opts.finishTimeout)
	defer cancel()
	if a.conn.IsClosed() {
		if a.rawConn {
			// The handler had the connection itself, and it is gone: it
			// may have committed on it. The outcome is unknown, so the key
			// keeps an error, stored on another connection.
			a.session = false // with the session
			return a.storeOutsideOn(fctx, nil, grpcstatus.New(codes.Internal, errLostRawConn))
		}
		if h.err != nil && ctx.Err() != nil {
			// The caller's deadline (or cancellation) cut fn short, and pgx
			// closed the connection to stop fn's statement: nothing
			// committed, a retry is safe. That is not an outage.
			return result{Result: Result{Outcome: OutcomeReleased}}, attemptDone, contextError{ctx.Err()}
		}
		// The database connection died under fn: report an outage, not fn's
		// raw driver error, so clients retry.
		return result{Result: Result{Outcome: OutcomeUnavailable}}, attemptDone, ErrStoreUnavailable.with("connection lost during the call", h.err)
	}
	var final *finalError
	isFinal := errors.As(h.err, &final)
	ended, err := a.handlerEndedTx(fctx, h.err != nil && !isFinal && h.refused == "")
	switch {
	case err != nil:
		return a.finishFailed(fctx, err)
	case ended:
		return a.storeOutside(fctx, grpcstatus.New(codes.Internal, errHandlerEndedTx))
	case h.refused != "":
		return a.commitFinal(fctx, grpcstatus.New(codes.Internal, h.refused), replacing)
	case h.err != nil && !isFinal:
		return a.releaseWith(ctx, fctx, h.err)
	case a.failedStatement && !isFinal:
		return a.commitFinal(fctx, grpcstatus.New(codes.Internal, errIgnoredFailure), replacing)
	case isFinal:
		st := grpcstatus.Convert(final.err)
		if !utf8.ValidString(st.Message()) {
			// The caller gets what is stored, now and on every replay.
			h.err = Final(grpcstatus.ErrorProto(sanitizeStatus(st.Proto())))
		}
		return a.commit(fctx, h.resp, st, h.err, replacing)
	}
	return a.commit(fctx, h.resp, nil, nil, replacing)
}

// commitFinal stores st, an error of the engine's, as the call's final
// error, fn's writes rolled back.
func (a *attempt) commitFinal(ctx context.Context, st *grpcstatus.Status, replacing bool) (result, attemptNext, error) {
	return a.commit(ctx, nil, st, Final(st.Err()), replacing)
}

// Messages of the errors stored for what a handler must not do.
const (
	errHandlerEndedTx = "idempotency: the handler ended the call's transaction itself (a COMMIT or ROLLBACK sent on tx.Conn(), " +
		"or a transaction begun there), so its writes may have been committed without the key; " +
		"the key is kept with this error so that the call does not run again. Handlers must not end the transaction"
	errLostRawConn = "idempotency: the connection closed after the handler used tx.Conn(), so its writes may have been committed " +
		"without the key; the key is kept with this error so that the call does not run again"
	errIgnoredFailure = "idempotency: the handler returned success, but one of its statements had failed and aborted the call's transaction, " +
		"so none of its writes could be committed; the key is kept with this error so that the call does not run again. " +
		"Return the statement's error (or roll back a nested transaction of tx) instead"
)

// handlerEndedTx reports whether fn ended the call's transaction (and
// maybe began another): the connection is idle, its savepoint is gone, or
// the transaction started at another time. An aborted transaction is rolled
// back to the call's savepoint on the way, so that the engine can still
// write the key. mustCheck asks for the check of a live transaction too,
// where the key's INSERT would otherwise check it.
func (a *attempt) handlerEndedTx(ctx context.Context, mustCheck bool) (bool, error) {
	switch a.conn.PgConn().TxStatus() {
	case 'I':
		return true, nil
	case 'E':
		// On its own: in an aborted transaction PostgreSQL refuses to
		// prepare any statement until the savepoint is rolled back.
		a.failedStatement = true
		if _, err := a.conn.Exec(ctx, a.st.rollbackToSavepoint); err != nil {
			if sqlState(err) == sqlInvalidSavepoint {
				return true, nil // the savepoint went with the transaction fn ended
			}
			return false, err
		}
	default:
		if !mustCheck {
			return false, nil
		}
	}
	var same bool
	if err := a.conn.QueryRow(ctx, a.st.sameTransaction, a.started).Scan(&same); err != nil {
		return false, err
	}
	return !same, nil
}

// releaseWith rolls fn's writes back (in release) and passes fn's error on,
// told truthfully: the caller's cancellation, a serialization failure or
// deadlock (retry with the same key), a read-only transaction.
func (a *attempt) releaseWith(ctx, fctx context.Context, fnErr error) (result, attemptNext, error) {
	res := result{Result: Result{Outcome: OutcomeReleased}, ownAnswer: true}
	switch {
	case ctx.Err() != nil && errors.Is(fnErr, ctx.Err()):
		return res, attemptDone, contextError{ctx.Err()}
	case sqlState(fnErr) == sqlReadOnlyTransaction:
		return a.readOnly(fctx, "a statement of the handler's failed because the call's transaction is read-only", true)
	}
	return res, attemptDone, handlerError(fnErr)
}

// readOnly answers a call whose transaction cannot write: on a standby
// (a failover in progress), a retry can reach the new primary; on a
// primary, the session's default (before the handler ran) or the handler
// (ran: it set transaction_read_only) made the transaction read-only, and
// a retry would fail the same way. A handler that did so fails once, its
// error stored, as for anything else the engine cannot make safe.
func (a *attempt) readOnly(ctx context.Context, what string, ran bool) (result, attemptNext, error) {
	// Asked inside the call's transaction: ending it on its own would hand
	// a pooler the connection while the session may hold the key.
	if a.conn.PgConn().TxStatus() == 'E' {
		_, _ = a.conn.Exec(ctx, a.st.rollbackToSavepoint)
	}
	var standby bool
	if err := a.conn.QueryRow(ctx, "SELECT pg_catalog.pg_is_in_recovery()", pgx.QueryExecModeSimpleProtocol).Scan(&standby); err != nil || standby {
		return result{Result: Result{Outcome: OutcomeUnavailable}}, attemptDone, ErrStoreUnavailable.with(what+" (the server is a standby)", err)
	}
	if ran {
		return a.storeOutside(ctx, grpcstatus.Newf(codes.Internal, "idempotency: %s on a primary server: the handler made it so "+
			"(transaction_read_only); nothing was committed, and the key is kept with this error so that the call does not run again", what))
	}
	return result{Result: Result{Outcome: OutcomeMisconfigured}}, attemptDone, grpcstatus.Errorf(codes.Internal,
		"idempotency: %s on a primary server: default_transaction_read_only is on for the store's role, database or connection; nothing ran", what)
}

// commit writes the key's row with the call's result, fn's response and/or
// a final error, and commits; returned is the error the caller then gets.
// A final error first rolls fn's writes back to the savepoint. One round
// trip: the row, the release of the session's lock when it holds one
// (before the COMMIT, so that the lock never outlives the round trip; the
// transaction's lock covers the COMMIT), and the COMMIT.
func (a *attempt) commit(ctx context.Context, resp proto.Message, final *grpcstatus.Status, returned error, replacing bool) (result, attemptNext, error) {
	row, err := a.keyRow(resp, final, true)
	if err != nil {
		return result{Result: Result{Outcome: OutcomeReleased}}, attemptDone, err
	}
	b := &pgx.Batch{}
	if final != nil {
		b.Queue(a.st.rollbackToSavepoint)
	}
	if replacing {
		b.Queue(a.st.deleteExpiredKey, a.call.Scope, a.key)
	}
	insertAt := len(b.QueuedQueries)
	b.Queue(a.st.insert, row.args()...)
	if a.session {
		b.Queue(a.st.unlock, a.call.Scope, a.key)
	}
	commitAt := len(b.QueuedQueries)
	b.Queue("COMMIT")
	start := time.Now()
	failed, err := sendAll(ctx, a.conn, b)
	if failed < 0 || failed > commitAt-1 {
		a.session = false // the unlock ran
	}
	switch {
	case err == nil:
		a.open = false
	case failed == insertAt && sqlState(err) == sqlUniqueViolation:
		return result{}, attemptAgain, nil // someone wrote the key's row without its lock
	case failed == insertAt && sqlState(err) == sqlDivisionByZero:
		// The INSERT's guard: fn ended the call's transaction and began
		// another (see insertRow).
		return a.storeOutside(ctx, grpcstatus.New(codes.Internal, errHandlerEndedTx))
	case failed == insertAt && sqlState(err) == sqlReadOnlyTransaction:
		return a.readOnly(ctx, "the key's row could not be written because the call's transaction is read-only", true)
	case failed == commitAt:
		return a.commitFailed(ctx, err)
	default:
		return a.finishFailed(ctx, err)
	}
	if took := time.Since(start); took >= a.call.TTL/2 {
		// Best effort: a failure leaves the TTL counted from the insert.
		// At READ COMMITTED, for SERIALIZABLE's conflict tracking to leave
		// it alone.
		b := &pgx.Batch{}
		b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED")
		b.Queue(a.st.extend, a.call.Scope, a.key, a.call.TTL.Microseconds())
		b.Queue("COMMIT")
		_, _ = sendAll(ctx, a.conn, b)
	}
	return result{Result: Result{Response: resp, Outcome: OutcomeExecuted}, metadata: row.metadata, ownAnswer: true}, attemptDone, returned
}

// keyRow builds the row of the call's key for its result: the response,
// and with a final error its status; withMetadata adds what the transport
// recorded of the call (its headers), in the transport's encoding.
func (a *attempt) keyRow(resp proto.Message, final *grpcstatus.Status, withMetadata bool) (keyRow, error) {
	row := keyRow{scope: a.call.Scope, key: a.key, method: a.call.Method, fingerprint: a.call.Fingerprint,
		state: "succeeded", ttl: a.call.TTL, started: a.started}
	if withMetadata && a.tp.metadata != nil {
		var err error
		if row.metadata, err = a.tp.metadata(); err != nil {
			return row, err
		}
	}
	if resp != nil {
		// The response, or, with a final error, the response of a transport
		// whose final outcomes are responses of their own (an HTTP 404).
		b, err := proto.MarshalOptions{Deterministic: true}.Marshal(resp)
		if err != nil {
			return row, fmt.Errorf("idempotency: marshal response: %w", err)
		}
		row.responseType, row.response = string(resp.ProtoReflect().Descriptor().FullName()), b
	}
	if final != nil {
		b, err := marshalStatus(final)
		if err != nil {
			return row, fmt.Errorf("idempotency: marshal status: %w", err)
		}
		row.state, row.status = "failed", b
	}
	return row, nil
}

// commitFailed handles a COMMIT that PostgreSQL refused: the transaction
// rolled back, fn's writes with it.
func (a *attempt) commitFailed(ctx context.Context, err error) (result, attemptNext, error) {
	switch code := sqlState(err); {
	case strings.HasPrefix(code, "23"):
		return a.violatedAtCommit(ctx, err)
	case code == sqlSerializationFailure || code == sqlDeadlockDetected:
		res, err := a.failed(ctx, "commit", err)
		res.Outcome = OutcomeReleased
		return res, attemptDone, err
	}
	return a.finishFailed(ctx, err)
}

// finishFailed handles a failure to store the result: the transaction is
// gone, and with it fn's writes.
func (a *attempt) finishFailed(ctx context.Context, err error) (result, attemptNext, error) {
	if sqlState(err) == sqlInvalidSavepoint { // fn ended the transaction
		return a.storeOutside(ctx, grpcstatus.New(codes.Internal, errHandlerEndedTx))
	}
	// The outcome may be unknown (the connection died during COMMIT); a
	// retry with the same key replays it if the commit happened, or runs
	// again.
	err = a.s.finishError("store result", err)
	return result{Result: Result{Outcome: outcomeOf(err)}}, attemptDone, err
}

// finishError is dbError for the statements that store a call's result:
// they run on a context of their own, so a deadline there is the finish
// timeout, an outage whose outcome may be unknown, not the caller's.
func (s *Store) finishError(op string, err error) error {
	return s.dbError(context.Background(), op, err)
}

// violatedAtCommit handles a COMMIT that failed on a deferred constraint of
// fn's writes: fn's failure, as if fn had returned FailedPrecondition, and
// stored as such when the transport makes that code final.
func (a *attempt) violatedAtCommit(ctx context.Context, err error) (result, attemptNext, error) {
	var pgErr *pgconn.PgError
	errors.As(err, &pgErr)
	st := grpcstatus.Newf(codes.FailedPrecondition, "the call's writes violate constraint %s of table %s: %s", pgErr.ConstraintName, pgErr.TableName, pgErr.Message)
	if a.tp.finalCode == nil || !a.tp.finalCode(codes.FailedPrecondition) {
		return result{Result: Result{Outcome: OutcomeReleased}}, attemptDone, st.Err()
	}
	return a.storeOutside(ctx, st)
}

// storeOutside stores st as the key's final error when the call's
// transaction could not carry it (fn ended it, or its COMMIT failed): in a
// transaction of its own, unless another call stored a result for the key
// first. Then that result is the call's answer too: every caller of a key
// gets the same one.
func (a *attempt) storeOutside(ctx context.Context, st *grpcstatus.Status) (result, attemptNext, error) {
	return a.storeOutsideOn(ctx, a.conn, st)
}

// storeOutsideOn is storeOutside on conn, or on a connection of its own
// when conn is nil (the attempt's is gone). On the attempt's connection it
// is one round trip that also ends whatever transaction is open and
// releases the session's lock, after the row is written, so that
// duplicates wait until it is there, and so that a pooler never gets the
// connection back with the lock held.
func (a *attempt) storeOutsideOn(ctx context.Context, conn *pgx.Conn, st *grpcstatus.Status) (result, attemptNext, error) {
	row, err := a.keyRow(nil, st, false)
	if err != nil {
		return result{Result: Result{Outcome: OutcomeReleased}}, attemptDone, err
	}
	row.started = time.Time{} // outside the call's transaction: no guard
	if conn == nil {
		pc, err := a.s.db.Acquire(ctx)
		if err != nil {
			err = a.s.finishError("store the call's final error", err)
			return result{Result: Result{Outcome: outcomeOf(err)}}, attemptDone, err
		}
		defer pc.Release()
		conn = pc.Conn()
	}
	own := conn == a.conn
	b := &pgx.Batch{}
	if own && conn.PgConn().TxStatus() == 'E' {
		// On its own: PostgreSQL prepares nothing in an aborted
		// transaction. Only a handler that ended the call's transaction
		// leaves one here, so behind a pooler the connection already
		// changed hands at its COMMIT.
		if _, err := conn.Exec(ctx, "ROLLBACK"); err != nil {
			err = a.s.finishError("store the call's final error", err)
			return result{Result: Result{Outcome: outcomeOf(err)}}, attemptDone, err
		}
	} else if own {
		b.Queue("ROLLBACK") // a transaction fn may have begun, or the call's
	}
	b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED")
	b.Queue(a.st.deleteExpiredKey, a.call.Scope, a.key)
	b.Queue(a.st.insertIfAbsent, row.args()...)
	b.Queue(a.st.lookup, a.call.Scope, a.key)
	if own && a.session {
		// The transaction holds the key from here to its COMMIT, when the
		// row becomes visible, so that the session can let go of it first.
		b.Queue(a.st.holdXact, a.call.Scope, a.key)
		b.Queue(a.st.unlock, a.call.Scope, a.key)
	}
	b.Queue("COMMIT")
	tag, rec, err := readStoreOutside(conn.SendBatch(ctx, b), b.QueuedQueries[0].SQL == "ROLLBACK", own && a.session)
	switch {
	case err != nil:
		err = a.s.finishError("store the call's final error", err)
		return result{Result: Result{Outcome: outcomeOf(err)}}, attemptDone, err
	case own:
		a.open, a.session = false, false
	}
	if tag.RowsAffected() == 0 && rec != nil {
		res, err := a.replay(*rec)
		return res, attemptDone, err
	}
	return result{Result: Result{Outcome: OutcomeExecuted}}, attemptDone, Final(st.Err())
}

// readStoreOutside reads the results of storeOutsideOn's batch, in the
// order it queued them: the INSERT's tag and the key's row after it.
func readStoreOutside(br pgx.BatchResults, rolledBack, unlocked bool) (tag pgconn.CommandTag, rec *record, err error) {
	exec := func() error { _, err := br.Exec(); return err }
	if rolledBack {
		err = exec() // ROLLBACK
	}
	if err == nil {
		err = exec() // BEGIN
	}
	if err == nil {
		err = exec() // the expired row's DELETE
	}
	if err == nil {
		tag, err = br.Exec()
	}
	if err == nil {
		rec, err = scanRecord(br.QueryRow(), nil)
	}
	if err == nil && unlocked {
		if err = exec(); err == nil { // the transaction's hold on the key
			err = exec() // the session's, released
		}
	}
	if err == nil {
		var commit pgconn.CommandTag
		if commit, err = br.Exec(); err == nil && commit.String() != "COMMIT" {
			err = fmt.Errorf("storing the call's final error rolled back: COMMIT returned %s", commit)
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return tag, rec, err
}

// keyRow is a key's row as the INSERT writes it: its fields are the
// statement's parameters, in order (see insertRow).
type keyRow struct {
	scope, key, method string
	fingerprint        []byte
	state              string
	responseType       string
	response, status   []byte
	ttl                time.Duration
	metadata           []byte
	// started is the start of the call's transaction, checked by the
	// INSERT's guard; zero outside it.
	started time.Time
}

func (r *keyRow) args() []any {
	var started any
	if !r.started.IsZero() {
		started = r.started
	}
	return []any{r.scope, r.key, r.method, r.fingerprint, r.state, r.responseType, r.response, r.status, r.ttl.Microseconds(), r.metadata, started}
}

// waiter paces a duplicate's wait for the key's holder: it sleeps, holding
// no connection, 2 ms at first, twice as long each time up to 50 ms, with
// jitter, for up to the in-progress wait counted from its first sleep.
type waiter struct {
	wait0    time.Duration // the in-progress wait
	deadline time.Time     // set by the first sleep
	pause    time.Duration
	trace    *callTrace
}

var errWaitOver = errors.New("in-progress wait is over")

func (w *waiter) wait(ctx context.Context) error {
	if w.deadline.IsZero() {
		w.deadline = time.Now().Add(w.wait0)
	}
	w.pause = min(max(2*w.pause, 2*time.Millisecond), 50*time.Millisecond)
	left := time.Until(w.deadline)
	if left <= 0 {
		return errWaitOver
	}
	d := min(time.Duration(float64(w.pause)*(0.75+0.5*rand.Float64())), left)
	defer w.trace.since(phaseWait, w.trace.now())
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// sendAll runs a batch of statements, in one round trip, and fails unless
// every one succeeded, the COMMIT included (a COMMIT of a failed
// transaction reports ROLLBACK). failed is the index of the statement that
// failed, -1 when none did.
func sendAll(ctx context.Context, conn *pgx.Conn, b *pgx.Batch) (failed int, err error) {
	br := conn.SendBatch(ctx, b)
	for i, q := range b.QueuedQueries {
		tag, err := br.Exec()
		if err == nil && q.SQL == "COMMIT" && tag.String() != "COMMIT" {
			err = fmt.Errorf("transaction rolled back at statement %d: COMMIT returned %s", i+1, tag)
		}
		if err != nil {
			_ = br.Close()
			return i, err
		}
	}
	return -1, br.Close()
}

// MaxScopeLen is the longest scope, in bytes. With the longest key it keeps
// the primary key's index entry well under PostgreSQL's limit for one.
const MaxScopeLen = 1024

// maxMethodLen bounds Call.Method, which PostgreSQL stores with every key.
const maxMethodLen = 1024

// validateText rejects what PostgreSQL's text cannot hold (invalid UTF-8, a
// NUL byte) or what would not fit, before anything is sent: as an outage it
// would be retried forever.
func validateText(what, s string, limit int) error {
	switch {
	case len(s) > limit:
		return grpcstatus.Errorf(codes.InvalidArgument, "idempotency: %s is %d bytes long, the limit is %d", what, len(s), limit)
	case !utf8.ValidString(s) || strings.IndexByte(s, 0) >= 0:
		return grpcstatus.Errorf(codes.InvalidArgument, "idempotency: %s is not valid UTF-8 or contains a NUL byte", what)
	}
	return nil
}
