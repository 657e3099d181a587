package idempotency_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// The key holds by construction, whatever the handler sends: each way past
// the SQL check that a review found (and the plain COMMIT the check
// exists for), with the check switched off. The handler ends the call's
// transaction and keeps running; a duplicate arrives meanwhile. The
// duplicate never runs the handler: it gets the stored error at once (the
// claim was committed with the handler's writes) or waits for it (the
// session still holds the key after a ROLLBACK), and both callers get the
// same final answer, as does every later one.
func TestWaysPastTheSQLCheckNeverRunTwice(t *testing.T) {
	t.Parallel()
	for name, tc := range gapCases() {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var tries atomic.Int64 // claims and probes of the key, once the handler has ended the transaction
			var ended atomic.Bool
			db := testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
				cfg.ConnConfig.Tracer = &testdb.Tracer{OnRoundTrip: func(_ context.Context, _ *pgx.Conn, statements []string) {
					if ended.Load() && strings.Contains(strings.Join(statements, ";"), "pg_try_advisory") {
						tries.Add(1)
					}
				}}
				if tc.pool != nil {
					tc.pool(cfg)
				}
			})
			store := migratedStore(t, db, idempotency.WithInProgressWait(liveness), idempotency.WithoutSQLCheck())
			createLedger(t, db)
			var runs atomic.Int64
			release := newGate()
			call := idempotency.Call{Key: "k", Method: "m"}
			fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				if runs.Add(1) > 1 {
					t.Error("the handler ran a second time")
					return wrapperspb.String("second run"), nil
				}
				if _, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('first')`); err != nil {
					return nil, err
				}
				switch err := tc.end(ctx, tx); {
				case tc.refused && !errors.Is(err, idempotency.ErrTxOwned):
					t.Errorf("ending the transaction: want ErrTxOwned, got %v", err)
				case !tc.refused && err != nil:
					t.Errorf("ending the transaction: %v", err)
				}
				ended.Store(true)
				_ = release.wait(ctx) // the handler keeps running
				return wrapperspb.String("first run"), nil
			}
			first := make(chan error, 1)
			go func() {
				_, err := store.Execute(context.Background(), call, fn)
				first <- err
			}()
			require.Eventually(t, ended.Load, liveness, time.Millisecond, "the handler to end the transaction")
			dup := make(chan error, 1)
			go func() {
				_, err := store.Execute(context.Background(), call, fn)
				dup <- err
			}()
			// The duplicate has looked at the key while the first call runs.
			require.Eventually(t, func() bool { return tries.Load() >= 1 }, liveness, time.Millisecond, "the duplicate to try the key")
			if tc.settledAtOnce {
				requireStoredInternal(t, await(t, dup, "the duplicate"), "ended the call's transaction")
			}
			release.open()
			errFirst := await(t, first, "the first call")
			requireStoredInternal(t, errFirst, "ended the call's transaction")
			if !tc.settledAtOnce {
				requireStoredInternal(t, await(t, dup, "the duplicate"), "ended the call's transaction")
			}
			res, err := store.Execute(context.Background(), call, fn)
			require.Equal(t, idempotency.OutcomeReplayed, res.Outcome)
			require.Equal(t, status.Convert(errFirst).Proto().String(), status.Convert(err).Proto().String(), "one answer for every caller")
			require.EqualValues(t, 1, runs.Load(), "the handler ran once")
			require.Equal(t, tc.ledger, db.Count(t, `SELECT count(*) FROM ledger`))
			requireNoKeyLocks(t, db, "", []string{"k"}, "no lock outlives the calls")
		})
	}
}

// gapCase is one way a handler ends the call's transaction.
type gapCase struct {
	end  func(ctx context.Context, tx pgx.Tx) error
	pool func(*pgxpool.Config)
	// settledAtOnce: the claim committed with the handler's COMMIT, so a
	// duplicate gets the stored error without waiting.
	settledAtOnce bool
	ledger        int // business rows committed in the end
	// refused: a statement of end is refused (ErrTxOwned) whatever the SQL
	// check says: it was sent through tx after the call's transaction had
	// ended, and would have committed on its own.
	refused bool
}

func gapCases() map[string]gapCase {
	commitPrepared := func(cfg *pgxpool.Config) {
		cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
			_, err := c.Prepare(ctx, "finish-batch", "COMMIT")
			return err
		}
	}
	return map[string]gapCase{
		"COMMIT through tx": {end: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `COMMIT`)
			return err
		}, settledAtOnce: true, ledger: 1},
		"a rewriter after QueryResultFormats": {end: func(ctx context.Context, tx pgx.Tx) error {
			rows, err := tx.Query(ctx, `SELECT 1`, pgx.QueryResultFormats{pgx.TextFormatCode}, rewriteTo("COMMIT"))
			if err != nil {
				return err
			}
			rows.Close()
			return rows.Err()
		}, settledAtOnce: true, ledger: 1},
		"a rewriter queued in a batch": {end: func(ctx context.Context, tx pgx.Tx) error {
			b := &pgx.Batch{}
			b.Queue(`SELECT 1`, rewriteTo("COMMIT"))
			return tx.SendBatch(ctx, b).Close()
		}, settledAtOnce: true, ledger: 1},
		"simple-protocol batch statements that join into a COMMIT": {end: func(ctx context.Context, tx pgx.Tx) error {
			b := &pgx.Batch{}
			b.Queue(`SELECT $q$`)
			b.Queue(`$q$; COMMIT; --`)
			return tx.SendBatch(ctx, b).Close()
		}, pool: func(cfg *pgxpool.Config) { cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol }, settledAtOnce: true, ledger: 1},
		"a function named begin, then COMMIT": {end: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `CREATE FUNCTION begin() RETURNS int LANGUAGE sql AS 'SELECT 1'; COMMIT`)
			return err
		}, settledAtOnce: true, ledger: 1},
		"a prepared statement whose name is not one word": {end: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "finish-batch")
			return err
		}, pool: commitPrepared, settledAtOnce: true, ledger: 1},
		"COMMIT on tx.Conn(), which the handler then closes": {end: func(ctx context.Context, tx pgx.Tx) error {
			c := tx.Conn()
			if _, err := c.Exec(ctx, `COMMIT`); err != nil {
				return err
			}
			return c.Close(ctx)
		}, settledAtOnce: true, ledger: 1},
		// The session's lock outlives the ROLLBACK: the duplicate waits
		// while the handler goes on, and gets the error the engine stores
		// for it. What the handler sends through tx once the transaction
		// has ended is not sent at all.
		"ROLLBACK, then a write outside any transaction": {end: func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `ROLLBACK`); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('outside')`)
			return err
		}, refused: true},
		"ROLLBACK and a write outside any transaction, in one string": {end: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `ROLLBACK; INSERT INTO ledger (note) VALUES ('outside')`)
			return err
		}, ledger: 1},
		// The handler returns success from a failed block of a transaction
		// of its own: the key keeps the error that says it left the call's
		// transaction, not that its writes could not be committed.
		"ROLLBACK, a write committed outside, then a failed transaction of the handler's own": {end: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `ROLLBACK; INSERT INTO ledger (note) VALUES ('outside'); COMMIT; BEGIN; SELECT 1/0`, pgx.QueryExecModeSimpleProtocol)
			switch {
			case err == nil:
				return errors.New("SELECT 1/0 did not fail")
			case errors.Is(err, idempotency.ErrTxOwned):
				return err // refused, nothing sent
			}
			return nil // the handler goes on from the failed block
		}, ledger: 1},
		"ROLLBACK on tx.Conn(), then a transaction of the handler's own": {end: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Conn().Exec(ctx, `ROLLBACK; BEGIN; INSERT INTO ledger (note) VALUES ('its own')`)
			return err
		}, ledger: 0}, // the engine never commits a transaction it did not begin
		"COMMIT, then a transaction of the handler's own": {end: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `COMMIT; BEGIN; INSERT INTO ledger (note) VALUES ('its own')`)
			return err
		}, settledAtOnce: true, ledger: 1}, // the engine rolls its own transaction back
	}
}

// requireStoredInternal requires err to be a stored Internal error saying
// what.
func requireStoredInternal(t *testing.T, err error, what string) {
	t.Helper()
	require.Equal(t, codes.Internal, status.Code(err), "%v", err)
	require.True(t, idempotency.IsFinal(err), "stored: %v", err)
	require.Contains(t, status.Convert(err).Message(), what)
}

// With the check on, each of those is refused before it reaches
// PostgreSQL, with the clearer error, and the call fails once, stored.
func TestSQLCheckRefusesEachWayToEndTheTransaction(t *testing.T) {
	t.Parallel()
	for name, tc := range gapCases() {
		if strings.Contains(name, "tx.Conn()") {
			continue // Conn is not checked
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := testdb.NewConfigured(t, tc.pool)
			store := migratedStore(t, db)
			createLedger(t, db)
			var endErr error
			var runs atomic.Int64
			fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				runs.Add(1)
				if _, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('first')`); err != nil {
					return nil, err
				}
				endErr = tc.end(ctx, tx)
				return wrapperspb.String("first run"), nil
			}
			for range 2 {
				_, err := store.Execute(context.Background(), idempotency.Call{Key: "k", Method: "m"}, fn)
				requireStoredInternal(t, err, "which the engine refused")
			}
			require.True(t, errors.Is(endErr, idempotency.ErrTxOwned), "%v", endErr)
			require.EqualValues(t, 1, runs.Load())
			require.Zero(t, db.Count(t, `SELECT count(*) FROM ledger`), "nothing committed")
		})
	}
}

// A handler that commits on tx.Conn() and closes it, on a pool whose only
// connection the attempt holds: the attempt gives the dead connection back
// before it asks for another to store the error, so the call fails once,
// stored, within the finish timeout, instead of timing out Unavailable and
// running again on the retry.
func TestClosedConnOnAFullPoolStoresTheError(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 1)
	store := migratedStore(t, db, idempotency.WithFinishTimeout(2*time.Second), idempotency.WithoutSQLCheck())
	createLedger(t, db)
	var runs atomic.Int64
	fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		runs.Add(1)
		c := tx.Conn()
		if _, err := c.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x'); COMMIT`); err != nil {
			return nil, err
		}
		return wrapperspb.String("done"), c.Close(ctx)
	}
	call := idempotency.Call{Key: "k", Method: "m"}
	_, err := store.Execute(context.Background(), call, fn)
	requireStoredInternal(t, err, "ended the call's transaction")
	res, err := store.Execute(context.Background(), call, fn)
	requireStoredInternal(t, err, "ended the call's transaction")
	require.Equal(t, idempotency.OutcomeReplayed, res.Outcome)
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))
}

// A handler that keeps the Conn of rows it leaves open: the call fails (its
// rows were left open), and its connection is closed rather than returned
// to the pool, so that the kept connection can never reach the next call,
// here on the same pool of one, which commits its own work untouched.
func TestKeptRowsConnCannotReachAnotherCall(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 1)
	store := migratedStore(t, db, idempotency.WithoutSQLCheck())
	createLedger(t, db)
	var kept *pgx.Conn
	_, err := store.Execute(context.Background(), idempotency.Call{Key: "a", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		rows, err := tx.Query(ctx, `SELECT generate_series(1, 10000)`)
		if err != nil {
			return nil, err
		}
		kept = rows.Conn() // rows left open
		return wrapperspb.String("a"), nil
	})
	requireStoredInternal(t, err, "still open")
	innocent := make(chan struct{})
	var keptErr error
	res, err := store.Execute(context.Background(), idempotency.Call{Key: "b", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('b')`); err != nil {
			return nil, err
		}
		_, keptErr = kept.Exec(context.Background(), `COMMIT`) // from the handler that kept it
		close(innocent)
		return wrapperspb.String("b"), nil
	})
	<-innocent
	require.NoError(t, err, "the innocent call is untouched")
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
	require.Error(t, keptErr, "the kept connection is closed")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))
	require.Equal(t, "succeeded", keyState(t, db, "b"))
}

// keyState is the state of key's row in db's key table, "" when it has none.
func keyState(t *testing.T, db *testdb.DB, key string) string {
	t.Helper()
	var state string
	err := db.Pool.QueryRow(context.Background(), `SELECT state FROM idempotency_keys WHERE key = $1`, key).Scan(&state)
	if errors.Is(err, pgx.ErrNoRows) {
		return ""
	}
	require.NoError(t, err)
	return state
}
