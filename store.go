package idempotency

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/genproto/googleapis/rpc/status" // google.rpc.Status, the stored form of a decided error
	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/exactlyonce/idempotency/internal/schema"
)

// DefaultTTL is how long a finished key is kept when a call sets no TTL.
const DefaultTTL = 24 * time.Hour

// DefaultTable is the name of the key table when [WithTable] is not used.
const DefaultTable = "idempotency_keys"

// DB is what a [Store] needs from PostgreSQL: a connection per call, and
// plain statements for cleanup. A *pgxpool.Pool satisfies it and is what a
// server should pass; every call in flight holds one connection for the
// length of its transaction.
type DB interface {
	Acquire(ctx context.Context) (*pgxpool.Conn, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Store keeps idempotency keys and their results in a PostgreSQL table and
// runs calls at most once per key. It is safe for concurrent use, by any
// number of processes sharing the database.
type Store struct {
	db    DB
	ident pgx.Identifier
	opts  storeOptions
	sql   statements
}

// NewStore returns a Store on db. The table must exist: run [Store.Migrate]
// once at startup, or apply [Store.Migrations] with your own tool.
func NewStore(db DB, opts ...StoreOption) (*Store, error) {
	if db == nil {
		return nil, errors.New("idempotency: NewStore: db is nil")
	}
	o := evaluateStoreOptions(opts)
	if err := o.validate(); err != nil {
		return nil, err
	}
	ident := pgx.Identifier{o.table}
	if o.schema != "" {
		ident = pgx.Identifier{o.schema, o.table}
	}
	return &Store{db: db, ident: ident, opts: o, sql: renderStatements(ident.Sanitize())}, nil
}

// Migration is one schema change of the key table, for teams that apply
// migrations with their own tool (goose, Atlas, golang-migrate, ...).
type Migration = schema.Migration

// Migrations returns the SQL that creates and evolves this store's table, in
// order, with the configured table name filled in. [Store.Migrate] applies
// exactly these.
func (s *Store) Migrations() ([]Migration, error) { return schema.Render(s.ident) }

// Migrate brings the key table up to date. It records applied versions in a
// table named like the key table with a "_migrations" suffix and holds an
// advisory lock while it works, so replicas starting together are safe.
func (s *Store) Migrate(ctx context.Context) error {
	migrations, err := s.Migrations()
	if err != nil {
		return err
	}
	versions := append(pgx.Identifier{}, s.ident...)
	versions[len(versions)-1] += "_migrations"
	h := fnv.New64a()
	h.Write([]byte(s.ident.Sanitize()))

	conn, err := s.db.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("idempotency: migrate: %w", err)
	}
	defer conn.Release()
	return pgx.BeginTxFunc(ctx, conn, pgx.TxOptions{}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", int64(h.Sum64())); err != nil {
			return fmt.Errorf("idempotency: migrate: lock: %w", err)
		}
		if _, err := tx.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+versions.Sanitize()+
			" (version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"); err != nil {
			return fmt.Errorf("idempotency: migrate: %w", err)
		}
		for _, m := range migrations {
			tag, err := tx.Exec(ctx, "INSERT INTO "+versions.Sanitize()+" (version, name) VALUES ($1, $2) ON CONFLICT DO NOTHING", m.Version, m.Name)
			if err != nil {
				return fmt.Errorf("idempotency: migrate %s: %w", m.Name, err)
			}
			if tag.RowsAffected() == 0 {
				continue // already applied
			}
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return fmt.Errorf("idempotency: migrate %s: %w", m.Name, err)
			}
		}
		return nil
	})
}

// Call names one execution that must happen at most once.
type Call struct {
	// Scope isolates keys: the same key in two scopes names two calls. Use
	// the authenticated caller (tenant, client ID) so one caller can never
	// see another's results.
	Scope string
	// Key is the idempotency key chosen by the client: 1 to 255 printable
	// ASCII characters (see [ValidateKey]).
	Key string
	// Method names the operation, e.g. the full gRPC method. A key first used
	// for one method is rejected for any other with [ErrKeyReused].
	Method string
	// Fingerprint identifies the request body (e.g. [Fingerprint]). The same
	// key with a different fingerprint is rejected with [ErrKeyReused].
	Fingerprint []byte
	// TTL is how long the key is kept, counted from the start of the call
	// (a call that outlasts it keeps its key a full TTL from when it
	// finished). Defaults to [DefaultTTL].
	TTL time.Duration
}

// Func is the work done at most once per key. tx is the call's transaction:
// everything written through it commits together with the stored result, or
// not at all. Func must not commit or roll back tx; the returned error does
// that. The same tx is available to code deeper in the call through
// [TxFromContext].
type Func func(ctx context.Context, tx pgx.Tx) (proto.Message, error)

// Outcome says what [Store.Execute] did with a call.
type Outcome int

// Outcomes of [Store.Execute].
const (
	// OutcomeExecuted: the key was new; Func ran and its result committed.
	OutcomeExecuted Outcome = iota + 1
	// OutcomeReplayed: the key was finished; its stored result was returned
	// and Func did not run.
	OutcomeReplayed
	// OutcomeReleased: Func ran and failed with a retryable error; the
	// transaction rolled back and the key is free again.
	OutcomeReleased
	// OutcomeInProgress: another call held the key past the wait ([ErrInProgress]).
	OutcomeInProgress
	// OutcomeKeyReused: the key belongs to another request ([ErrKeyReused]).
	OutcomeKeyReused
	// OutcomeRejected: the call was malformed, e.g. an invalid key ([ErrInvalidKey]).
	OutcomeRejected
	// OutcomeUnavailable: the database failed ([ErrStoreUnavailable]).
	OutcomeUnavailable
)

var outcomeNames = [...]string{"unknown", "executed", "replayed", "released", "in progress", "key reused", "rejected", "unavailable"}

// String returns a lower-case name such as "replayed", for logs.
func (o Outcome) String() string {
	if o < 0 || int(o) >= len(outcomeNames) {
		return outcomeNames[0]
	}
	return outcomeNames[o]
}

// Result is what a call returned, fresh or replayed.
type Result struct {
	// Response is the message Func returned, or its stored copy on replay.
	// It is nil when the call ended in an error or Func returned nil.
	Response proto.Message
	// Outcome says whether Func ran, was replayed, or why neither.
	Outcome Outcome
}

// Final marks an error returned by a [Func] as the call's decided outcome:
// the transaction's business writes roll back, but the key commits with the
// error (as a google.rpc.Status, details included), and every retry gets the
// same error without running Func again. Unmarked errors release the key.
// Final(nil) is nil.
//
// [Store.Execute] returns decided errors still marked, the first time and on
// every replay, so [IsFinal] tells them from errors that released the key.
func Final(err error) error {
	if err == nil {
		return nil
	}
	return &finalError{err}
}

// IsFinal reports whether err is a decided outcome made with [Final]: it is
// recorded with the key, and retrying with the same key returns it again.
func IsFinal(err error) bool {
	var f *finalError
	return errors.As(err, &f)
}

// unwrapFinal removes the [Final] mark, leaving the error as fn returned it.
func unwrapFinal(err error) error {
	var f *finalError
	if errors.As(err, &f) {
		return f.err
	}
	return err
}

type finalError struct{ err error }

func (f *finalError) Error() string { return f.err.Error() }
func (f *finalError) Unwrap() error { return f.err }

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
	e := ErrInProgress.with("the key expired while it was being claimed", nil)
	e.retryDelay = s.opts.retryDelay
	return Result{Outcome: OutcomeInProgress}, e
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
			e := ErrInProgress.with("", nil)
			e.retryDelay = s.opts.retryDelay
			return Result{Outcome: OutcomeInProgress}, false, e
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
	resp, fnErr := fn(context.WithValue(context.WithValue(ctx, txKey{}, htx), keyKey{}, call.Key), htx)

	// From here the outcome is decided; finish it even if the caller left.
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
		e := ErrKeyReused.with("", nil)
		if rec.method != call.Method {
			e.detail = fmt.Sprintf("key belongs to method %s", rec.method)
		}
		e.violation = call.Key
		return Result{Outcome: OutcomeKeyReused}, e
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
		e := ErrInProgress.with("", nil)
		e.retryDelay = s.opts.retryDelay
		return Result{Outcome: OutcomeInProgress}, e
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

// contextError is the caller's own cancellation or deadline: errors.Is
// matches the context error, and gRPC sends Canceled or DeadlineExceeded.
type contextError struct{ err error }

func (e contextError) Error() string                  { return "idempotency: " + e.err.Error() }
func (e contextError) Unwrap() error                  { return e.err }
func (e contextError) GRPCStatus() *grpcstatus.Status { return grpcstatus.FromContextError(e.err) }

// DeleteExpired deletes up to limit expired keys and reports how many it
// deleted, oldest first. Cleaners on several replicas may run at once: a
// batch only ever deletes keys that are expired when it runs.
func (s *Store) DeleteExpired(ctx context.Context, limit int) (int64, error) {
	if limit <= 0 {
		return 0, fmt.Errorf("idempotency: DeleteExpired: limit must be positive, got %d", limit)
	}
	tag, err := s.db.Exec(ctx, s.sql.deleteExpired, limit)
	if err != nil {
		return 0, fmt.Errorf("idempotency: delete expired keys: %w", err)
	}
	return tag.RowsAffected(), nil
}

// RunCleaner deletes expired keys every interval, in batches of batchSize,
// until ctx is done; then it returns ctx's error. Errors from single rounds
// are passed to onError when it is not nil, and the cleaner keeps going.
// Run it in its own goroutine; one per replica is fine.
//
// A round deletes batches until one comes back short. While a backlog lasts
// (after downtime, or a TTL shortened), it pauses between batches for nine
// times as long as the last batch took, so it spends at most a tenth of its
// time deleting and never competes hard with the calls it serves.
func (s *Store) RunCleaner(ctx context.Context, interval time.Duration, batchSize int, onError func(error)) error {
	if interval <= 0 || batchSize <= 0 {
		return fmt.Errorf("idempotency: RunCleaner: interval and batch size must be positive")
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		for {
			start := time.Now()
			n, err := s.DeleteExpired(ctx, batchSize)
			if err != nil && ctx.Err() == nil && onError != nil {
				onError(err)
			}
			if err != nil || n < int64(batchSize) {
				break
			}
			pause := time.NewTimer(9 * time.Since(start))
			select {
			case <-ctx.Done():
				pause.Stop()
				return ctx.Err()
			case <-pause.C:
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// TxFromContext returns the transaction of the idempotent call running in
// ctx. Handlers write through it so their business changes commit together
// with the stored response. The transaction's Commit and Rollback return
// [ErrTxOwned]; nested transactions (savepoints) work as usual.
func TxFromContext(ctx context.Context) (pgx.Tx, bool) {
	tx, ok := ctx.Value(txKey{}).(pgx.Tx)
	return tx, ok
}

// MustTxFromContext is [TxFromContext] for code that only runs inside an
// idempotent call. It panics when ctx has no transaction: the call is not
// protected (no key, or the interceptor is missing) and writing outside the
// transaction would break the exactly-once guarantee.
func MustTxFromContext(ctx context.Context) pgx.Tx {
	tx, ok := TxFromContext(ctx)
	if !ok {
		panic("idempotency: no idempotent call in context: is the interceptor installed and did the call carry a key?")
	}
	return tx
}

type txKey struct{}

// KeyFromContext returns the idempotency key of the call running in ctx. A
// handler that calls another system (a payment provider, another service)
// cannot take that system's effect into its transaction; it passes this key
// along so the other system deduplicates the retries too.
func KeyFromContext(ctx context.Context) (string, bool) {
	k, ok := ctx.Value(keyKey{}).(string)
	return k, ok
}

type keyKey struct{}

// MaxKeyLen is the longest valid idempotency key, in bytes.
const MaxKeyLen = 255

// ValidateKey reports whether key is a valid idempotency key: 1 to
// [MaxKeyLen] characters, each printable ASCII (0x21 to 0x7E). A UUID is a
// good key. The error is [ErrInvalidKey] with the reason.
func ValidateKey(key string) error {
	if key == "" {
		return invalidKey("key is empty")
	}
	if len(key) > MaxKeyLen {
		return invalidKey(fmt.Sprintf("key is %d bytes long, the limit is %d", len(key), MaxKeyLen))
	}
	for i := 0; i < len(key); i++ {
		if c := key[i]; c < 0x21 || c > 0x7e {
			return invalidKey(fmt.Sprintf("byte %d is %s; only printable ASCII 0x21-0x7E is allowed", i, describeByte(key, i)))
		}
	}
	return nil
}

func invalidKey(detail string) error { return invalidKeyField(MetadataKey, detail) }

// invalidKeyField is ErrInvalidKey with a BadRequest violation naming field:
// the metadata key, or the request field a method takes its key from.
func invalidKeyField(field, detail string) error {
	e := ErrInvalidKey.with(detail, nil)
	e.violation = field
	return e
}

func describeByte(s string, i int) string {
	if r, _ := utf8.DecodeRuneInString(s[i:]); r != utf8.RuneError && r >= 0x80 {
		return fmt.Sprintf("non-ASCII %q", r)
	}
	return fmt.Sprintf("0x%02X", s[i])
}

// statements are the SQL texts of a store, rendered once for its table.
type statements struct {
	claim, readKey, savepoint, rollbackHandler string
	storeResponse, storeError                  string
	deleteExpiredKey, deleteExpired            string
}

func renderStatements(table string) statements {
	r := strings.NewReplacer("{{table}}", table)
	return statements{
		// The CTE sets lock_timeout before the insert can wait on a concurrent
		// claimer, and the first branch restores it once a row was inserted.
		// The second branch returns the existing row when one was visible.
		claim: r.Replace(`WITH cfg AS MATERIALIZED (
	SELECT current_setting('lock_timeout') AS prev, set_config('lock_timeout', $6, true) AS cur
), ins AS (
	INSERT INTO {{table}} (scope, key, method, fingerprint, state, expires_at)
	SELECT $1, $2, $3, $4, 'running', now() + $5 * interval '1 microsecond' FROM cfg
	ON CONFLICT (scope, key) DO NOTHING
	RETURNING 1
)
SELECT true, set_config('lock_timeout', cfg.prev, true), '', ''::bytea, 'running', NULL::text, NULL::bytea, NULL::bytea, false
FROM ins, cfg
UNION ALL
SELECT false, NULL, k.method, k.fingerprint, k.state, k.response_type, k.response, k.status, k.expires_at <= now()
FROM {{table}} k
WHERE k.scope = $1 AND k.key = $2 AND NOT EXISTS (SELECT FROM ins)`),
		readKey: r.Replace(`SELECT method, fingerprint, state, response_type, response, status, expires_at <= now()
FROM {{table}} WHERE scope = $1 AND key = $2`),
		savepoint:       "SAVEPOINT idempotency_call",
		rollbackHandler: "ROLLBACK TO SAVEPOINT idempotency_call",
		// The TTL counts from the start of the call. A call that outlasted
		// it would commit a key already expired, so that one is kept a full
		// TTL from when it finished. expires_at is otherwise left as it is,
		// which keeps this update heap-only (HOT): no new index entries.
		storeResponse: r.Replace(`UPDATE {{table}}
SET state = 'succeeded', response_type = NULLIF($4, ''), response = $5, completed_at = clock_timestamp(),
    expires_at = CASE WHEN expires_at > clock_timestamp() THEN expires_at
                      ELSE clock_timestamp() + $3 * interval '1 microsecond' END
WHERE scope = $1 AND key = $2`),
		storeError: r.Replace(`UPDATE {{table}}
SET state = 'failed', status = $4, completed_at = clock_timestamp(),
    expires_at = CASE WHEN expires_at > clock_timestamp() THEN expires_at
                      ELSE clock_timestamp() + $3 * interval '1 microsecond' END
WHERE scope = $1 AND key = $2`),
		deleteExpiredKey: r.Replace(`DELETE FROM {{table}} WHERE scope = $1 AND key = $2 AND expires_at <= now()`),
		// No FOR UPDATE: locking each row first would write a lock record
		// per key to the WAL on top of its delete. Two cleaners racing for
		// the same rows only means one of them deletes fewer.
		deleteExpired: r.Replace(`DELETE FROM {{table}}
WHERE ctid = ANY (ARRAY(SELECT ctid FROM {{table}} WHERE expires_at <= now() ORDER BY expires_at LIMIT $1))
AND expires_at <= now()`),
	}
}
