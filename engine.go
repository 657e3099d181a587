package idempotency

import (
	"context"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"
)

// The engine, one file per phase of a call:
//
//	engine.go   Execute: validate the call, then attempts until one decides
//	wait.go     a duplicate's wait for the key's holder, outside any transaction
//	claim.go    an attempt: its connection, the claim of the key, its end
//	run.go      the handler, on the call's transaction (tx.go)
//	commit.go   the result written over the claim, with the COMMIT
//	settle.go   an outcome stored outside the call's transaction, and the key released
//	session.go  whether the attempt's connection may serve another call

// Execute runs fn at most once per (scope, key), in one transaction with the
// key:
//
//   - A new key: the call's transaction begins with the claim, one
//     statement that takes the key's lock (without waiting for it) and
//     inserts the key's row in the state running; fn runs; its response is
//     written over the claim, and the transaction commits, fn's writes with
//     it. Result.Outcome is OutcomeExecuted.
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
//   - ctx ends while fn runs, and pgx closes the connection under fn's
//     statement (or the connection is lost): before it answers, the
//     engine ends the attempt's session and reads, on another connection,
//     whether the claim's transaction committed. Nothing committed: the
//     context's error (OutcomeReleased), or [ErrStoreUnavailable]. The
//     claim committed, or the session had left the call's transaction: the
//     stored codes.Internal, as above. The transaction still open (its
//     session could not be ended): [ErrInProgress].
//   - The database fails before the outcome is known: [ErrStoreUnavailable].
//
// The key's row is the only write of the engine, and it is in fn's
// transaction from the first statement on: the primary key (scope, key)
// makes a second row for a key impossible, whoever writes it, and whatever
// fn does to the transaction (commit it, on tx.Conn() or by any SQL) the
// claim goes with it, so that a key whose fn may have committed anything
// never runs again (its callers get codes.Internal saying so). The lock
// only keeps duplicates from waiting on the row while fn runs. The result
// is committed with a context that ignores ctx's cancellation, so a caller
// that goes away after fn succeeded still finds its result stored when it
// retries.
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
	tp.trace.setScope(call.Scope)
	w := waiter{wait0: s.opts.inProgressWait, trace: tp.trace}
	probe := call.Retry
	for conflicts, retried := 0, false; ; {
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
			// The key's row appeared after the claim's snapshot was taken,
			// or its expired row was deleted. Rare; claim again, a few
			// times at most.
			if conflicts++; conflicts == 3 {
				return result{Result: Result{Outcome: OutcomeInProgress}}, inProgress("the key kept changing while it was being claimed", s.opts.retryDelay)
			}
			continue
		case attemptRetry:
			// The connection lost what the engine's statements need (its
			// prepared statements): once more, on another connection.
			if retried {
				return res, err
			}
			retried = true
			continue
		}
		probe = true
	}
}

// attemptNext says what execute does after an attempt.
type attemptNext int

const (
	attemptDone  attemptNext = iota
	attemptWait              // another call holds the key's lock: wait, then probe
	attemptAgain             // look at the key again at once
	attemptRetry             // nothing ran: claim again, once, on another connection
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
	// inherited: the level is the database's default, which the store
	// learns from the claims that run at it (see probeOnce).
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
	return &callRun{s: s, call: call, key: tp.namespace + call.Key, tp: tp, st: st, begin: begin, inherited: level == ""}, nil
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

// failed is the outcome of a database error of the engine's own
// statements.
func (c *callRun) failed(ctx context.Context, op string, err error) (result, error) {
	err = c.s.dbError(ctx, op, err)
	return result{Result: Result{Outcome: outcomeOf(err)}}, err
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

// ValidateScope reports whether the store can keep keys under scope: at
// most [MaxScopeLen] bytes of valid UTF-8 without a NUL byte. A transport
// of your own can check a configured scope once, at start, instead of
// failing every call.
func ValidateScope(scope string) error {
	return validateText("scope", scope, MaxScopeLen)
}

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
