package idempotency_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
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

// What a COMMIT refuses for the call's own writes, through every
// transport: a deferred check that can succeed later (a referenced row
// that is not there yet, a deferred trigger of the handler's schema that
// raises) is the handler's failure, nothing stored, the key released; only
// a violation that no later attempt can get past is stored.

// deferredSchema creates, in db's schema, the parents and children of the
// foreign-key tests (children_parent_fkey deferred, children_now_parent_fkey
// immediate) and the orders of the trigger tests, whose deferred
// constraint trigger raises the way its name says while the books are
// closed (the table open_books is empty).
func deferredSchema(t *testing.T, db *testdb.DB) {
	t.Helper()
	_, err := db.Pool.Exec(context.Background(), `
CREATE TABLE parents (id text PRIMARY KEY);
CREATE TABLE children (id text NOT NULL, parent text CONSTRAINT children_parent_fkey REFERENCES parents DEFERRABLE INITIALLY DEFERRED);
CREATE TABLE children_now (id text NOT NULL, parent text CONSTRAINT children_now_parent_fkey REFERENCES parents);
CREATE TABLE open_books (open bool);
CREATE TABLE orders (id text NOT NULL, raises text NOT NULL);
CREATE FUNCTION books_open() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF NOT EXISTS (SELECT FROM open_books) THEN
		IF NEW.raises = 'raise' THEN
			RAISE EXCEPTION 'the books are closed for order %', NEW.id;
		ELSIF NEW.raises = 'custom' THEN
			RAISE EXCEPTION 'order % waits for the auditor', NEW.id USING ERRCODE = 'AU001';
		ELSE
			PERFORM 1 / 0; -- division_by_zero, 22012, the code of the engine's own guard
		END IF;
	END IF;
	RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER books_open AFTER INSERT ON orders DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION books_open()`)
	require.NoError(t, err)
}

func keyCount(t *testing.T, db *testdb.DB) int {
	t.Helper()
	return db.Count(t, `SELECT count(*) FROM idempotency_keys`)
}

// A message whose row references a parent that arrives later: with a
// deferred foreign key, as with an immediate one, the first delivery fails
// without storing anything and is redelivered, and the redelivery after the
// parent arrived applies it. Before, the deferred one was stored as a final
// FailedPrecondition and dead-lettered for good.
func TestDeferredForeignKeyMessageIsRedeliveredUntilItsParentArrives(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ table, constraint string }{
		{"children", "children_parent_fkey"},
		{"children_now", "children_now_parent_fkey"},
	} {
		t.Run(tc.table, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, 4)
			store := migratedStore(t, db)
			deferredSchema(t, db)
			ctx := context.Background()
			runs := 0
			deliver := func(n int) (idempotency.Outcome, error) {
				return store.ProcessMessage(ctx, idempotency.Message{Scope: "orders", ID: "m-1", Body: []byte("child of p-1"), Redelivered: n > 1},
					func(ctx context.Context, tx pgx.Tx) error {
						runs++
						_, err := tx.Exec(ctx, `INSERT INTO `+tc.table+` VALUES ('c-1', 'p-1')`)
						return err
					})
			}
			o, err := deliver(1)
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.constraint)
			require.False(t, idempotency.IsFinal(err), "not stored: %v", err)
			require.Equal(t, idempotency.OutcomeReleased, o, "%v", err)
			require.Equal(t, idempotency.Redeliver, idempotency.DispositionOf(o, err))
			require.Zero(t, keyCount(t, db), "nothing stored for the message")

			_, err = db.Pool.Exec(ctx, `INSERT INTO parents VALUES ('p-1')`)
			require.NoError(t, err)
			o, err = deliver(2)
			require.NoError(t, err)
			require.Equal(t, idempotency.OutcomeExecuted, o)
			require.Equal(t, idempotency.Ack, idempotency.DispositionOf(o, err))
			o, err = deliver(3)
			require.NoError(t, err)
			require.Equal(t, idempotency.OutcomeReplayed, o)
			require.Equal(t, 2, runs)
			require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM `+tc.table))
		})
	}
}

// The same through the HTTP middleware and the gRPC interceptor: the
// request whose deferred foreign key finds no parent at COMMIT gets a 409
// (FailedPrecondition) that is not stored, and the retry with the same key
// runs once the parent exists.
func TestDeferredForeignKeyOverHTTPAndGRPCIsNotStored(t *testing.T) {
	t.Parallel()
	t.Run("http", func(t *testing.T) {
		t.Parallel()
		var e *httpEnv
		e = newHTTPEnv(t, func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			if _, err := idempotency.MustTxFromContext(r.Context()).Exec(r.Context(), `INSERT INTO children VALUES ('c-1', $1)`, string(body)); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			w.WriteHeader(http.StatusCreated)
			_, _ = fmt.Fprintf(w, "child of %s", body)
		})
		deferredSchema(t, e.db)
		r := e.post("k-1", "p-1")
		require.Equal(t, http.StatusConflict, r.status, r.body)
		require.Contains(t, r.body, "children_parent_fkey")
		require.Empty(t, r.header.Get(idempotency.ReplayedHeader))
		require.Zero(t, keyCount(t, e.db), "nothing stored for the key")

		_, err := e.db.Pool.Exec(context.Background(), `INSERT INTO parents VALUES ('p-1')`)
		require.NoError(t, err)
		r = e.post("k-1", "p-1")
		require.Equal(t, http.StatusCreated, r.status, r.body)
		require.Empty(t, r.header.Get(idempotency.ReplayedHeader), "the retry ran")
		r = e.post("k-1", "p-1")
		require.Equal(t, http.StatusCreated, r.status, r.body)
		require.Equal(t, "true", r.header.Get(idempotency.ReplayedHeader))
		require.EqualValues(t, 2, e.runs.Load())
		require.Equal(t, 1, e.db.Count(t, `SELECT count(*) FROM children`))
	})
	t.Run("grpc", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			_, err := idempotency.MustTxFromContext(ctx).Exec(ctx, `INSERT INTO children VALUES ('c-1', $1)`, req.GetValue())
			return wrapperspb.String("child of " + req.GetValue()), err
		}}) // FailedPrecondition is final there: it would be stored
		deferredSchema(t, e.db)
		ctx := context.Background()
		r := e.call(ctx, methodCharge, "k-1", "p-1")
		require.Equal(t, codes.FailedPrecondition, status.Code(r.err), "%v", r.err)
		require.Contains(t, r.err.Error(), "children_parent_fkey")
		require.Zero(t, e.keyRows(), "nothing stored for the key")

		_, err := e.db.Pool.Exec(ctx, `INSERT INTO parents VALUES ('p-1')`)
		require.NoError(t, err)
		r = e.call(ctx, methodCharge, "k-1", "p-1")
		require.NoError(t, r.err)
		require.False(t, r.replayed, "the retry ran")
		r = e.call(ctx, methodCharge, "k-1", "p-1")
		require.NoError(t, r.err)
		require.True(t, r.replayed)
		require.EqualValues(t, 2, e.runs.Load())
	})
}

// A deferred unique violation on the message's own data can never succeed:
// still stored and dead-lettered, beside a foreign key that is not.
func TestDeferredUniqueViolationIsStillFinal(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `CREATE TABLE notes (note text UNIQUE DEFERRABLE INITIALLY DEFERRED)`)
	require.NoError(t, err)
	o, err := store.ProcessMessage(ctx, idempotency.Message{Scope: "notes", ID: "m-1"}, func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO notes VALUES ('twice'), ('twice')`)
		return err
	})
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
	require.True(t, idempotency.IsFinal(err))
	require.Equal(t, idempotency.OutcomeExecuted, o, "stored")
	require.Equal(t, idempotency.DeadLetter, idempotency.DispositionOf(o, err))
	require.Equal(t, 1, keyCount(t, db))
}

// A deferred constraint trigger of the handler's schema that raises at
// COMMIT (RAISE EXCEPTION, P0001; a custom SQLSTATE; an error of a
// statement in it, here division_by_zero) refuses the call's writes: the
// handler's failure, not a misconfigured store. Nothing is stored, the key
// is released, the error names the SQLSTATE and the message, and the
// message is redelivered (a consumer counts it as a handler failure);
// once the trigger lets it pass, the redelivery applies it. Before, it was
// "unexpected database error", OutcomeMisconfigured, redelivered forever.
func TestDeferredTriggerExceptionIsTheHandlersFailure(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ raises, code, message string }{
		{"raise", "P0001", "the books are closed for order o-1"},
		{"custom", "AU001", "order o-1 waits for the auditor"},
		{"divide", "22012", "division by zero"},
	} {
		t.Run(tc.raises, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, 4)
			store := migratedStore(t, db)
			deferredSchema(t, db)
			ctx := context.Background()
			runs := 0
			deliver := func(n int) (idempotency.Outcome, error) {
				return store.ProcessMessage(ctx, idempotency.Message{Scope: "orders", ID: "m-1", Body: []byte(tc.raises), Redelivered: n > 1},
					func(ctx context.Context, tx pgx.Tx) error {
						runs++
						_, err := tx.Exec(ctx, `INSERT INTO orders VALUES ('o-1', $1)`, tc.raises)
						return err
					})
			}
			o, err := deliver(1)
			require.Error(t, err)
			require.Equal(t, idempotency.OutcomeReleased, o, "%v", err)
			require.False(t, idempotency.IsFinal(err))
			require.Equal(t, idempotency.Redeliver, idempotency.DispositionOf(o, err))
			requireRefusedAtCommit(t, err, tc.code, tc.message)
			require.Zero(t, keyCount(t, db), "nothing stored for the message")

			_, err = db.Pool.Exec(ctx, `INSERT INTO open_books VALUES (true)`)
			require.NoError(t, err)
			o, err = deliver(2)
			require.NoError(t, err)
			require.Equal(t, idempotency.OutcomeExecuted, o)
			require.Equal(t, 2, runs)
			require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM orders`))
		})
	}
}

// requireRefusedAtCommit checks that err says the database refused the
// call's writes at COMMIT, naming the SQLSTATE and the message, and is not
// taken for a misconfigured store or an outage.
func requireRefusedAtCommit(t *testing.T, err error, code, message string) {
	t.Helper()
	msg := status.Convert(err).Message()
	require.Contains(t, msg, "refused at COMMIT")
	require.Contains(t, msg, "SQLSTATE "+code)
	require.Contains(t, msg, message)
	require.NotContains(t, msg, "unexpected database error")
	require.NotContains(t, msg, "misconfigured")
	require.NotErrorIs(t, err, idempotency.ErrStoreUnavailable)
	require.NotContains(t, []codes.Code{codes.Internal, codes.Unavailable, codes.Aborted}, status.Code(err), "%v", err)
}

// The same trigger through the HTTP middleware and the gRPC interceptor:
// not stored, the key released, and the retry after the books opened runs.
func TestDeferredTriggerExceptionOverHTTPAndGRPCIsNotStored(t *testing.T) {
	t.Parallel()
	t.Run("http", func(t *testing.T) {
		t.Parallel()
		var e *httpEnv
		e = newHTTPEnv(t, func(w http.ResponseWriter, r *http.Request) {
			if _, err := idempotency.MustTxFromContext(r.Context()).Exec(r.Context(), `INSERT INTO orders VALUES ('o-1', 'raise')`); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, "ordered")
		})
		deferredSchema(t, e.db)
		r := e.post("k-1", "o-1")
		require.Contains(t, r.body, "refused at COMMIT", "%d %s", r.status, r.body)
		require.Contains(t, r.body, "SQLSTATE P0001")
		require.Contains(t, r.body, "the books are closed for order o-1")
		require.NotContains(t, strings.ToLower(r.body), "misconfigured")
		require.GreaterOrEqual(t, r.status, 500, "not stored, as a 5xx of the handler's is not")
		require.Zero(t, keyCount(t, e.db), "nothing stored for the key")

		_, err := e.db.Pool.Exec(context.Background(), `INSERT INTO open_books VALUES (true)`)
		require.NoError(t, err)
		r = e.post("k-1", "o-1")
		require.Equal(t, http.StatusCreated, r.status, r.body)
		require.Empty(t, r.header.Get(idempotency.ReplayedHeader), "the retry ran")
		require.EqualValues(t, 2, e.runs.Load())
	})
	t.Run("grpc", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			_, err := idempotency.MustTxFromContext(ctx).Exec(ctx, `INSERT INTO orders VALUES ($1, 'raise')`, req.GetValue())
			return wrapperspb.String("ordered"), err
		}})
		deferredSchema(t, e.db)
		ctx := context.Background()
		r := e.call(ctx, methodCharge, "k-1", "o-1")
		requireRefusedAtCommit(t, r.err, "P0001", "the books are closed for order o-1")
		require.Zero(t, e.keyRows(), "nothing stored for the key")

		_, err := e.db.Pool.Exec(ctx, `INSERT INTO open_books VALUES (true)`)
		require.NoError(t, err)
		r = e.call(ctx, methodCharge, "k-1", "o-1")
		require.NoError(t, r.err)
		require.False(t, r.replayed, "the retry ran")
		require.EqualValues(t, 2, e.runs.Load())
	})
}

// It failed when only an error with a context (Where) was taken for a
// deferred trigger's: a trigger function written in C (here the built-in
// suppress_redundant_updates_trigger, refusing an INSERT with 39P01) fails
// at COMMIT without one, and the call was reported as a misconfigured
// store, Internal, and redelivered forever by a consumer. Any error of the
// COMMIT that is not the server's condition is the handler's failure.
func TestDeferredTriggerWithoutFunctionContextIsTheHandlersFailure(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `
CREATE TABLE audited (id text NOT NULL);
CREATE CONSTRAINT TRIGGER audited_c AFTER INSERT ON audited DEFERRABLE INITIALLY DEFERRED
	FOR EACH ROW EXECUTE FUNCTION suppress_redundant_updates_trigger()`)
	require.NoError(t, err)
	o, err := store.ProcessMessage(ctx, idempotency.Message{Scope: "audited", ID: "m-1"}, func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO audited VALUES ('a-1')`)
		return err
	})
	require.Error(t, err)
	require.Equal(t, idempotency.OutcomeReleased, o, "%v", err)
	require.False(t, idempotency.IsFinal(err))
	require.Equal(t, codes.Unknown, status.Code(err), "%v", err)
	require.Zero(t, keyCount(t, db), "nothing stored")
}

// It failed when class 23 was tested before the error's context: a
// deferred trigger whose own statement hit a unique key or a NOT NULL
// column (or that raised unique_violation) was taken for a deferred
// constraint of the handler's rows, stored as final, and the message
// dead-lettered even once the trigger could pass.
func TestDeferredTriggerStatementViolationIsNotStored(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, body string }{
		{"unique", `INSERT INTO audit_log VALUES ('fixed', NEW.id)`},
		{"not_null", `INSERT INTO audit_log VALUES (NULL, NEW.id)`},
		{"raise_unique", `RAISE EXCEPTION 'item % is already audited', NEW.id USING ERRCODE = 'unique_violation'`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, 4)
			store := migratedStore(t, db)
			ctx := context.Background()
			_, err := db.Pool.Exec(ctx, `
CREATE TABLE audit_log (entry text PRIMARY KEY, item text);
INSERT INTO audit_log VALUES ('fixed', 'before');
CREATE TABLE items (id text NOT NULL);
CREATE FUNCTION items_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	`+tc.body+`;
	RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER items_audit AFTER INSERT ON items DEFERRABLE INITIALLY DEFERRED
	FOR EACH ROW EXECUTE FUNCTION items_audit()`)
			require.NoError(t, err)
			o, err := store.ProcessMessage(ctx, idempotency.Message{Scope: "items", ID: "m-1"}, func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `INSERT INTO items VALUES ('i-1')`)
				return err
			})
			require.Error(t, err)
			require.False(t, idempotency.IsFinal(err), "stored as final: %v", err)
			require.Equal(t, idempotency.OutcomeReleased, o, "%v", err)
			require.Equal(t, codes.Unknown, status.Code(err), "%v", err)
			require.Zero(t, keyCount(t, db), "nothing stored")
		})
	}
}

// A COMMIT that fails on a deferred constraint, while a duplicate runs and
// succeeds before the first call stores its error: both callers get one
// answer, the stored one.
func TestDeferredFailureAndADuplicateGetOneAnswer(t *testing.T) {
	t.Parallel()
	storing, stored := make(chan struct{}), make(chan struct{})
	var once sync.Once
	db := testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.Tracer = &testdb.Tracer{OnRoundTrip: func(_ context.Context, _ *pgx.Conn, statements []string) {
			if strings.Contains(strings.Join(statements, ";"), "BEGIN ISOLATION LEVEL READ COMMITTED READ WRITE") {
				// The first call is about to store its error outside its
				// transaction: let the duplicate finish first.
				once.Do(func() {
					close(storing)
					select {
					case <-stored:
					case <-time.After(liveness):
					}
				})
			}
		}}
	})
	ctx := context.Background()
	store := migratedStore(t, db)
	_, err := db.Pool.Exec(ctx, `CREATE TABLE audit (note text UNIQUE DEFERRABLE INITIALLY DEFERRED); INSERT INTO audit VALUES ('taken')`)
	require.NoError(t, err)
	var runs atomic.Int64
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(store))) // FailedPrecondition is final
	srv.RegisterService(ledgerDesc(), &ledger{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		note := "taken" // the first run's write collides at COMMIT
		if runs.Add(1) > 1 {
			note = "free"
		}
		_, err := idempotency.MustTxFromContext(ctx).Exec(ctx, `INSERT INTO audit VALUES ($1)`, note)
		return wrapperspb.String("audited " + note), err
	}})
	conn := dial(t, serve(t, srv))
	kctx := metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, "k")
	first := make(chan reply, 1)
	go func() { first <- invoke(kctx, conn, methodCharge, "x") }()
	await(t, storing, "the first call's COMMIT to fail")
	dup := invoke(kctx, conn, methodCharge, "x")
	require.NoError(t, dup.err, "the duplicate ran after the failed COMMIT, and succeeded")
	close(stored)
	r := await(t, first, "the first call")
	require.NoError(t, r.err, "the first caller gets the stored answer, not a second one")
	require.Equal(t, dup.raw, r.raw)
	later := invoke(kctx, conn, methodCharge, "x")
	require.NoError(t, later.err)
	require.True(t, later.replayed)
	require.Equal(t, dup.raw, later.raw)
	require.EqualValues(t, 2, runs.Load())
}

// A message whose writes violate a deferred constraint at every COMMIT can
// never succeed: it is dead-lettered at once, and every redelivery too,
// without running again.
func TestMessageThatCanNeverCommitIsDeadLettered(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	ctx := context.Background()
	store := migratedStore(t, db)
	_, err := db.Pool.Exec(ctx, `CREATE TABLE audit (note text UNIQUE DEFERRABLE INITIALLY DEFERRED); INSERT INTO audit VALUES ('taken')`)
	require.NoError(t, err)
	runs := 0
	for delivery := 1; delivery <= 5; delivery++ {
		o, err := store.ProcessMessage(ctx, idempotency.Message{Scope: "orders", ID: "m-1", Body: []byte("audit"), Redelivered: delivery > 1}, func(ctx context.Context, tx pgx.Tx) error {
			runs++
			_, err := tx.Exec(ctx, `INSERT INTO audit VALUES ('taken')`)
			return err
		})
		require.Equal(t, codes.FailedPrecondition, status.Code(err), "delivery %d: %v", delivery, err)
		require.Equal(t, idempotency.DeadLetter, idempotency.DispositionOf(o, err), "delivery %d", delivery)
	}
	require.Equal(t, 1, runs)
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

// A call that takes longer than its TTL commits its key with the TTL
// counted from its end, in the same commit: a retry right after it (or a
// duplicate's probe, or the cleaner) finds the key alive and replays it.
// (The TTL was extended in a round trip after the COMMIT, and a retry in
// between ran the handler again.)
func TestLongCallCommitsItsKeyAlive(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	const ttl = 300 * time.Millisecond
	call := idempotency.Call{Key: "long", Method: "m", TTL: ttl}
	fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		n := runs.Add(1)
		if n == 1 {
			// The first call takes longer than its TTL (a slow provider).
			if _, err := tx.Exec(ctx, `SELECT pg_sleep(0.4)`); err != nil {
				return nil, err
			}
		}
		if _, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('charge')`); err != nil {
			return nil, err
		}
		return wrapperspb.String(fmt.Sprintf("run %d", n)), nil
	}
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	createLedger(t, db)
	_, err := store.Execute(context.Background(), call, fn)
	require.NoError(t, err)
	var left time.Duration
	require.NoError(t, db.Pool.QueryRow(context.Background(),
		`SELECT (extract(epoch FROM expires_at - completed_at) * 1e6)::bigint FROM idempotency_keys WHERE key = 'long'`).Scan(&left))
	require.GreaterOrEqual(t, left*time.Microsecond, ttl, "committed with a full TTL left")
	call.Retry = true
	res, err := store.Execute(context.Background(), call, fn)
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeReplayed, res.Outcome)
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))
}

// A COMMIT slower than WithFinishTimeout (a deferred trigger at COMMIT):
// pgx closes the connection and cancels the COMMIT, so nothing commits;
// the caller is told Unavailable, and a retry runs again. Checked: never
// two commits, no lock left.
func TestFinishTimeoutDuringASlowCommit(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	store := migratedStore(t, db, idempotency.WithFinishTimeout(100*time.Millisecond), idempotency.WithInProgressWait(5*time.Second))
	createLedger(t, db)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.5); RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON ledger DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()`)
	require.NoError(t, err)
	var runs atomic.Int64
	fn := func(ctx context.Context, tx pgx.Tx) (string, error) {
		n := runs.Add(1)
		_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x')`)
		return fmt.Sprintf("run %d", n), err
	}
	for range 2 {
		_, err := execString(store, "k", fn)
		require.Equal(t, codes.Unavailable, status.Code(err))
	}
	require.Eventually(t, func() bool { return heldKeyLocks(t, db, "", []string{"k"}) == 0 }, liveness, 5*time.Millisecond)
	require.LessOrEqual(t, db.Count(t, `SELECT count(*) FROM ledger`), 1)
	require.Empty(t, keyState(t, db, "k"))
}
