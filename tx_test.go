package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// The key holds by construction, whatever the handler sends: each known way
// past the SQL check (and the plain COMMIT the check
// exists for), with the check switched off. The handler ends the call's
// transaction and keeps running; a duplicate arrives meanwhile. The
// duplicate never runs the handler: it gets the stored error at once (the
// claim was committed with the handler's writes) or waits for it (the
// session still holds the key after a ROLLBACK), and both callers get the
// same final answer, as does every later one.
func TestWaysPastTheSQLCheckNeverRunTwice(t *testing.T) {
	t.Parallel()
	for name, tc := range bypassCases() {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var ended atomic.Bool
			db, tries := lockTriesDB(t, &ended, tc.pool) // claims and probes of the key, once the handler has ended the transaction
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
			first := executeAsync(store, call, fn)
			require.Eventually(t, ended.Load, liveness, time.Millisecond, "the handler to end the transaction")
			dup := executeAsync(store, call, fn)
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

// bypassCase is one way a handler ends the call's transaction.
type bypassCase struct {
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

func bypassCases() map[string]bypassCase {
	commitPrepared := func(cfg *pgxpool.Config) {
		cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
			_, err := c.Prepare(ctx, "finish-batch", "COMMIT")
			return err
		}
	}
	return map[string]bypassCase{
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

// With the check on, each of those is refused before it reaches
// PostgreSQL, with the clearer error, and the call fails once, stored.
func TestSQLCheckRefusesEachWayToEndTheTransaction(t *testing.T) {
	t.Parallel()
	for name, tc := range bypassCases() {
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

// A COMMIT the handler sends while a duplicate arrives: through tx it never
// reaches PostgreSQL; through tx.Conn() it does, but the key stays locked
// for the session until the engine has stored the call's error. Either way
// the duplicate waits and gets that error; the handler runs once.
func TestHandlerCommitWithAConcurrentDuplicateRunsOnce(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		commit     func(ctx context.Context, tx pgx.Tx) error
		ledgerRows int
		pool       func(*pgxpool.Config)
	}{
		"through tx": {commit: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x'); COMMIT`)
			return err
		}},
		"through tx, after a comment ended by a carriage return": {commit: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO ledger (note) VALUES ('x'); --\rCOMMIT")
			return err
		}},
		"through tx, standard_conforming_strings off": {commit: func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SET LOCAL standard_conforming_strings = off`); err == nil {
				return errors.New("standard_conforming_strings was not refused")
			}
			_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x'); SELECT '\'' ; COMMIT; --'`)
			return err
		}},
		"through tx, by the name of a statement prepared on the connection": {
			commit: func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "finish_batch")
				return err
			},
			pool: func(cfg *pgxpool.Config) {
				cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
					_, err := c.Prepare(ctx, "finish_batch", "COMMIT")
					return err
				}
			},
		},
		"through tx, made by a query rewriter": {commit: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x')`, rewriteTo(`INSERT INTO ledger (note) VALUES ('x'); COMMIT`))
			return err
		}},
		"through tx.Conn()": {commit: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Conn().Exec(ctx, `INSERT INTO ledger (note) VALUES ('x'); COMMIT`)
			return err
		}, ledgerRows: 1},
		"through the Conn of the call's rows": {commit: func(ctx context.Context, tx pgx.Tx) error {
			rows, err := tx.Query(ctx, `SELECT 1`)
			if err != nil {
				return err
			}
			conn := rows.Conn()
			rows.Close()
			_, err = conn.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x'); COMMIT`)
			return err
		}, ledgerRows: 1},
		"through the Conn of rows handed to a batch's callback": {commit: func(ctx context.Context, tx pgx.Tx) error {
			var conn *pgx.Conn
			b := &pgx.Batch{}
			b.Queue(`SELECT 1`).Query(func(rows pgx.Rows) error { conn = rows.Conn(); return nil })
			if err := tx.SendBatch(ctx, b).Close(); err != nil {
				return err
			}
			_, err := conn.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x'); COMMIT`)
			return err
		}, ledgerRows: 1},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var committed atomic.Bool
			db, tries := lockTriesDB(t, &committed, tc.pool) // the engine's lock attempts, counted once the handler has committed
			store := migratedStore(t, db, idempotency.WithInProgressWait(liveness))
			createLedger(t, db)
			var runs atomic.Int64
			release := make(chan struct{})
			call := idempotency.Call{Key: "k", Method: "m"}
			fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				if runs.Add(1) > 1 {
					return wrapperspb.String("second run"), nil
				}
				_ = tc.commit(ctx, tx)
				committed.Store(true)
				select {
				case <-release:
				case <-time.After(liveness):
				}
				return wrapperspb.String("first run"), nil
			}
			first := executeAsync(store, call, fn)
			require.Eventually(t, committed.Load, liveness, time.Millisecond, "the handler to commit")
			dup := executeAsync(store, call, fn)
			// The duplicate's claim, then a probe of its wait: it is waiting.
			require.Eventually(t, func() bool { return tries.Load() >= 2 }, liveness, time.Millisecond, "the duplicate to try the key")
			close(release)
			for _, err := range []error{await(t, first, "the first call"), await(t, dup, "the duplicate")} {
				require.Equal(t, codes.Internal, status.Code(err), "%v", err)
				require.True(t, idempotency.IsFinal(err), "the stored error, for both callers")
			}
			require.EqualValues(t, 1, runs.Load(), "the duplicate never ran the handler")
			require.Equal(t, tc.ledgerRows, db.Count(t, `SELECT count(*) FROM ledger`))
		})
	}
}

// rewriteTo is a query rewriter that replaces a statement's SQL with sql.
type rewriteTo string

func (r rewriteTo) RewriteQuery(_ context.Context, _ *pgx.Conn, _ string, args []any) (string, []any, error) {
	return string(r), args, nil
}

// The large objects and savepoints of a call's transaction die with it,
// as pgx's own nested transactions do after their Commit.
func TestLargeObjectsAndSavepointsDieWithTheCall(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 1) // one connection: the next call gets the same one
	ctx := context.Background()
	store := migratedStore(t, db)
	createLedger(t, db)
	var keptTx, keptSavepoint pgx.Tx
	var keptLO pgx.LargeObjects
	_, err := store.Execute(ctx, idempotency.Call{Key: "first", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		keptTx, keptLO = tx, tx.LargeObjects()
		sp, err := tx.Begin(ctx)
		if err != nil {
			return nil, err
		}
		if err := sp.Commit(ctx); err != nil {
			return nil, err
		}
		// A savepoint is closed by its own Commit, as pgx's are.
		if _, err := sp.Exec(ctx, `INSERT INTO ledger (note) VALUES ('after its commit')`); !errors.Is(err, pgx.ErrTxClosed) {
			return nil, fmt.Errorf("savepoint after Commit: %v", err)
		}
		keptSavepoint, err = tx.Begin(ctx)
		return nil, err
	})
	require.NoError(t, err)

	// Large objects with OIDs of their own, to look for them afterwards.
	oid := uint32(1_900_000_000 + time.Now().UnixNano()%100_000_000)
	lo := keptTx.LargeObjects()
	_, err = lo.Create(ctx, oid)
	require.ErrorIs(t, err, pgx.ErrTxClosed, "LargeObjects of a dead transaction")
	_, err = keptLO.Create(ctx, oid+1)
	require.ErrorIs(t, err, pgx.ErrTxClosed, "LargeObjects kept from the call")
	_, err = keptSavepoint.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x')`)
	require.ErrorIs(t, err, pgx.ErrTxClosed, "a savepoint kept from the call")
	spLO := keptSavepoint.LargeObjects()
	_, err = spLO.Create(ctx, oid+2)
	require.ErrorIs(t, err, pgx.ErrTxClosed)

	// Inside another call on the same connection: still dead.
	_, err = store.Execute(ctx, idempotency.Call{Key: "second", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		if _, err := keptLO.Create(ctx, oid+3); !errors.Is(err, pgx.ErrTxClosed) {
			return nil, fmt.Errorf("kept large objects inside another call: %v", err)
		}
		if _, err := keptSavepoint.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x')`); !errors.Is(err, pgx.ErrTxClosed) {
			return nil, fmt.Errorf("kept savepoint inside another call: %v", err)
		}
		return nil, nil
	})
	require.NoError(t, err)
	require.Equal(t, 0, db.Count(t, `SELECT count(*) FROM pg_largeobject_metadata WHERE oid::bigint BETWEEN $1 AND $1 + 3`, int64(oid)), "no large object written")
	require.Equal(t, 0, db.Count(t, `SELECT count(*) FROM ledger`))
}

// SQL-standard function bodies (BEGIN ATOMIC ... END) hold semicolons and
// an END that end no transaction: allowed.
func TestBeginAtomicBodyIsAllowed(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	store := migratedStore(t, db)
	res, err := store.Execute(context.Background(), idempotency.Call{Key: "k", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		_, err := tx.Exec(ctx, `CREATE FUNCTION answer() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT CASE WHEN true THEN 42 END; END`)
		return nil, err
	})
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
	require.Equal(t, 42, db.Count(t, `SELECT answer()`))
}

// tx.Conn() called by a goroutine the handler left behind, once the call is
// over and its connection serves another call: the other call's writes are
// not committed by it; that call fails with Unavailable, and its retry
// runs.
func TestStaleConnCannotReachAnotherCall(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 1) // one connection: the next call gets the same one
	store := migratedStore(t, db)
	createLedger(t, db)
	ctx := context.Background()
	var kept pgx.Tx
	_, err := store.Execute(ctx, idempotency.Call{Key: "a", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		kept = tx
		return wrapperspb.String("a"), nil
	})
	require.NoError(t, err)
	var staleErr error
	fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('b')`); err != nil {
			return nil, err
		}
		if kept != nil {
			_, staleErr = kept.Conn().Exec(context.Background(), `COMMIT`) // the left-behind goroutine
			kept = nil
		}
		return wrapperspb.String("b"), nil
	}
	_, err = store.Execute(ctx, idempotency.Call{Key: "b", Method: "m"}, fn)
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	require.Error(t, staleErr, "the stale COMMIT went nowhere")
	require.Zero(t, db.Count(t, `SELECT count(*) FROM ledger`), "nothing of b committed")
	res, err := store.Execute(ctx, idempotency.Call{Key: "b", Method: "m"}, fn)
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
}

// A handler that commits on tx.Conn() and then closes it: the engine cannot
// know whether its writes committed, so the key keeps an error (stored on
// another connection) and the handler never runs again.
func TestConnCommittedThenClosedRunsOnce(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	createLedger(t, db)
	var runs atomic.Int64
	fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		runs.Add(1)
		c := tx.Conn()
		if _, err := c.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x'); COMMIT`); err != nil {
			return nil, err
		}
		return wrapperspb.String("x"), c.Close(ctx)
	}
	for i := 0; i < 2; i++ {
		_, err := store.Execute(context.Background(), idempotency.Call{Key: "k", Method: "m"}, fn)
		require.Equal(t, codes.Internal, status.Code(err), "%v", err)
		require.True(t, idempotency.IsFinal(err))
	}
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))
}

// A handler that ends the call's transaction on tx.Conn() and then panics
// (behind a recovery middleware): its writes may have committed, with the
// claim or on their own outside it, so the key keeps an error and the
// handler never runs again; the panic goes on.
func TestPanicAfterEndingTheTransactionOnConnRunsOnce(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, sql string }{
		{name: "a COMMIT", sql: `INSERT INTO ledger (note) VALUES ('x'); COMMIT`},
		{name: "a ROLLBACK, then a write outside", sql: `ROLLBACK; INSERT INTO ledger (note) VALUES ('x')`},
		{name: "a ROLLBACK, a write committed outside, then a failed block of its own",
			sql: `ROLLBACK; INSERT INTO ledger (note) VALUES ('x'); COMMIT; BEGIN; SELECT 1/0`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, 4)
			store := migratedStore(t, db)
			createLedger(t, db)
			var runs atomic.Int64
			fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				if runs.Add(1) == 1 {
					_, _ = tx.Conn().Exec(ctx, tc.sql, pgx.QueryExecModeSimpleProtocol)
					panic("a bug")
				}
				_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x')`)
				return wrapperspb.String("x"), err
			}
			call := idempotency.Call{Key: "k", Method: "m"}
			require.PanicsWithValue(t, "a bug", func() { _, _ = store.Execute(context.Background(), call, fn) })
			_, err := store.Execute(context.Background(), call, fn)
			requireStoredInternal(t, err, "ended the call's transaction")
			require.EqualValues(t, 1, runs.Load())
			require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))
		})
	}
}

// A handler that resets the connection it was handed the usual way
// (ROLLBACK, then DISCARD ALL, as connection-reset code does; or a cleanup
// of its own session advisory locks with pg_advisory_unlock_all) and then
// goes on writing through tx: the write is not sent (the call's
// transaction has ended), nothing commits, the call's error is stored, and
// a retry replays it. (A duplicate that arrives while such a handler still
// runs can run: the handler released the lock meant to keep it waiting;
// README, Limitations.)
func TestConnResetByTheHandler(t *testing.T) {
	t.Parallel()
	for name, reset := range map[string]string{
		"ROLLBACK; DISCARD ALL":                     `ROLLBACK; DISCARD ALL`,
		"ROLLBACK; SELECT pg_advisory_unlock_all()": `ROLLBACK; SELECT pg_advisory_unlock_all()`,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, 4)
			store := migratedStore(t, db, idempotency.WithInProgressWait(liveness))
			createLedger(t, db)
			var runs atomic.Int64
			reached := make(chan struct{})
			release := newGate()
			fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				n := runs.Add(1)
				if n == 1 {
					for _, sql := range strings.Split(reset, "; ") {
						if _, err := tx.Conn().Exec(ctx, sql); err != nil {
							close(reached)
							return nil, err
						}
					}
				}
				// The simple protocol: DISCARD ALL also dropped pgx's
				// prepared statements.
				if _, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('charge')`, pgx.QueryExecModeSimpleProtocol); err != nil {
					if n == 1 {
						close(reached)
					}
					return nil, err
				}
				if n == 1 {
					close(reached)
					_ = release.wait(ctx)
				}
				return wrapperspb.String(fmt.Sprintf("run %d", n)), nil
			}
			call := idempotency.Call{Key: "k", Method: "m"}
			first := executeAsync(store, call, fn)
			await(t, reached, "the first handler")
			release.open()
			errFirst := await(t, first, "the first call")
			require.Error(t, errFirst)
			// The retry comes once the first call has returned: a duplicate
			// that arrived while it still ran could have run, since the
			// handler released the key's lock itself (README, Limitations);
			// racing one here made the test fail whenever the duplicate
			// won that race, which proves nothing the library promises.
			res, errDup := store.Execute(context.Background(), call, fn)
			t.Logf("first: %v; retry: %v", errFirst, errDup)
			require.Equal(t, idempotency.OutcomeReplayed, res.Outcome, "the call's error is stored")
			require.Equal(t, errFirst.Error(), errDup.Error(), "the retry gets the first call's answer")
			require.EqualValues(t, 1, runs.Load(), "the handler ran once")
			require.Zero(t, db.Count(t, `SELECT count(*) FROM ledger`), "nothing of the first run committed")
		})
	}
}

// A handler rolls back on tx.Conn() and writes there, outside any
// transaction; a fault then ends the session (a failover, a network cut,
// pg_terminate_backend) before the handler returns. Its write committed:
// the call's error is stored on another connection, never Unavailable
// ("a retry is safe"), and the client's retry replays it.
func TestRollbackOnConnThenLostSessionIsStored(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	createLedger(t, db)
	var runs atomic.Int64
	fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		n := runs.Add(1)
		if n == 1 {
			pid, err := backendPID(ctx, tx)
			if err != nil {
				return nil, err
			}
			if _, err := tx.Conn().Exec(ctx, `ROLLBACK; INSERT INTO ledger (note) VALUES ('charge')`); err != nil {
				return nil, err
			}
			killBackend(t, uint32(pid)) // the session is lost before the handler returns
			return wrapperspb.String("run 1"), nil
		}
		if _, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('charge')`); err != nil {
			return nil, err
		}
		return wrapperspb.String(fmt.Sprintf("run %d", n)), nil
	}
	call := idempotency.Call{Key: "k", Method: "m"}
	_, errFirst := store.Execute(context.Background(), call, fn)
	t.Logf("first: %s %v (stored: %v); key row %q", status.Code(errFirst), errFirst, idempotency.IsFinal(errFirst), keyState(t, db, "k"))
	res, errRetry := store.Execute(context.Background(), idempotency.Call{Key: "k", Method: "m", Retry: true}, fn)
	t.Logf("retry: %v %v; ledger rows %d", res.Outcome, errRetry, db.Count(t, `SELECT count(*) FROM ledger`))
	require.NotEqual(t, codes.Unavailable, status.Code(errFirst), "Unavailable says a retry is safe, but the handler's write has committed")
	requireStoredInternal(t, errFirst, "the connection closed after the handler used tx.Conn()")
	require.Equal(t, idempotency.OutcomeReplayed, res.Outcome)
	require.EqualValues(t, 1, runs.Load(), "the retry ran the handler again")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))
}

// Reading Config hands out no connection (the next call gets the same
// backend), and works on a savepoint.
func TestConfigHandsOutNoConnection(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 1)
	store := migratedStore(t, db)
	pid := func(key string, read bool) (p int) {
		_, err := store.Execute(context.Background(), idempotency.Call{Key: key, Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			if read {
				require.NotNil(t, tx.(configuredTx).Config())
				sp, err := tx.Begin(ctx)
				require.NoError(t, err)
				require.NotNil(t, sp.(configuredTx).Config())
				require.NoError(t, sp.Commit(ctx))
			}
			return nil, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&p)
		})
		require.NoError(t, err)
		return p
	}
	first := pid("a", true)
	require.Equal(t, first, pid("b", false), "the connection went back to the pool")
}

type configuredTx interface{ Config() *pgxpool.Config }

// The call's transaction has Config() for River's driver, which reads
// ConnConfig.DefaultQueryExecMode from it on every statement. Each call
// gets its own copy: a handler that changes what it got (to open a side
// pool in simple-protocol mode, say) changes nothing another call sees,
// River's query mode included. (It failed when one config was shared.)
func TestTxConfigOfOneCallCannotChangeAnothers(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	want := db.Pool.Config()
	calls := 0
	config := func(edit func(*pgxpool.Config)) *pgxpool.Config {
		var got *pgxpool.Config
		calls++
		_, err := store.Execute(context.Background(), idempotency.Call{Key: fmt.Sprintf("call-%d", calls), Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			c, ok := tx.(configuredTx)
			require.True(t, ok)
			got = c.Config()
			require.NotNil(t, got)
			if edit != nil {
				edit(got)
			}
			return nil, nil
		})
		require.NoError(t, err)
		return got
	}
	config(func(c *pgxpool.Config) {
		c.MaxConns = 1
		c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	})
	other := config(nil)
	require.Equal(t, want.ConnConfig.DefaultQueryExecMode, other.ConnConfig.DefaultQueryExecMode, "another call's Config reports the pool's query mode, not what one handler wrote")
	require.Equal(t, want.MaxConns, other.MaxConns)
}
