package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// Every error a client can see tells the truth: Unavailable only where a
// retry can help, and what an operator must do where it cannot.

func TestNeverMigratedIsAConfigurationError(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	store, err := idempotency.NewStore(db.Pool) // no Migrate
	require.NoError(t, err)
	ran := false
	res, err := store.Execute(context.Background(), idempotency.Call{Key: "k", Method: "m"},
		func(context.Context, pgx.Tx) (proto.Message, error) { ran = true; return nil, nil })
	require.Equal(t, codes.Internal, status.Code(err), "%v", err)
	require.Contains(t, status.Convert(err).Message(), `key table "idempotency_keys" does not exist: run Store.Migrate`)
	require.Equal(t, idempotency.OutcomeMisconfigured, res.Outcome, "an operator must act; not an outage")
	require.False(t, ran, "nothing runs without a key table")
	require.False(t, errors.Is(err, idempotency.ErrStoreUnavailable))
}

func TestUnstorableCallsAreRejectedUpFront(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	store := migratedStore(t, db)
	run := func(context.Context, pgx.Tx) (proto.Message, error) { t.Error("ran"); return nil, nil }
	for name, call := range map[string]idempotency.Call{
		"scope over the limit":      {Scope: strings.Repeat("s", idempotency.MaxScopeLen+1), Key: "k", Method: "m"},
		"scope at PostgreSQL limit": {Scope: strings.Repeat("s", 3000), Key: "k", Method: "m"},
		"non-UTF-8 method":          {Key: "k", Method: "/svc/\xffM"},
		"NUL in method":             {Key: "k", Method: "/svc/\x00M"},
	} {
		res, err := store.Execute(context.Background(), call, run)
		require.Equal(t, codes.InvalidArgument, status.Code(err), "%s: %v", name, err)
		require.Equal(t, idempotency.OutcomeRejected, res.Outcome, name)
	}
	res, err := store.Execute(context.Background(), idempotency.Call{Scope: strings.Repeat("s", idempotency.MaxScopeLen), Key: strings.Repeat("k", idempotency.MaxKeyLen), Method: "m"},
		func(context.Context, pgx.Tx) (proto.Message, error) { return nil, nil })
	require.NoError(t, err, "the longest scope with the longest key fits")
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
}

// A deferred constraint the handler's writes violate is found at COMMIT.
// It is the handler's failure, FailedPrecondition, not an outage: through
// the interceptor (FailedPrecondition is final there) it is stored and the
// handler never runs again; for a message too, which is dead-lettered
// instead of redelivered forever (TestMessageThatCanNeverCommitIsDeadLettered).
func TestDeferredConstraintAtCommitIsTheHandlersFailure(t *testing.T) {
	t.Parallel()
	var e *env
	e = newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		return e.insertLedger(ctx, req)
	}})
	ctx := context.Background()
	_, err := e.db.Pool.Exec(ctx, `ALTER TABLE ledger ADD CONSTRAINT note_not_bad CHECK (note <> 'bad') NOT VALID;
CREATE TABLE audit (note text UNIQUE DEFERRABLE INITIALLY DEFERRED);
CREATE FUNCTION audit_note() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN INSERT INTO audit VALUES ('same'); RETURN NEW; END $$;
CREATE TRIGGER audit_note AFTER INSERT ON ledger FOR EACH ROW EXECUTE FUNCTION audit_note()`)
	require.NoError(t, err)
	require.NoError(t, e.call(ctx, methodCharge, "first", "x").err, "the first audit row")

	r := e.call(ctx, methodCharge, "second", "y") // its audit row collides at COMMIT
	require.Equal(t, codes.FailedPrecondition, status.Code(r.err), "%v", r.err)
	require.Contains(t, r.err.Error(), "audit_note_key")
	again := e.call(ctx, methodCharge, "second", "y")
	require.Equal(t, codes.FailedPrecondition, status.Code(again.err))
	require.True(t, again.replayed, "final: stored and replayed")
	require.EqualValues(t, 2, e.runs.Load(), "the handler did not run again")
	require.Equal(t, 1, e.ledgerRows())

	o, err := e.store.ProcessMessage(ctx, idempotency.Message{ID: "m-1"}, func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('z')`)
		return err
	})
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	require.Equal(t, idempotency.OutcomeExecuted, o, "the message's failure is stored")
	require.True(t, idempotency.IsFinal(err))
	require.Equal(t, idempotency.DeadLetter, idempotency.DispositionOf(o, err))
}

// With statement_timeout shorter than the in-progress wait, a duplicate
// still gets the first call's result: no statement waits for a lock.
func TestStatementTimeoutShorterThanTheWait(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	pool := schemaPool(t, db.Schema, 4, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["statement_timeout"] = "300ms" })
	holding := make(chan struct{})
	srv := startReplica(t, pool, replicaConfig{
		storeOpts: []idempotency.StoreOption{idempotency.WithInProgressWait(liveness)},
		handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			resp, err := keyedLedger(ctx, req)
			if req.GetValue() == "slow" {
				close(holding)
				time.Sleep(time.Second) // past statement_timeout, within the wait
			}
			return resp, err
		},
	})
	conn := dial(t, srv.addr)
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "k")
	first := make(chan reply, 1)
	go func() { first <- invoke(ctx, conn, methodCharge, "slow") }()
	await(t, holding, "the first call's handler to run")
	dup := invoke(ctx, conn, methodCharge, "slow")
	require.NoError(t, dup.err, "a duplicate outwaits statement_timeout")
	require.True(t, dup.replayed)
	require.NoError(t, await(t, first, "the first call").err)
}

// A handler cut short by the caller's deadline: DeadlineExceeded, nothing
// committed, the key free. The deadline passes while the handler's
// statement runs in PostgreSQL, whatever the machine's speed.
func TestHandlerPastItsDeadline(t *testing.T) {
	t.Parallel()
	var e *env
	var outcome atomic.Value
	var pid atomic.Uint32 // the backend running the handler's statement
	sleep := func(ctx context.Context, tx pgx.Tx) error {
		var p uint32 // through tx: a handler that touches tx.Conn() is held to a stricter rule
		if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&p); err != nil {
			return err
		}
		pid.Store(p)
		_, err := tx.Exec(ctx, `SELECT pg_sleep(60)`)
		return err
	}
	var cue *deadlineCue
	e = newEnv(t, envConfig{
		handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			if _, err := e.insertLedger(ctx, req); err != nil {
				return nil, err
			}
			return wrapperspb.String("late"), sleep(ctx, idempotency.MustTxFromContext(ctx))
		},
		tracer: endTracer(func(_ context.Context, data idempotency.TraceCallEndData) {
			outcome.Store([2]any{data.Outcome, status.Code(data.Err)})
		}),
		// A server-side timeout, as a handler-timeout middleware sets one.
		interceptors: []grpc.UnaryServerInterceptor{func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			return h(cue.wrap(ctx), req)
		}},
	})
	cue = newDeadlineCue()
	replied := make(chan reply, 1)
	go func() { replied <- e.call(context.Background(), methodCharge, "k", "x") }()
	cue.expireWhenSleeping(t, e.db, &pid)
	r := await(t, replied, "the call")
	require.Equal(t, codes.DeadlineExceeded, status.Code(r.err), "%v", r.err)
	require.Eventually(t, func() bool { return outcome.Load() != nil }, liveness, 5*time.Millisecond)
	require.Equal(t, [2]any{idempotency.OutcomeReleased, codes.DeadlineExceeded}, outcome.Load(), "the server reports the deadline, not an outage")
	require.Equal(t, 0, e.ledgerRows())
	require.Equal(t, 0, e.keyRows())

	// The same through the engine.
	pid.Store(0)
	cue = newDeadlineCue()
	type executed struct {
		res idempotency.Result
		err error
	}
	done := make(chan executed, 1)
	go func() {
		res, err := e.store.Execute(cue.wrap(context.Background()), idempotency.Call{Key: "k2", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			return nil, sleep(ctx, tx)
		})
		done <- executed{res, err}
	}()
	cue.expireWhenSleeping(t, e.db, &pid)
	x := await(t, done, "Execute")
	require.ErrorIs(t, x.err, context.DeadlineExceeded)
	require.Equal(t, codes.DeadlineExceeded, status.Code(x.err))
	require.Equal(t, idempotency.OutcomeReleased, x.res.Outcome)
}

// deadlineCue makes contexts whose deadline passes when the test says so:
// Err is context.DeadlineExceeded once expired, as a timer's would be.
type deadlineCue struct {
	done chan struct{}
	once sync.Once
}

func newDeadlineCue() *deadlineCue { return &deadlineCue{done: make(chan struct{})} }

func (c *deadlineCue) wrap(parent context.Context) context.Context {
	return cuedContext{Context: parent, cue: c}
}

func (c *deadlineCue) expire() { c.once.Do(func() { close(c.done) }) }

// expireWhenSleeping expires the cue once the backend in pid is inside the
// handler's pg_sleep.
func (c *deadlineCue) expireWhenSleeping(t *testing.T, db *testdb.DB, pid *atomic.Uint32) {
	t.Helper()
	defer c.expire() // a failed wait must not leave the call sleeping
	require.Eventually(t, func() bool {
		p := pid.Load()
		return p != 0 && db.Count(t, fmt.Sprintf(`SELECT count(*) FROM pg_stat_activity WHERE pid = %d AND wait_event = 'PgSleep'`, p)) == 1
	}, liveness, time.Millisecond, "the handler's statement to run")
}

type cuedContext struct {
	context.Context
	cue *deadlineCue
}

func (c cuedContext) Deadline() (time.Time, bool) { return time.Now().Add(time.Hour), true }

func (c cuedContext) Done() <-chan struct{} { return c.cue.done }

func (c cuedContext) Err() error {
	select {
	case <-c.cue.done:
		return context.DeadlineExceeded
	default:
		return c.Context.Err()
	}
}

// A validation failure does not use up the key: the corrected request can
// be sent with it (InvalidArgument is not final by default).
func TestValidationFailureReleasesTheKey(t *testing.T) {
	t.Parallel()
	var e *env
	e = newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		if req.GetValue() == "" {
			return nil, status.Error(codes.InvalidArgument, "note is required")
		}
		return e.insertLedger(ctx, req)
	}})
	ctx := context.Background()
	r := e.call(ctx, methodCharge, "k", "")
	require.Equal(t, codes.InvalidArgument, status.Code(r.err))
	require.Equal(t, 0, e.keyRows())
	r = e.call(ctx, methodCharge, "k", "fixed")
	require.NoError(t, r.err, "the corrected request, same key")
	require.False(t, r.replayed)
	require.True(t, e.call(ctx, methodCharge, "k", "fixed").replayed)
}

// A key sent as binary metadata is not silently ignored.
func TestBinaryKeyIsRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{opts: []idempotency.ServerOption{idempotency.WithKeyRequired()}})
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey+"-bin", "k")
	r := invoke(ctx, e.conn, methodCharge, "x")
	require.Equal(t, codes.InvalidArgument, status.Code(r.err))
	require.Contains(t, status.Convert(r.err).Message(), "send it as the text metadata idempotency-key")
	require.Equal(t, idempotency.MetadataKey+"-bin", badRequestField(t, r.err))
	require.EqualValues(t, 0, e.runs.Load())

	r = e.call(context.Background(), methodCharge, "", "x")
	require.Equal(t, codes.InvalidArgument, status.Code(r.err))
	require.Contains(t, status.Convert(r.err).Message(), "send it in the idempotency-key metadata", "the missing-key error names the header")

	optional := newEnv(t, envConfig{})
	r = invoke(ctx, optional.conn, methodCharge, "x")
	require.Equal(t, codes.InvalidArgument, status.Code(r.err), "refused even where a key is optional: the caller meant to send one")
	require.EqualValues(t, 0, optional.runs.Load())
}

// A final error whose message is not valid UTF-8 is stored (repaired) and
// replayed, instead of failing to store and running again on every retry.
func TestFinalErrorWithInvalidUTF8IsStored(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		return nil, status.Error(codes.FailedPrecondition, "account \xff\xfe frozen")
	}})
	ctx := context.Background()
	first := e.call(ctx, methodCharge, "k", "x")
	require.Equal(t, codes.FailedPrecondition, status.Code(first.err), "%v", first.err)
	again := e.call(ctx, methodCharge, "k", "x")
	require.Equal(t, codes.FailedPrecondition, status.Code(again.err))
	require.True(t, again.replayed)
	require.Equal(t, "account \uFFFD frozen", status.Convert(again.err).Message())
	require.Equal(t, status.Convert(first.err).Message(), status.Convert(again.err).Message(), "the first call and its replay agree")
	require.EqualValues(t, 1, e.runs.Load())
}

// A handler that returns the driver's error for a serialization failure or
// a deadlock: Aborted, which clients retry with the same key, not Unknown.
func TestHandlersDeadlockIsAborted(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		var err error
		_, err = idempotency.MustTxFromContext(ctx).Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'deadlock' USING ERRCODE = 'deadlock_detected'; END $$`)
		return nil, err
	}})
	r := e.call(context.Background(), methodCharge, "k", "x")
	require.Equal(t, codes.Aborted, status.Code(r.err), "%v", r.err)
	require.Contains(t, retryCodes, status.Code(r.err), "a code the client interceptor retries")
	require.Equal(t, 0, e.keyRows(), "released: the retry runs again")
}

// A COMMIT that outlasts the finish timeout: its outcome is unknown, which
// is Unavailable (retry with the same key), never the caller's deadline.
func TestFinishTimeoutIsUnavailable(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{storeOpts: []idempotency.StoreOption{idempotency.WithFinishTimeout(100 * time.Millisecond)}})
	_, err := e.db.Pool.Exec(context.Background(), `CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(1); RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON ledger DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()`)
	require.NoError(t, err)
	r := e.call(context.Background(), methodCharge, "k", "x")
	require.Equal(t, codes.Unavailable, status.Code(r.err), "%v", r.err)
	require.Contains(t, status.Convert(r.err).Message(), "key store unavailable")
}
