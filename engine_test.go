package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// Tests of the engine's own edges, through Store.Execute.

// A transaction a handler kept is dead once its call is over: it can write
// neither into an idle pooled connection nor into another call's
// transaction.
func TestCallTransactionIsDeadAfterTheCall(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 1) // one connection: the next call gets the same one
	ctx := context.Background()
	store := migratedStore(t, db)
	createLedger(t, db)

	var kept pgx.Tx
	_, err := store.Execute(ctx, idempotency.Call{Key: "first", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		kept = tx
		_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('first')`)
		return nil, err
	})
	require.NoError(t, err)

	_, err = kept.Exec(ctx, `INSERT INTO ledger (note) VALUES ('after the call')`)
	require.ErrorIs(t, err, pgx.ErrTxClosed)
	var n int
	require.ErrorIs(t, kept.QueryRow(ctx, `SELECT 1`).Scan(&n), pgx.ErrTxClosed)
	_, err = kept.Query(ctx, `SELECT 1`)
	require.ErrorIs(t, err, pgx.ErrTxClosed)
	_, err = kept.Begin(ctx)
	require.ErrorIs(t, err, pgx.ErrTxClosed)
	require.ErrorIs(t, kept.Commit(ctx), pgx.ErrTxClosed)
	require.ErrorIs(t, kept.SendBatch(ctx, &pgx.Batch{}).Close(), pgx.ErrTxClosed)
	_, err = kept.CopyFrom(ctx, pgx.Identifier{"ledger"}, []string{"note"}, pgx.CopyFromRows([][]any{{"copied"}}))
	require.ErrorIs(t, err, pgx.ErrTxClosed)

	// Used while another call runs on the same connection: still refused.
	_, err = store.Execute(ctx, idempotency.Call{Key: "second", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		_, err := kept.Exec(ctx, `INSERT INTO ledger (note) VALUES ('into another call')`)
		require.ErrorIs(t, err, pgx.ErrTxClosed)
		return nil, errStop
	})
	require.ErrorIs(t, err, errStop)
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`), "only the first call's own write")
}

var errStop = errors.New("stop")

// A key must not expire while its call commits: with a TTL of 500 ms and a
// COMMIT that takes 800 ms, the key lives a full TTL from when the COMMIT
// finished, not from when the key row was written.
func TestKeyOutlivesASlowCommit(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	ctx := context.Background()
	store := migratedStore(t, db)
	_, err := db.Pool.Exec(ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, note text NOT NULL);
CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.8); RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON ledger DEFERRABLE INITIALLY DEFERRED
FOR EACH ROW EXECUTE FUNCTION slow_commit()`)
	require.NoError(t, err)
	const ttl, commit = 500 * time.Millisecond, 800 * time.Millisecond
	call := idempotency.Call{Key: "k", Method: "m", TTL: ttl}
	res, err := store.Execute(ctx, call, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x')`)
		return wrapperspb.String("charged"), err
	})
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
	// The key row is written before the COMMIT runs the deferred trigger.
	var lifetime time.Duration
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT (extract(epoch FROM expires_at - created_at) * 1e6)::bigint FROM idempotency_keys WHERE key = 'k'`).Scan(&lifetime))
	lifetime *= time.Microsecond
	require.GreaterOrEqual(t, lifetime, commit+ttl, "the key's TTL counts from the end of its slow COMMIT")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))
}

// Two stores on two tables of one database never share a key's lock: a
// call holding key k in one does not make the same key wait in the other.
func TestStoresOnTwoTablesShareNoLocks(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	ctx := context.Background()
	a := migratedStore(t, db, idempotency.WithTable("", "keys_a"), idempotency.WithInProgressWait(50*time.Millisecond))
	b := migratedStore(t, db, idempotency.WithTable("", "keys_b"), idempotency.WithInProgressWait(50*time.Millisecond))
	holding, release := make(chan struct{}), make(chan struct{})
	doneA := make(chan error, 1)
	go func() {
		_, err := a.Execute(ctx, idempotency.Call{Scope: "s", Key: "k", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) {
			close(holding)
			select { // released by the test, or abandoned when it fails
			case <-release:
			case <-ctx.Done():
			}
			return nil, nil
		})
		doneA <- err
	}()
	await(t, holding, "the first call's handler to run")
	res, err := b.Execute(ctx, idempotency.Call{Scope: "s", Key: "k", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) { return nil, nil })
	require.NoError(t, err, "the other table's key is free")
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
	_, err = a.Execute(ctx, idempotency.Call{Scope: "s", Key: "k", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) { return nil, nil })
	require.ErrorIs(t, err, idempotency.ErrInProgress, "the same table's key is held")
	close(release)
	require.NoError(t, <-doneA)
}

// The primary key decides, whoever writes the key's row: a writer that
// does not take the key's lock (an older engine during a rolling upgrade,
// an operator's INSERT) waits for the call's claim, which is in the call's
// transaction from its first statement, and then fails on the primary key;
// the call's result is the key's. A row such a writer committed before the
// call's claim is the call's answer.
func TestRowWrittenWithoutTheLockMeetsTheClaim(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	ctx := context.Background()
	store := migratedStore(t, db)
	createLedger(t, db)
	other, err := proto.Marshal(wrapperspb.String("the other writer's response"))
	require.NoError(t, err)
	insert := func(key string) error {
		_, err := testdb.Admin(t).Exec(ctx, `INSERT INTO `+pgx.Identifier{db.Schema, idempotency.DefaultTable}.Sanitize()+`
(scope, key, method, fingerprint, state, response_type, response, expires_at)
VALUES ('s', $1, 'm', '\x01', 'succeeded', 'google.protobuf.StringValue', $2, now() + interval '1 hour')`, key, other)
		return err
	}
	var runs atomic.Int64
	foreign := make(chan error, 1)
	res, err := store.Execute(ctx, idempotency.Call{Scope: "s", Key: "k", Method: "m", Fingerprint: []byte{1}}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		runs.Add(1)
		go func() { foreign <- insert("k") }()
		// The foreign INSERT waits for the claim: wait until it does.
		require.Eventually(t, func() bool {
			return db.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO%'`) > 0
		}, 30*time.Second, time.Millisecond)
		_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('mine')`)
		return wrapperspb.String("mine"), err
	})
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
	require.Equal(t, "23505", sqlStateOf(await(t, foreign, "the foreign INSERT")), "the claim's row took the key")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))

	require.NoError(t, insert("k2"))
	res, err = store.Execute(ctx, idempotency.Call{Scope: "s", Key: "k2", Method: "m", Fingerprint: []byte{1}}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		runs.Add(1)
		return nil, nil
	})
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeReplayed, res.Outcome)
	require.Equal(t, "the other writer's response", res.Response.(*wrapperspb.StringValue).GetValue())
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 2, db.Count(t, `SELECT count(*) FROM idempotency_keys`))
}

// sqlStateOf is the SQLSTATE of a PostgreSQL error, "" for any other.
func sqlStateOf(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// A finished key is never run again, whatever the caller marks: a first
// attempt (no retry marker) looks the key up under its lock before Func
// runs. Func is counted, not the ledger: a run that rolls back is still a
// run, and its calls to other systems would have happened.
func TestFinishedKeyNeverRunsAgain(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	ctx := context.Background()
	store := migratedStore(t, db)
	createLedger(t, db)
	var runs atomic.Int64
	run := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		runs.Add(1)
		_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x')`)
		return wrapperspb.String(fmt.Sprint("run ", runs.Load())), err
	}
	first, err := store.Execute(ctx, idempotency.Call{Key: "k", Method: "m"}, run)
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeExecuted, first.Outcome)
	for _, retry := range []bool{false, true, false} {
		again, err := store.Execute(ctx, idempotency.Call{Key: "k", Method: "m", Retry: retry}, run)
		require.NoError(t, err)
		require.Equal(t, idempotency.OutcomeReplayed, again.Outcome, "retry marker %v", retry)
		require.True(t, proto.Equal(first.Response, again.Response), "the first run's response")
	}
	_, err = store.Execute(ctx, idempotency.Call{Key: "k", Method: "m", Fingerprint: []byte("other")}, run)
	require.ErrorIs(t, err, idempotency.ErrKeyReused)
	require.EqualValues(t, 1, runs.Load(), "Func ran once")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))
}
