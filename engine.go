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
	"google.golang.org/genproto/googleapis/rpc/status" // google.rpc.Status, the stored form of a final error
	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// Execute runs fn at most once per (scope, key), in one transaction with the
// key:
//
//   - A new key: the call takes the key's lock (a transaction-scoped
//     advisory lock), fn runs, and its response is written as the key's row
//     in the same transaction as fn's own writes, with the COMMIT.
//     Result.Outcome is OutcomeExecuted.
//   - A finished key with the same method and fingerprint returns the stored
//     response, or the stored [Final] error, without running fn
//     (OutcomeReplayed).
//   - A key held by a call still running: Execute waits, holding no
//     database connection, up to the store's in-progress wait for it to
//     finish, then returns its result, runs fn if the holder failed, or
//     returns [ErrInProgress].
//   - A finished key with another method or fingerprint: [ErrKeyReused].
//   - fn returns an error not marked [Final], or panics: everything rolls
//     back, no key is left behind, and the error (or panic) is passed on.
//   - The database fails before the outcome is known: [ErrStoreUnavailable].
//
// The key's row is the only write of the engine: the primary key (scope,
// key) makes a second row for a key impossible, whoever writes it, and the
// lock only keeps duplicates from running fn while the first call runs.
// The result is committed with a context that ignores ctx's cancellation,
// so a caller that goes away after fn succeeded still finds its result
// stored when it retries.
func (s *Store) Execute(ctx context.Context, call Call, fn Func) (res Result, err error) {
	if call.trace != nil || s.opts.tracer == nil {
		return s.execute(ctx, call, fn)
	}
	ctx, call.trace = s.startCall(ctx, TransportDirect, call.Method, call.Key)
	defer func() {
		if p := recover(); p != nil {
			call.trace.end(ctx, OutcomeReleased, fmt.Errorf("panic: %v", p))
			panic(p)
		}
		call.trace.end(ctx, res.Outcome, err)
	}()
	return s.execute(ctx, call, fn)
}

func (s *Store) execute(ctx context.Context, call Call, fn Func) (Result, error) {
	if err := ValidateKey(call.Key); err != nil {
		return Result{Outcome: OutcomeRejected}, err
	}
	if err := validateText("Call.Method", call.Method, maxMethodLen); err != nil || call.Method == "" {
		if err == nil {
			err = errors.New("idempotency: Call.Method is empty")
		}
		return Result{Outcome: OutcomeRejected}, err
	}
	if err := validateText("scope", call.Scope, MaxScopeLen); err != nil {
		return Result{Outcome: OutcomeRejected}, err
	}
	if call.TTL <= 0 {
		call.TTL = DefaultTTL
	}
	if call.Fingerprint == nil {
		call.Fingerprint = []byte{}
	}

	w := waiter{deadline: time.Now().Add(s.opts.inProgressWait), trace: call.trace}
	probe := call.Retry
	for conflicts := 0; ; {
		if probe {
			start := time.Now()
			rec, free, err := s.probe(ctx, call)
			call.trace.since(phaseClaim, start)
			switch {
			case err != nil:
				return Result{Outcome: OutcomeUnavailable}, s.dbError(ctx, "look up key", err)
			case rec != nil && !rec.expired:
				return s.replay(call, *rec)
			case !free:
				if err := w.wait(ctx); err != nil {
					return s.busy(ctx, err)
				}
				continue
			}
		}
		res, next, err := s.attempt(ctx, call, fn)
		call.NewKey = false // whatever happened, the key has been sent now
		switch next {
		case done:
			return res, err
		case busy:
			if err := w.wait(ctx); err != nil {
				return s.busy(ctx, err)
			}
		case conflict:
			// Another writer's row appeared where the lock said none
			// would, or a row expired while this call used it. Rare; look
			// again, a few times at most.
			if conflicts++; conflicts == 3 {
				return Result{Outcome: OutcomeInProgress}, inProgress("the key kept changing while it was being claimed", s.opts.retryDelay)
			}
		}
		probe = true
	}
}

// next says what Execute does after an attempt.
type next int

const (
	done     next = iota
	busy          // another call holds the key's lock: wait, then probe
	conflict      // look at the key again at once
)

// attempt makes one try at running the call on a connection of its own:
// take the key's lock, look for its row, run fn, and write the row with
// the COMMIT.
func (s *Store) attempt(ctx context.Context, call Call, fn Func) (Result, next, error) {
	pc, err := s.db.Acquire(ctx)
	if err != nil {
		return Result{Outcome: OutcomeUnavailable}, done, s.dbError(ctx, "acquire connection", err)
	}
	// Release returns the connection to the pool, or destroys it if a
	// failure left it inside a transaction.
	defer pc.Release()
	conn := pc.Conn()

	finished := false
	defer func() {
		// Runs on every path that did not commit, panics included. The
		// rollback must happen even when ctx is cancelled: until it does,
		// the key's lock is held.
		if !finished {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.opts.finishTimeout)
			defer cancel()
			_, _ = conn.Exec(rctx, "ROLLBACK")
		}
	}()

	claimStart := time.Now()
	locked, started, rec, err := s.claim(ctx, conn, call)
	call.trace.since(phaseClaim, claimStart)
	switch {
	case err != nil:
		return Result{Outcome: OutcomeUnavailable}, done, s.dbError(ctx, "claim", err)
	case !locked:
		return Result{}, busy, nil
	case rec != nil && !rec.expired:
		res, err := s.replay(call, *rec)
		return res, done, err
	}
	replaceExpired := rec != nil

	htx := &callTx{conn: conn}
	handlerStart := time.Now()
	resp, fnErr := func() (proto.Message, error) {
		// Dead as soon as fn returns (or panics): a goroutine fn left
		// behind must not write into what follows.
		defer htx.close()
		return fn(withCall(ctx, htx, call.Key), htx)
	}()
	call.trace.since(phaseHandler, handlerStart)
	defer call.trace.since(phaseCommit, time.Now())

	// From here the outcome is known; finish it even if the caller left.
	// Errors of the finish are never the caller's deadline: their context
	// is the finish's own (see finishError).
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.opts.finishTimeout)
	defer cancel()
	var final *finalError
	txStatus := conn.PgConn().TxStatus()
	switch {
	case conn.IsClosed():
		if fnErr != nil && ctx.Err() != nil {
			// The caller's deadline (or cancellation) cut fn short, and pgx
			// closed the connection to stop fn's statement: nothing
			// committed, a retry is safe. That is not an outage.
			return Result{Outcome: OutcomeReleased}, done, contextError{ctx.Err()}
		}
		// The database connection died under fn: report an outage, not
		// fn's raw driver error, so clients retry.
		return Result{Outcome: OutcomeUnavailable}, done, ErrStoreUnavailable.with("connection lost during the call", fnErr)
	case txStatus == 'I':
		// fn ended the transaction (whatever else it returned): its writes
		// may have committed without the key.
		finished = true // nothing left to roll back
		res, err := s.handlerEndedTx(fctx, conn, call)
		return res, done, err
	case fnErr != nil && !errors.As(fnErr, &final):
		if txStatus == 'T' && s.newTransaction(fctx, conn, started) {
			// fn committed and began another transaction, then failed.
			res, err := s.handlerEndedTx(fctx, conn, call)
			return res, done, err
		}
		if ctx.Err() != nil {
			return Result{Outcome: OutcomeReleased}, done, contextError{ctx.Err()}
		}
		return Result{Outcome: OutcomeReleased}, done, fnErr
	case fnErr == nil && txStatus == 'E':
		return Result{Outcome: OutcomeReleased}, done, grpcstatus.Error(codes.Internal,
			"idempotency: the handler returned success, but one of its statements failed and aborted the call's transaction; nothing was committed")
	}

	row := []any{call.Scope, call.Key, call.Method, call.Fingerprint, "succeeded", "", []byte(nil), []byte(nil), call.TTL.Microseconds(), []byte(nil), started}
	var meta []byte
	if call.metadata != nil {
		if meta, err = call.metadata(); err != nil {
			return Result{Outcome: OutcomeReleased}, done, err
		}
		row[9] = meta
	}
	if resp != nil {
		// The response, or, with a final error, the response of a transport
		// whose final outcomes are responses of their own (an HTTP 404).
		row[5] = string(resp.ProtoReflect().Descriptor().FullName())
		b, err := proto.MarshalOptions{Deterministic: true}.Marshal(resp)
		if err != nil {
			return Result{Outcome: OutcomeReleased}, done, fmt.Errorf("idempotency: marshal response: %w", err)
		}
		row[6] = b
	}
	batch := &pgx.Batch{}
	if final != nil {
		st := grpcstatus.Convert(final.err)
		b, err := marshalStatus(st)
		if err != nil {
			return Result{Outcome: OutcomeReleased}, done, fmt.Errorf("idempotency: marshal status: %w", err)
		}
		row[4], row[7] = "failed", b
		if !utf8.ValidString(st.Message()) {
			// The caller gets what is stored, now and on every replay.
			fnErr = Final(grpcstatus.ErrorProto(sanitizeStatus(st.Proto())))
		}
		if txStatus == 'E' {
			// On its own, before the batch: in an aborted transaction
			// PostgreSQL refuses to prepare the batch's statements until
			// the savepoint is rolled back.
			if _, err := conn.Exec(fctx, s.sql.rollbackToSavepoint); err != nil {
				return s.finishFailed(fctx, conn, call, err)
			}
		} else {
			batch.Queue(s.sql.rollbackToSavepoint)
		}
	}
	if replaceExpired {
		batch.Queue(s.sql.deleteExpiredKey, call.Scope, call.Key)
	}
	insertAt := len(batch.QueuedQueries)
	batch.Queue(s.sql.insert, row...)
	batch.Queue("COMMIT")
	start := time.Now()
	if failed, err := sendAll(fctx, conn, batch); err != nil {
		if failed == insertAt && sqlState(err) == "23505" {
			// Someone wrote the key's row without its lock.
			return Result{}, conflict, nil
		}
		if failed == insertAt && sqlState(err) == "22012" {
			// The insert's guard: fn ended the call's transaction and
			// began another (see insertRow).
			res, err := s.handlerEndedTx(fctx, conn, call)
			return res, done, err
		}
		if failed == insertAt+1 && strings.HasPrefix(sqlState(err), "23") {
			res, err := s.violatedAtCommit(fctx, conn, call, err)
			return res, done, err
		}
		return s.finishFailed(fctx, conn, call, err)
	}
	finished = true
	if took := time.Since(start); took >= call.TTL/2 {
		// Best effort: a failure leaves the TTL counted from the insert.
		_, _ = conn.Exec(fctx, s.sql.extend, call.Scope, call.Key, call.TTL.Microseconds())
	}
	return Result{Response: resp, Outcome: OutcomeExecuted, metadata: meta}, done, fnErr
}

// newTransaction reports whether the connection's transaction is no longer
// the one the call began at started: fn committed it and began another. A
// check that fails counts as no: the caller then rolls back as it would.
func (s *Store) newTransaction(ctx context.Context, conn *pgx.Conn, started time.Time) bool {
	var same bool
	if err := conn.QueryRow(ctx, "SELECT now() = $1", started).Scan(&same); err != nil {
		return false
	}
	return !same
}

// claim opens the call's transaction, takes the key's lock without waiting
// for it, looks the key up once the lock is held (a new statement, so it
// sees whatever the previous holder committed; not for a new key), and
// takes the savepoint that a final error rolls back to: one round trip. started is the
// transaction's start, which the key's INSERT checks.
func (s *Store) claim(ctx context.Context, conn *pgx.Conn, call Call) (locked bool, started time.Time, rec *record, err error) {
	lookup := !call.NewKey || call.Retry
	batch := &pgx.Batch{}
	batch.Queue("BEGIN ISOLATION LEVEL READ COMMITTED")
	batch.Queue(s.sql.lock, call.Scope, call.Key)
	if lookup {
		batch.Queue(s.sql.lookup, call.Scope, call.Key)
	}
	batch.Queue(s.sql.savepoint)
	br := conn.SendBatch(ctx, batch)
	if _, err = br.Exec(); err == nil {
		if err = br.QueryRow().Scan(&locked, &started); err == nil {
			if lookup {
				rec, err = scanRecord(br.QueryRow(), nil)
			}
			if err == nil {
				_, err = br.Exec()
			}
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return locked, started, rec, err
}

// probe looks for the key's row and whether its lock is free, outside any
// transaction, on a connection held only for that statement.
func (s *Store) probe(ctx context.Context, call Call) (rec *record, free bool, err error) {
	pc, err := s.db.Acquire(ctx)
	if err != nil {
		return nil, false, err
	}
	defer pc.Release()
	rec, err = scanRecord(pc.QueryRow(ctx, s.sql.probe, call.Scope, call.Key), &free)
	return rec, free, err
}

// finishFailed handles a failed attempt to store the result: the
// transaction is gone, and with it fn's writes.
func (s *Store) finishFailed(ctx context.Context, conn *pgx.Conn, call Call, err error) (Result, next, error) {
	if sqlState(err) == "3B001" { // invalid_savepoint_specification: fn ended the transaction
		res, err := s.handlerEndedTx(ctx, conn, call)
		return res, done, err
	}
	// The outcome may be unknown (the connection died during COMMIT); a
	// retry with the same key replays it if the commit happened, or runs
	// again.
	return Result{Outcome: OutcomeUnavailable}, done, s.finishError("store result", err)
}

// finishError is dbError for the statements that store a call's result:
// they run on a context of their own, so a deadline there is the finish
// timeout, an outage whose outcome may be unknown, not the caller's.
func (s *Store) finishError(op string, err error) error {
	return s.dbError(context.Background(), op, err)
}

// violatedAtCommit handles a COMMIT that failed on a deferred constraint of
// fn's writes: fn's failure, as if fn had returned FailedPrecondition, and
// stored as such when the call's policy makes that code final.
func (s *Store) violatedAtCommit(ctx context.Context, conn *pgx.Conn, call Call, err error) (Result, error) {
	var pgErr *pgconn.PgError
	errors.As(err, &pgErr)
	st := grpcstatus.Newf(codes.FailedPrecondition, "the call's writes violate constraint %s of table %s: %s", pgErr.ConstraintName, pgErr.TableName, pgErr.Message)
	if call.finalCode == nil || !call.finalCode(codes.FailedPrecondition) {
		return Result{Outcome: OutcomeReleased}, st.Err()
	}
	// The call's transaction is gone; keep the key for the error outside
	// any, unless a duplicate ran and stored its own result in between.
	return s.storeOutside(ctx, conn, call, st)
}

// handlerEndedTx finishes a call whose fn ended the call's transaction
// itself: a COMMIT, a ROLLBACK, or a transaction begun and committed on
// tx.Conn(). fn's writes may have committed without the key, so running the
// call again could apply them twice. The key is stored with an Internal
// error, outside any transaction, and every retry gets that error.
func (s *Store) handlerEndedTx(ctx context.Context, conn *pgx.Conn, call Call) (Result, error) {
	if _, err := conn.Exec(ctx, "ROLLBACK"); err != nil { // end a transaction fn may have begun
		return Result{Outcome: OutcomeUnavailable}, s.finishError("store the error of a handler that ended the transaction", err)
	}
	return s.storeOutside(ctx, conn, call, grpcstatus.New(codes.Internal, "idempotency: the handler ended the call's transaction itself (a COMMIT or ROLLBACK statement, "+
		"or a transaction begun on tx.Conn()), so its writes may have been committed without the key; "+
		"the key is kept with this error so that the call does not run again. Handlers must not end the transaction"))
}

// storeOutside stores st as the key's final error outside any transaction,
// unless the key has a row already, and returns it as the call's outcome.
func (s *Store) storeOutside(ctx context.Context, conn *pgx.Conn, call Call, st *grpcstatus.Status) (Result, error) {
	b, err := marshalStatus(st)
	if err == nil {
		_, err = conn.Exec(ctx, s.sql.insertIfAbsent, call.Scope, call.Key, call.Method, call.Fingerprint, "failed", "", []byte(nil), b, call.TTL.Microseconds(), []byte(nil), nil)
	}
	if err != nil {
		return Result{Outcome: OutcomeUnavailable}, s.finishError("store the call's final error", err)
	}
	return Result{Outcome: OutcomeExecuted}, Final(st.Err())
}

// busy ends a wait for the key's holder: the caller's own cancellation, or
// ErrInProgress once the in-progress wait is over.
func (s *Store) busy(ctx context.Context, err error) (Result, error) {
	if ctxErr := ctx.Err(); ctxErr != nil {
		return Result{Outcome: OutcomeInProgress}, contextError{ctxErr}
	}
	return Result{Outcome: OutcomeInProgress}, inProgress("", s.opts.retryDelay)
}

// waiter paces a duplicate's wait for the key's holder: it sleeps, holding
// no connection, 2 ms at first, twice as long each time up to 50 ms, with
// jitter, until the deadline.
type waiter struct {
	deadline time.Time
	pause    time.Duration
	trace    *callTrace
}

var errWaitOver = errors.New("in-progress wait is over")

func (w *waiter) wait(ctx context.Context) error {
	w.pause = min(max(2*w.pause, 2*time.Millisecond), 50*time.Millisecond)
	left := time.Until(w.deadline)
	if left <= 0 {
		return errWaitOver
	}
	d := min(time.Duration(float64(w.pause)*(0.75+0.5*rand.Float64())), left)
	defer w.trace.since(phaseWait, time.Now())
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// sendAll runs a batch of statements that return no rows, in one round
// trip, and fails unless every one succeeded, the COMMIT included (a COMMIT
// of a failed transaction reports ROLLBACK). failed is the index of the
// statement that failed.
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

// sqlState returns the SQLSTATE of a PostgreSQL error, or "".
func sqlState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// record is a key's row.
type record struct {
	method       string
	fingerprint  []byte
	state        string
	responseType *string
	response     []byte
	status       []byte
	metadata     []byte
	expired      bool
}

// scanRecord reads a row of the lookup or, with free set, of the probe;
// rec is nil when the key has no row.
func scanRecord(row pgx.Row, free *bool) (*record, error) {
	var rec record
	var method, state *string // NULL when the probe's outer join found no row
	var expired *bool
	dest := []any{&method, &rec.fingerprint, &state, &rec.responseType, &rec.response, &rec.status, &rec.metadata, &expired}
	if free != nil {
		dest = append([]any{free}, dest...)
	}
	err := row.Scan(dest...)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil, nil
	case err != nil:
		return nil, err
	case method == nil:
		return nil, nil
	}
	rec.method, rec.state, rec.expired = *method, *state, *expired
	return &rec, nil
}

func (s *Store) replay(call Call, rec record) (Result, error) {
	if rec.method != call.Method || !sameRequest(rec.fingerprint, call.Fingerprint) {
		detail := ""
		if rec.method != call.Method {
			detail = "key belongs to method " + rec.method
		}
		return Result{Outcome: OutcomeKeyReused}, ErrKeyReused.with(detail, nil).about(call.Key)
	}
	res := Result{Outcome: OutcomeReplayed, metadata: rec.metadata}
	switch rec.state {
	case "succeeded":
		if rec.responseType == nil || *rec.responseType == "" {
			return res, nil
		}
		m, err := decodeResponse(call, *rec.responseType, rec.response)
		res.Response = m
		return res, err
	case "failed":
		st := &status.Status{}
		if err := proto.Unmarshal(rec.status, st); err != nil {
			return res, grpcstatus.Errorf(codes.Internal, "idempotency: stored status of key %q: %v", call.Key, err)
		}
		if rec.responseType != nil && *rec.responseType != "" {
			m, err := decodeResponse(call, *rec.responseType, rec.response)
			if err != nil {
				return res, err
			}
			res.Response = m
		}
		return res, Final(grpcstatus.FromProto(st).Err())
	default:
		// A 'running' row, committed by an engine before this one in the
		// middle of its call: the call is still in progress.
		return Result{Outcome: OutcomeInProgress}, inProgress("", s.opts.retryDelay)
	}
}

// decodeResponse decodes a stored response with the type the call's method
// declares, when the transport knows it (a dynamic type included), and else
// with the type of that name linked into the binary. A stored type that is
// not the declared one (the method's output changed since the call ran) is
// an error, never bytes decoded as another type.
func decodeResponse(call Call, typeName string, b []byte) (proto.Message, error) {
	mt := call.responseType
	if mt == nil {
		var err error
		if mt, err = protoregistry.GlobalTypes.FindMessageByName(protoreflect.FullName(typeName)); err != nil {
			return nil, grpcstatus.Errorf(codes.Internal, "idempotency: the stored response of key %q is a %s, which is not linked into this binary", call.Key, typeName)
		}
	}
	if declared := mt.Descriptor().FullName(); string(declared) != typeName {
		return nil, grpcstatus.Errorf(codes.Internal, "idempotency: the stored response of key %q is a %s, but %s now returns %s (the method changed since the call ran); it cannot be replayed",
			call.Key, typeName, call.Method, declared)
	}
	m := mt.New().Interface()
	if err := proto.Unmarshal(b, m); err != nil {
		return nil, grpcstatus.Errorf(codes.Internal, "idempotency: the stored response of key %q does not decode as a %s: %v", call.Key, typeName, err)
	}
	return m, nil
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

// marshalStatus encodes a final error for storage. Its message must be
// valid UTF-8 to be encoded at all, so an invalid one is repaired first.
func marshalStatus(st *grpcstatus.Status) ([]byte, error) {
	return proto.Marshal(sanitizeStatus(st.Proto()))
}

// sanitizeStatus replaces each invalid UTF-8 sequence of the message with
// U+FFFD, which protobuf requires of a string field.
func sanitizeStatus(p *status.Status) *status.Status {
	if !utf8.ValidString(p.GetMessage()) {
		p.Message = strings.ToValidUTF8(p.GetMessage(), "\uFFFD")
	}
	return p
}
