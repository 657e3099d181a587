package idempotency

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// finish decides the call's outcome from what fn did, and commits it: fn's
// writes with the result written over the claim, a final error alone
// (settle), or nothing (the key released). From here the outcome is known;
// it is finished even if the caller left, on a context of its own (see
// finishError).
func (a *attempt) finish(ctx context.Context, h handled) (result, attemptNext, error) {
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), a.s.opts.finishTimeout)
	defer cancel()
	if a.conn.IsClosed() {
		return a.lost(ctx, fctx, h)
	}
	var final *finalError
	isFinal := errors.As(h.err, &final)
	txStatus := a.conn.PgConn().TxStatus()
	switch {
	case txStatus == 'I':
		// fn ended the call's transaction and began none: whether it
		// committed the claim or rolled it back, settle says. What it set
		// for the session after may have been committed on its own.
		a.open = false
		return a.settleEnded(fctx)
	case h.refused != "":
		return a.settleWith(fctx, grpcstatus.New(codes.Internal, h.refused))
	case h.err != nil && !isFinal:
		return a.releaseWith(ctx, fctx, h.err)
	case txStatus == 'E' && !isFinal:
		return a.settleWith(fctx, grpcstatus.New(codes.Internal, errIgnoredFailure))
	case isFinal:
		// The caller gets what is stored, now as on every replay: the
		// status, as a status error (see replay).
		st := finalStatus(final.err)
		h.err = storedFinal(st)
		row, err := a.keyRow(h.resp, st, true)
		if err != nil {
			return a.releaseFor(fctx, func() (result, error) { return result{Result: Result{Outcome: OutcomeReleased}}, err })
		}
		return a.settle(fctx, &row, h.resp, h.err)
	}
	if a.rawConn {
		// fn may have deallocated the connection's prepared statements on
		// it, the commit's among them: pgx and the server agree again once
		// both have none.
		err := a.conn.DeallocateAll(fctx)
		forgetStatements(a.conn)
		if err != nil {
			return a.finishFailed(fctx, err)
		}
	}
	return a.commit(fctx, h.resp)
}

// commit writes the call's result over its claim and commits (see write).
func (a *attempt) commit(ctx context.Context, resp proto.Message) (result, attemptNext, error) {
	row, err := a.keyRow(resp, nil, true)
	if err != nil {
		// The result cannot be stored: the call fails, released, unless
		// fn committed the claim or left its transaction (see release).
		return a.releaseFor(ctx, func() (result, error) { return result{Result: Result{Outcome: OutcomeReleased}}, err })
	}
	return a.write(ctx, &row, resp, nil, false)
}

// write writes row over the call's claim and commits, and resets the
// session (see session.go): one round trip, the statement that writes the
// row (and releases the session's lock; the transaction's covers the
// COMMIT), what a rollback would leave of the session released, the
// COMMIT, and what the commit kept of the session reset. undo heads the
// round trip with ROLLBACK TO the claim's savepoint (see claim), which
// undoes fn's writes, for an outcome stored without them (a final error):
// the key stays the claim's throughout. The caller gets returned once row
// is committed.
func (a *attempt) write(ctx context.Context, row *keyRow, resp proto.Message, returned error, undo bool) (result, attemptNext, error) {
	b := a.batch.reset()
	if undo {
		// Tried once: should the round trip fail, the key is settled
		// outside the claim's transaction.
		a.atClaim = false
		b.queue(a.savepoint.rollbackTo)
	}
	b.queue(a.st.finish, row.finishArgs(a.ctid)...)
	a.queueReleaseHeld(b, true)
	b.queue("COMMIT")
	a.queueReset(b)
	start := time.Now()
	br := roundTrip(ctx, a.conn, &b.b)
	var err error
	if undo {
		if _, err = br.Exec(); err != nil {
			_ = br.Close()
			return a.finishRefused(ctx, err)
		}
	}
	var one int64
	var unlocked, prepared bool
	if err = br.QueryRow().Scan(&one, &unlocked, &prepared); err != nil {
		_ = br.Close()
		return a.finishRefused(ctx, err)
	}
	a.session = false // the row's statement ran, and released the lock
	atCommit := false // the COMMIT itself failed, not a statement before it
	if err = a.readDeallocated(br, prepared); err == nil {
		var tag pgconn.CommandTag
		if tag, err = br.Exec(); err == nil && tag.String() != "COMMIT" {
			err = fmt.Errorf("transaction rolled back: COMMIT returned %s", tag)
		}
		atCommit = err != nil
	}
	if err == nil && a.readReset(br) != nil {
		// Committed: the batch's error is the reset's, which costs the
		// connection (see readReset), not the call.
		_ = br.Close()
	} else if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		a.open = a.conn.PgConn().TxStatus() != 'I'
		return a.commitFailed(ctx, err, atCommit)
	}
	a.open = false
	if took := time.Since(start); took >= a.call.TTL/2 {
		// The COMMIT itself took a large part of the TTL (the call's own
		// length is counted in finish): count the TTL from its end. Best
		// effort; at READ COMMITTED, for SERIALIZABLE's conflict tracking
		// to leave it alone.
		b := &pgx.Batch{}
		b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED")
		b.Queue(a.st.extend, a.call.Scope, a.key, a.call.TTL.Microseconds())
		b.Queue("COMMIT")
		_, _ = sendAll(ctx, a.conn, b)
	}
	return result{Result: Result{Response: resp, Outcome: OutcomeExecuted}, metadata: row.metadata, ownAnswer: row.own}, attemptDone, returned
}

// finishRefused answers a result that the database refused to write over
// the claim, or a ROLLBACK TO the claim's savepoint that failed before it
// (see write); the call's transaction is aborted, fn's writes with it.
func (a *attempt) finishRefused(ctx context.Context, err error) (result, attemptNext, error) {
	switch sqlState(err) {
	case sqlDivisionByZero, sqlInvalidSavepoint:
		// The statement's guard, or the claim's savepoint gone: the
		// transaction is not the claim's, so fn ended the call's
		// transaction and began another.
		return a.settleEnded(ctx)
	case sqlSerializationFailure, sqlDeadlockDetected:
		// At SERIALIZABLE, the transaction's reads do not serialize (fn's,
		// even those rolled back to the claim's savepoint): nothing
		// commits, and the key goes with the transaction, as at its COMMIT
		// (see commitFailed).
		res, err := a.failed(ctx, "store result", err)
		res.Outcome = OutcomeReleased
		return res, attemptDone, err
	case sqlReadOnlyTransaction:
		return a.readOnly(ctx, "the key's row could not be written because the call's transaction is read-only", true)
	case sqlInsufficientPrivilege:
		return a.roleRefused(ctx, err)
	case sqlInvalidStatementName:
		a.reset = "its prepared statements vanished"
		if err := a.rollbackAborted(ctx); err != nil {
			return a.finishFailed(ctx, err)
		}
		err := a.conn.DeallocateAll(ctx)
		forgetStatements(a.conn)
		if err != nil {
			return a.finishFailed(ctx, err)
		}
		return a.settleWith(ctx, grpcstatus.New(codes.Internal, errStatementsVanished))
	}
	return a.finishFailed(ctx, err)
}

// roleRefused answers a result that the transaction's role may not write:
// either fn set another role for it (SET LOCAL ROLE, for row-level
// security), and the call fails once, its error stored and naming the
// cause, or the store's role lacks the privilege, which an operator must
// grant (nothing is stored, so that the calls run once it is).
func (a *attempt) roleRefused(ctx context.Context, cause error) (result, attemptNext, error) {
	if err := a.rollbackAborted(ctx); err != nil {
		return a.finishFailed(ctx, err)
	}
	var role string
	var may bool
	if err := a.conn.QueryRow(ctx, a.st.rolePrivileges).Scan(&role, &may); err != nil {
		return a.finishFailed(ctx, err)
	}
	if !may {
		err := a.s.finishError("store result", cause)
		return result{Result: Result{Outcome: outcomeOf(err)}}, attemptDone, err
	}
	return a.settleWith(ctx, grpcstatus.Newf(codes.Internal, "idempotency: the key's row could not be written as the role the handler set for the call's transaction "+
		"(SET LOCAL ROLE, SET ROLE or set_config('role', ...)), which may not update the key table; the call's own role, %s, may. "+
		"Set the role back before the handler returns (SET LOCAL ROLE %s), or grant the handler's role SELECT and UPDATE on the key table. "+
		"Nothing was committed; the key is kept with this error so that the call does not run again", role, pgx.Identifier{role}.Sanitize()))
}

// readOnly answers a call whose transaction cannot write: on a standby
// (a failover in progress), a retry can reach the new primary; on a
// primary, the session's default (before the handler ran) or the handler
// (ran: it set transaction_read_only) made the transaction read-only, and
// a retry would fail the same way. A handler that did so fails once, its
// error stored, as for anything else the engine cannot make safe.
func (a *attempt) readOnly(ctx context.Context, what string, ran bool) (result, attemptNext, error) {
	if err := a.rollbackAborted(ctx); err != nil {
		return a.finishFailed(ctx, err)
	}
	var standby bool
	if err := a.conn.QueryRow(ctx, "SELECT pg_catalog.pg_is_in_recovery()", pgx.QueryExecModeSimpleProtocol).Scan(&standby); err != nil || standby {
		return result{Result: Result{Outcome: OutcomeUnavailable}}, attemptDone, ErrStoreUnavailable.with(what+" (the server is a standby)", err)
	}
	if ran {
		return a.settleWith(ctx, grpcstatus.Newf(codes.Internal, "idempotency: %s on a primary server: the handler made it so "+
			"(transaction_read_only); nothing was committed, and the key is kept with this error so that the call does not run again", what))
	}
	return result{Result: Result{Outcome: OutcomeMisconfigured}}, attemptDone, grpcstatus.Errorf(codes.Internal,
		"idempotency: %s on a primary server: default_transaction_read_only is on for the store's role, database or connection; nothing ran", what)
}

// commitFailed handles a COMMIT that PostgreSQL refused: the transaction
// rolled back, fn's writes with it. atCommit: the error is the COMMIT's
// (not a statement queued before it, which is the engine's).
//
// At COMMIT PostgreSQL runs what fn's writes deferred: their deferred
// constraints, and the deferred constraint triggers of fn's tables. Their
// errors are fn's failure: a violation of fn's rows that can never succeed
// (unique, exclusion) is FailedPrecondition, final where the transport
// says so; a missing referenced row (foreign_key_violation), which a later
// attempt can find, and any error of a deferred trigger (RAISE, a C
// function's error, a statement of the function that failed) release the
// key, nothing stored, as fn's own error would. The server's conditions (a
// lost session, an outage, a serialization failure) keep the engine's
// classification (see dbError).
func (a *attempt) commitFailed(ctx context.Context, err error, atCommit bool) (result, attemptNext, error) {
	var pgErr *pgconn.PgError
	if !atCommit || !errors.As(err, &pgErr) {
		return a.finishFailed(ctx, err)
	}
	switch code := pgErr.Code; {
	case code == sqlInvalidStatementName:
		// The engine's COMMIT statement, deallocated by fn (see
		// finishRefused): nothing committed.
		return a.finishRefused(ctx, err)
	case code == sqlSerializationFailure || code == sqlDeadlockDetected:
		res, err := a.failed(ctx, "commit", err)
		res.Outcome = OutcomeReleased
		return res, attemptDone, err
	case pgErr.Severity == "FATAL" || pgErr.Severity == "PANIC" || transientCode(code):
		return a.finishFailed(ctx, err)
	case pgErr.Where == "" && code == sqlForeignKeyViolation:
		// A deferred foreign key (its check has no context of its own).
		return a.refusedAtCommit(codes.FailedPrecondition, pgErr, fmt.Sprintf("the call's writes violate constraint %s of table %s at COMMIT: %s",
			pgErr.ConstraintName, pgErr.TableName, pgErr.Message))
	case pgErr.Where == "" && strings.HasPrefix(code, "23"):
		// A deferred unique or exclusion constraint of fn's rows.
		return a.violatedAtCommit(ctx, pgErr)
	}
	// Any other error of the COMMIT itself is the deferred work of fn's
	// writes: the engine defers nothing (its statements ran before, and
	// the key table has no deferred constraint or trigger). So it is a
	// deferred trigger of fn's tables, whatever it raised and in whatever
	// language its function is written (a statement of the function that
	// violated a constraint included): fn's failure.
	return a.refusedAtCommit(codes.Unknown, pgErr, fmt.Sprintf("the call's writes were refused at COMMIT by the database, "+
		"in a deferred trigger of the handler's tables (SQLSTATE %s: %s)", pgErr.Code, pgErr.Message))
}

// violatedAtCommit handles a COMMIT that failed on a deferred constraint of
// fn's writes that no later attempt can satisfy: fn's failure, as if fn
// had returned FailedPrecondition, and stored as such when the transport
// makes that code final.
func (a *attempt) violatedAtCommit(ctx context.Context, pgErr *pgconn.PgError) (result, attemptNext, error) {
	st := grpcstatus.Newf(codes.FailedPrecondition, "the call's writes violate constraint %s of table %s: %s", pgErr.ConstraintName, pgErr.TableName, pgErr.Message)
	if a.tp.finalCode == nil || !a.tp.finalCode(codes.FailedPrecondition) {
		return result{Result: Result{Outcome: OutcomeReleased}}, attemptDone, st.Err()
	}
	return a.settleWith(ctx, st)
}

// refusedAtCommit answers a COMMIT that refused fn's writes for a reason a
// later attempt may not meet: fn's failure, nothing stored. The COMMIT
// rolled the claim back with them, and the session's lock on the key went
// with the statement that wrote the key's row: the key is free.
func (a *attempt) refusedAtCommit(code codes.Code, pgErr *pgconn.PgError, msg string) (result, attemptNext, error) {
	return result{Result: Result{Outcome: OutcomeReleased}}, attemptDone, &commitRefused{code: code, cause: pgErr,
		msg: msg + "; nothing was committed and nothing stored: a retry with the same key runs the call again"}
}

// commitRefused is the error of a call whose writes the COMMIT refused
// (see refusedAtCommit): the client gets code and msg; errors.As finds the
// database's error.
type commitRefused struct {
	code  codes.Code
	msg   string
	cause *pgconn.PgError
}

func (e *commitRefused) Error() string { return "idempotency: " + e.msg }

func (e *commitRefused) Unwrap() error { return e.cause }

func (e *commitRefused) GRPCStatus() *grpcstatus.Status {
	return grpcstatus.New(e.code, "idempotency: "+e.msg)
}

// finishFailed handles a failure to store the result: the transaction is
// gone, and with it fn's writes. The outcome may be unknown (the
// connection died during COMMIT); a retry with the same key replays it if
// the commit happened, or runs again.
func (a *attempt) finishFailed(ctx context.Context, err error) (result, attemptNext, error) {
	if a.conn.IsClosed() && a.rawConn && a.ended && !a.released {
		// fn had the connection and ended the call's transaction on it
		// (so it may have committed anything there), and the connection
		// died before the key was settled: it is settled on another.
		return a.lost(ctx, ctx, handled{})
	}
	err = a.s.finishError("store result", err)
	return result{Result: Result{Outcome: outcomeOf(err)}}, attemptDone, err
}

// finishError is dbError for the statements that store a call's result:
// they run on a context of their own, so a deadline there is the finish
// timeout, an outage whose outcome may be unknown, not the caller's.
func (s *Store) finishError(op string, err error) error {
	return s.dbError(context.Background(), op, err)
}

// keyRow builds the row of the call's key for its result: the response,
// and with a final error its status; withMetadata adds what the transport
// recorded of the call (its headers), in the transport's encoding.
func (a *attempt) keyRow(resp proto.Message, final *grpcstatus.Status, withMetadata bool) (keyRow, error) {
	row := keyRow{scope: a.call.Scope, key: a.key, method: a.call.Method, fingerprint: a.call.Fingerprint, state: "succeeded", ttl: a.call.TTL,
		own: withMetadata}
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

// keyRow is a key's row as the engine writes it.
type keyRow struct {
	scope, key, method string
	fingerprint        []byte
	state              string
	responseType       string
	response, status   []byte
	ttl                time.Duration
	metadata           []byte
	// own: the row is fn's own result (its response or final error, with
	// what the transport recorded), not an error of the engine's.
	own bool
}

// args are insertFinal's parameters.
func (r *keyRow) args() []any {
	return []any{r.scope, r.key, r.method, r.fingerprint, r.state, r.responseType, r.response, r.status, r.ttl.Microseconds(), r.metadata}
}

// finishArgs are finish's parameters, for the claim at ctid.
func (r *keyRow) finishArgs(ctid pgtype.TID) []any {
	return []any{r.scope, r.key, ctid, r.state, r.responseType, r.response, r.status, r.metadata, r.ttl.Microseconds()}
}
