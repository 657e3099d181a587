package idempotency

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
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
//   - A new key is claimed with INSERT ... ON CONFLICT DO NOTHING, fn runs, and
//     its response is stored in the same transaction as fn's own writes.
//     Result.Outcome is OutcomeExecuted.
//   - A finished key with the same method and fingerprint returns the stored
//     response, or the stored [Final] error, without running fn
//     (OutcomeReplayed).
//   - A key held by a call still running: Execute waits up to the store's
//     in-progress wait for it to finish, then returns its result, runs fn if
//     the holder failed, or returns [ErrInProgress].
//   - A finished key with another method or fingerprint: [ErrKeyReused].
//   - fn returns an error not marked [Final], or panics: everything rolls
//     back, no key is left behind, and the error (or panic) is passed on.
//   - The database fails before the outcome is known: [ErrStoreUnavailable].
//
// The result is committed with a context that ignores ctx's cancellation,
// so a caller that goes away after fn succeeded still finds its result
// stored when it retries.
func (s *Store) Execute(ctx context.Context, call Call, fn Func) (Result, error) {
	if err := ValidateKey(call.Key); err != nil {
		return Result{Outcome: OutcomeRejected}, err
	}
	if call.Method == "" {
		return Result{Outcome: OutcomeRejected}, errors.New("idempotency: Call.Method is empty")
	}
	if !utf8.ValidString(call.Scope) || strings.IndexByte(call.Scope, 0) >= 0 {
		// PostgreSQL text cannot hold it; fail now rather than as an outage
		// that clients would retry forever.
		return Result{Outcome: OutcomeRejected}, grpcstatus.Error(codes.InvalidArgument, "idempotency: scope is not valid UTF-8 or contains a NUL byte")
	}
	if call.TTL <= 0 {
		call.TTL = DefaultTTL
	}
	if call.Fingerprint == nil {
		call.Fingerprint = []byte{}
	}
	pc, err := s.db.Acquire(ctx)
	if err != nil {
		return Result{Outcome: OutcomeUnavailable}, s.unavailable(ctx, "acquire connection", err)
	}
	// Release returns the connection to the pool, or destroys it if a
	// failure left it inside a transaction.
	defer pc.Release()
	conn := pc.Conn()

	// A finished key that expired is deleted and the call tried again. A
	// key that keeps expiring under us (a TTL shorter than the calls that
	// use it, or a cleaner racing the claim) is reported as in progress, so
	// the caller retries later rather than getting no result at all.
	for attempt := 0; attempt < 3; attempt++ {
		res, expired, err := s.execute(ctx, conn, call, fn)
		if !expired {
			return res, err
		}
		if _, err := conn.Exec(ctx, s.sql.deleteExpiredKey, call.Scope, call.Key); err != nil {
			return Result{Outcome: OutcomeUnavailable}, s.unavailable(ctx, "delete expired key", err)
		}
	}
	return Result{Outcome: OutcomeInProgress}, inProgress("the key expired while it was being claimed", s.opts.retryDelay)
}

func (s *Store) execute(ctx context.Context, conn *pgx.Conn, call Call, fn Func) (res Result, expired bool, err error) {
	// The common retry, of a call that finished, costs one read and no
	// transaction. This is only a shortcut: a key it does not find is still
	// claimed atomically below, and races are settled there.
	rec, found, err := s.lookup(ctx, conn, call)
	if err != nil {
		return Result{Outcome: OutcomeUnavailable}, false, s.unavailable(ctx, "look up key", err)
	}
	if found {
		if rec.expired {
			return Result{}, true, nil
		}
		res, err := s.replay(call, rec)
		return res, false, err
	}

	done := false
	defer func() {
		// Runs on every path that did not commit, panics included. The
		// rollback must happen even when ctx is cancelled, or the key stays
		// locked until the connection is reaped.
		if !done {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.opts.finishTimeout)
			defer cancel()
			_, _ = conn.Exec(rctx, "ROLLBACK")
		}
	}()

	rec, claimed, err := s.claim(ctx, conn, call)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available: lock_timeout fired
			return Result{Outcome: OutcomeInProgress}, false, inProgress("", s.opts.retryDelay)
		}
		return Result{Outcome: OutcomeUnavailable}, false, s.unavailable(ctx, "claim", err)
	}
	if !claimed {
		if rec.expired {
			return Result{}, true, nil
		}
		res, err := s.replay(call, rec)
		return res, false, err
	}

	htx := &callTx{conn: conn}
	resp, fnErr := fn(withCall(ctx, htx, call.Key), htx)

	// From here the outcome is known; finish it even if the caller left.
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.opts.finishTimeout)
	defer cancel()
	batch := &pgx.Batch{}
	var final *finalError
	switch {
	case fnErr == nil:
		var typ string
		var b []byte
		if resp != nil {
			typ = string(resp.ProtoReflect().Descriptor().FullName())
			if b, err = (proto.MarshalOptions{Deterministic: true}).Marshal(resp); err != nil {
				return Result{Outcome: OutcomeReleased}, false, fmt.Errorf("idempotency: marshal response: %w", err)
			}
		}
		batch.Queue(s.sql.storeResponse, call.Scope, call.Key, call.TTL.Microseconds(), typ, b)
	case errors.As(fnErr, &final):
		b, err := proto.Marshal(grpcstatus.Convert(final.err).Proto())
		if err != nil {
			return Result{Outcome: OutcomeReleased}, false, fmt.Errorf("idempotency: marshal status: %w", err)
		}
		// On its own, before the batch: if fn's statements failed, the
		// transaction is aborted and PostgreSQL would refuse to prepare the
		// batch's UPDATE until the savepoint is rolled back.
		if _, err := conn.Exec(fctx, s.sql.rollbackHandler); err != nil {
			return Result{Outcome: OutcomeUnavailable}, false, ErrStoreUnavailable.with("store result", err)
		}
		batch.Queue(s.sql.storeError, call.Scope, call.Key, call.TTL.Microseconds(), b)
	case conn.IsClosed():
		// fn failed because the database connection died under it: report
		// an outage, not fn's raw driver error, so clients retry.
		return Result{Outcome: OutcomeUnavailable}, false, ErrStoreUnavailable.with("connection lost during the call", fnErr)
	default:
		return Result{Outcome: OutcomeReleased}, false, fnErr
	}
	batch.Queue("COMMIT")
	if err := sendAll(fctx, conn, batch); err != nil {
		// Reported as an outage even if fctx timed out: the caller's own
		// deadline is not what failed. The outcome is unknown; a retry with
		// the same key replays it if the commit happened, or runs again.
		return Result{Outcome: OutcomeUnavailable}, false, ErrStoreUnavailable.with("store result", err)
	}
	done = true
	return Result{Response: resp, Outcome: OutcomeExecuted}, false, fnErr
}

// sendAll runs a batch of statements that return no rows, in one round
// trip, and fails unless every one succeeded. A COMMIT that PostgreSQL turned
// into a ROLLBACK (the transaction had failed) is a failure, and so is an
// UPDATE of the key that found no row: fn ended the transaction itself
// (with a raw COMMIT or ROLLBACK), so its writes and the key did not commit
// together.
func sendAll(ctx context.Context, conn *pgx.Conn, b *pgx.Batch) error {
	br := conn.SendBatch(ctx, b)
	var failed error
	for i, q := range b.QueuedQueries {
		tag, err := br.Exec()
		switch {
		case err != nil:
			failed = err
		case q.SQL == "COMMIT" && tag.String() != "COMMIT":
			failed = fmt.Errorf("transaction rolled back at statement %d: COMMIT returned %s", i+1, tag)
		case tag.Update() && tag.RowsAffected() != 1:
			failed = fmt.Errorf("the key's row was not in the call's transaction when its result was stored: did the handler end the transaction?")
		}
		if failed != nil {
			_ = br.Close()
			return failed
		}
	}
	return br.Close()
}

// record is a key row found by a lookup or a claim that did not insert.
type record struct {
	method       string
	fingerprint  []byte
	state        string
	responseType *string
	response     []byte
	status       []byte
	expired      bool
}

func (s *Store) lookup(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, call Call) (rec record, found bool, err error) {
	err = q.QueryRow(ctx, s.sql.readKey, call.Scope, call.Key).Scan(
		&rec.method, &rec.fingerprint, &rec.state, &rec.responseType, &rec.response, &rec.status, &rec.expired)
	if errors.Is(err, pgx.ErrNoRows) {
		return rec, false, nil
	}
	return rec, err == nil, err
}

// claim opens the call's transaction and inserts the key or, when it
// exists, reads it, in one round trip. The insert waits for a concurrent
// claimer of the same key (the unique index makes it) for at most the
// in-progress wait; lock_timeout bounds that wait, and is restored before fn
// runs so fn's own statements are unaffected. A savepoint is taken in the
// same round trip so that a Final error can undo fn's writes and keep the
// claim.
func (s *Store) claim(ctx context.Context, conn *pgx.Conn, call Call) (rec record, claimed bool, err error) {
	batch := &pgx.Batch{}
	batch.Queue("BEGIN ISOLATION LEVEL READ COMMITTED")
	batch.Queue(s.sql.claim, call.Scope, call.Key, call.Method, call.Fingerprint,
		call.TTL.Microseconds(), fmt.Sprintf("%dms", max(1, s.opts.inProgressWait.Milliseconds())))
	batch.Queue(s.sql.savepoint)
	br := conn.SendBatch(ctx, batch)
	found := false
	if _, err = br.Exec(); err == nil {
		found, err = scanClaim(br.QueryRow(), &rec, &claimed)
	}
	if err != nil {
		_ = br.Close()
		return rec, false, err
	}
	if err := br.Close(); err != nil {
		return rec, false, err
	}
	if found {
		return rec, claimed, nil
	}
	// The insert conflicted with a row committed after this statement's
	// snapshot was taken: it waited for a concurrent claimer that then
	// committed. A new statement sees that row.
	rec, found, err = s.lookup(ctx, conn, call)
	if err == nil && !found {
		// Deleted by the cleaner in between: expired, so start over.
		rec.expired = true
	}
	return rec, false, err
}

func scanClaim(row pgx.Row, rec *record, claimed *bool) (bool, error) {
	var restored *string
	err := row.Scan(claimed, &restored, &rec.method, &rec.fingerprint, &rec.state, &rec.responseType, &rec.response, &rec.status, &rec.expired)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	return err == nil, err
}

func (s *Store) replay(call Call, rec record) (Result, error) {
	if rec.method != call.Method || !bytes.Equal(rec.fingerprint, call.Fingerprint) {
		detail := ""
		if rec.method != call.Method {
			detail = "key belongs to method " + rec.method
		}
		return Result{Outcome: OutcomeKeyReused}, ErrKeyReused.with(detail, nil).about(call.Key)
	}
	switch rec.state {
	case "succeeded":
		if rec.responseType == nil || *rec.responseType == "" {
			return Result{Outcome: OutcomeReplayed}, nil
		}
		mt, err := protoregistry.GlobalTypes.FindMessageByName(protoreflect.FullName(*rec.responseType))
		if err != nil {
			return Result{Outcome: OutcomeReplayed}, grpcstatus.Errorf(codes.Internal, "idempotency: stored response type %s is not linked into this binary", *rec.responseType)
		}
		m := mt.New().Interface()
		if err := proto.Unmarshal(rec.response, m); err != nil {
			return Result{Outcome: OutcomeReplayed}, grpcstatus.Errorf(codes.Internal, "idempotency: stored response: %v", err)
		}
		return Result{Response: m, Outcome: OutcomeReplayed}, nil
	case "failed":
		st := &status.Status{}
		if err := proto.Unmarshal(rec.status, st); err != nil {
			return Result{Outcome: OutcomeReplayed}, grpcstatus.Errorf(codes.Internal, "idempotency: stored status: %v", err)
		}
		return Result{Outcome: OutcomeReplayed}, Final(grpcstatus.FromProto(st).Err())
	default:
		// Unreachable while claims and results commit together; kept so a row
		// written by some other tool cannot be replayed as a success.
		return Result{Outcome: OutcomeInProgress}, inProgress("", s.opts.retryDelay)
	}
}

// unavailable wraps a database error. A cancelled or expired ctx is reported
// as such (the caller gave up; the database may be fine).
func (s *Store) unavailable(ctx context.Context, op string, err error) error {
	if ctxErr := ctx.Err(); ctxErr != nil && errors.Is(err, ctxErr) {
		return contextError{ctxErr}
	}
	return ErrStoreUnavailable.with(op, err)
}
