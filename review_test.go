package idempotency_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
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

// What a hostile review of the row claim found, one test each, and what it
// tried that held: session state reaching the next call, PgBouncer, TTLs
// shorter than the call, handlers that reset their connection, saturated
// pools, every query mode at every isolation level.

// onePool is a pool of one connection on a schema of its own (so the
// next call gets the same connection unless the engine closed it), with a
// migrated store and a ledger.
func onePool(t *testing.T, opts ...idempotency.StoreOption) (*testdb.DB, *idempotency.Store) {
	t.Helper()
	db := testdb.New(t, 1)
	store := migratedStore(t, db, opts...)
	createLedger(t, db)
	return db, store
}

func execString(store *idempotency.Store, key string, fn func(ctx context.Context, tx pgx.Tx) (string, error)) (idempotency.Result, error) {
	return store.Execute(context.Background(), idempotency.Call{Key: key, Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		s, err := fn(ctx, tx)
		if err != nil {
			return nil, err
		}
		return wrapperspb.String(s), nil
	})
}

// backendPID is the PID of the session the call's transaction runs on.
func backendPID(ctx context.Context, tx pgx.Tx) (int, error) {
	var pid int
	err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid)
	return pid, err
}

// set_config named by a Unicode-escaped identifier costs the connection,
// like set_config: the next call on a pool of one starts from a session as
// the pool made it.
func TestUnicodeEscapedSetConfigCostsAReset(t *testing.T) {
	t.Parallel()
	_, store := onePool(t)
	_, err := execString(store, "a", func(ctx context.Context, tx pgx.Tx) (string, error) {
		_, err := tx.Exec(ctx, `SELECT U&"\0073et_config"('app.tenant', 'acme', false)`)
		return "a", err
	})
	require.NoError(t, err)
	var seen string
	_, err = execString(store, "b", func(ctx context.Context, tx pgx.Tx) (string, error) {
		return "b", tx.QueryRow(ctx, `SELECT coalesce(current_setting('app.tenant', true), '')`).Scan(&seen)
	})
	require.NoError(t, err)
	require.Empty(t, seen, "the next call sees the tenant that call a's handler set for its session")
}

// So does set_config in SQL text that a built-in function runs
// (query_to_xml): a session setting of the handler's own (a tenant, as
// row-level-security set-ups keep one) never reaches the next call.
func TestSQLRunFromTextCostsAReset(t *testing.T) {
	t.Parallel()
	_, store := onePool(t)
	_, err := execString(store, "a", func(ctx context.Context, tx pgx.Tx) (string, error) {
		_, err := tx.Exec(ctx, `SELECT query_to_xml('SELECT set_config(''app.tenant'', ''tenant-a'', false)', false, false, '')`)
		return "a", err
	})
	require.NoError(t, err)
	// Innocent calls on the pool of one: had the connection gone back to
	// the pool as the handler left it, each would see tenant-a.
	var seen []string
	for i := range 3 {
		res, err := execString(store, fmt.Sprintf("b%d", i), func(ctx context.Context, tx pgx.Tx) (string, error) {
			var tenant string
			err := tx.QueryRow(ctx, `SELECT coalesce(current_setting('app.tenant', true), '')`).Scan(&tenant)
			return tenant, err
		})
		require.NoError(t, err)
		seen = append(seen, res.Response.(*wrapperspb.StringValue).GetValue())
	}
	require.Equal(t, []string{"", "", ""}, seen, "innocent calls see the session setting another call's handler made")
}

// A statement a handler prepares by name with tx.Prepare would stay
// prepared on the pooled connection: the connection is closed instead, and
// the next call prepares the same name afresh.
func TestNamedPrepareCostsAReset(t *testing.T) {
	t.Parallel()
	db, store := onePool(t)
	_, err := execString(store, "a", func(ctx context.Context, tx pgx.Tx) (string, error) {
		if _, err := tx.Prepare(ctx, "add_note", `INSERT INTO ledger (note) VALUES ($1)`); err != nil {
			return "", err
		}
		_, err := tx.Exec(ctx, "add_note", "a")
		return "a", err
	})
	require.NoError(t, err)
	var leftOver []string
	_, err = execString(store, "b", func(ctx context.Context, tx pgx.Tx) (string, error) {
		rows, err := tx.Query(ctx, `SELECT name FROM pg_prepared_statements WHERE name = 'add_note'`)
		if err != nil {
			return "", err
		}
		leftOver, err = pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return "", err
		}
		if _, err := tx.Prepare(ctx, "add_note", `INSERT INTO ledger (note) VALUES ($1) RETURNING id`); err != nil {
			return "", err
		}
		_, err = tx.Exec(ctx, "add_note", "b")
		return "b", err
	})
	t.Logf("prepared statements of call a seen by call b: %v", leftOver)
	require.NoError(t, err, "an innocent call fails on the statement call a's handler prepared")
	require.Equal(t, 2, db.Count(t, `SELECT count(*) FROM ledger`))
}

// A temporary table created by a function the handler calls (the engine
// cannot read its body) is seen by the session's temporary schema
// appearing during the call: the connection is closed, and the next call
// creates its own scratch table.
func TestTemporaryObjectFromAFunctionCostsAReset(t *testing.T) {
	t.Parallel()
	db, store := onePool(t)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `CREATE FUNCTION stage() RETURNS void LANGUAGE plpgsql AS $$ BEGIN EXECUTE 'CREATE TEMPORARY TABLE scratch (x int)'; END $$`)
	require.NoError(t, err)
	_, err = execString(store, "a", func(ctx context.Context, tx pgx.Tx) (string, error) {
		_, err := tx.Exec(ctx, `SELECT stage()`)
		return "a", err
	})
	require.NoError(t, err)
	_, err = execString(store, "b", func(ctx context.Context, tx pgx.Tx) (string, error) {
		_, err := tx.Exec(ctx, `CREATE TEMPORARY TABLE scratch (x int) ON COMMIT DROP`)
		return "b", err
	})
	require.NoError(t, err, "an innocent call fails on the temporary table of call a's handler")
}

// A session-level advisory lock taken through query_to_xml does not
// outlive the call: the round trip that commits it releases the session's
// advisory locks.
func TestSessionAdvisoryLockCostsAReset(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	store := migratedStore(t, db)
	createLedger(t, db)
	_, err := execString(store, "a", func(ctx context.Context, tx pgx.Tx) (string, error) {
		_, err := tx.Exec(ctx, `SELECT query_to_xml('SELECT pg_advisory_lock(987654321)', false, false, '')`)
		return "a", err
	})
	require.NoError(t, err)
	// Another session gets the lock, never while a pooled connection holds
	// it (the wait would end at lock_timeout).
	ctx := context.Background()
	tx, err := testdb.Admin(t).Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, fmt.Sprintf(`SET LOCAL lock_timeout = '%dms'`, liveness.Milliseconds()))
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT pg_advisory_xact_lock(987654321)`)
	require.NoError(t, err, "the advisory lock call a's handler took is still held by a pooled connection")
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

// Behind PgBouncer in transaction pooling, a handler that commits on
// tx.Conn() hands the server connection back to PgBouncer while another
// client takes it: the key's lock is the transaction's alone behind a
// pooler, so nothing outlives the call, and both callers get the stored
// error.
func TestThroughPgBouncerCommitOnConnLeavesNoLock(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	pool := bouncedPoolWith(t, func(cfg *pgxpool.Config) { cfg.MaxConns = 2 })
	store, err := idempotency.NewStore(pool, idempotency.WithTable(db.Schema, idempotency.DefaultTable))
	require.NoError(t, err)
	ledger := pgx.Identifier{db.Schema, "ledger"}.Sanitize()
	ctx := context.Background()
	other, err := pgx.Connect(ctx, pgbouncerURL(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = other.Close(context.Background()) })
	var otherTx pgx.Tx
	var runs atomic.Int64
	fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		runs.Add(1)
		c := tx.Conn()
		var pid int
		if err := c.QueryRow(ctx, `INSERT INTO `+ledger+` (note, key) VALUES ('x', 'k') RETURNING pg_backend_pid()`).Scan(&pid); err != nil {
			return nil, err
		}
		if _, err := c.Exec(ctx, `COMMIT`); err != nil {
			return nil, err
		}
		// Another client of the same PgBouncer starts a transaction now,
		// and gets the server connection the handler just released.
		var err error
		if otherTx, err = beginOnReleasedServer(ctx, t, other, pid); err != nil {
			return nil, err
		}
		return wrapperspb.String("done"), nil
	}
	call := idempotency.Call{Key: "k", Method: "m"}
	_, err1 := store.Execute(ctx, call, fn)
	t.Logf("first call: %v", err1)
	require.NotNil(t, otherTx)
	require.NoError(t, otherTx.Commit(ctx))
	_, err2 := store.Execute(ctx, call, fn)
	t.Logf("second call: %v", err2)
	errForget := store.Forget(ctx, "", "k", "")
	t.Logf("forget: %v", errForget)
	require.EqualValues(t, 1, runs.Load())
	requireNoKeyLocks(t, db, "", []string{"k"}, "no lock of the key outlives its calls")
}

// Behind PgBouncer, a handler that rolls back on tx.Conn() and writes
// outside any transaction (its write commits) while another client takes
// the server connection: the engine stores the call's error, and the
// retry replays it (a session's lock left on that server connection made
// the store fail, and the retry ran the handler again).
func TestThroughPgBouncerRollbackOnConnRunsOnce(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	// A PgBouncer of the test's own: the test ends the handler's server
	// connection after the pooler handed it on, which on a shared pooler
	// may be another test's by then.
	url := pgbouncerOf(t, 2)
	pool := bouncedPoolAt(t, url, func(cfg *pgxpool.Config) { cfg.MaxConns = 2 })
	store, err := idempotency.NewStore(pool, idempotency.WithTable(db.Schema, idempotency.DefaultTable), idempotency.WithInProgressWait(200*time.Millisecond))
	require.NoError(t, err)
	ledger := pgx.Identifier{db.Schema, "ledger"}.Sanitize()
	ctx := context.Background()
	other, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = other.Close(context.Background()) })
	var otherTx pgx.Tx
	var handlerPID int
	var runs atomic.Int64
	fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		n := runs.Add(1)
		c := tx.Conn()
		if n == 1 {
			if err := c.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&handlerPID); err != nil {
				return nil, err
			}
			if _, err := c.Exec(ctx, `ROLLBACK`); err != nil {
				return nil, err
			}
			var err error
			if otherTx, err = beginOnReleasedServer(ctx, t, other, handlerPID); err != nil {
				return nil, err
			}
		}
		if _, err := c.Exec(ctx, `INSERT INTO `+ledger+` (note, key) VALUES ('charge', 'k')`); err != nil {
			return nil, err
		}
		return wrapperspb.String("done"), nil
	}
	call := idempotency.Call{Key: "k", Method: "m"}
	_, err1 := store.Execute(ctx, call, fn)
	t.Logf("first call: %v (stored: %v)", err1, idempotency.IsFinal(err1))
	require.NotNil(t, otherTx)
	require.NoError(t, otherTx.Commit(ctx))
	_, err2 := store.Execute(ctx, call, fn)
	t.Logf("retry while the server connection lives: %v", err2)
	t.Logf("key locks held: %d, key row state %q", heldKeyLocks(t, db, "", []string{"k"}), keyState(t, db, "k"))
	// PgBouncer closes server connections (server_lifetime,
	// server_idle_timeout, a restart): here, the one that holds the lock.
	killBackend(t, uint32(handlerPID))
	_, err3 := store.Execute(ctx, call, fn)
	t.Logf("retry after the server connection went: %v", err3)
	require.EqualValues(t, 1, runs.Load(), "the handler ran again after its write had committed")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM `+ledger))
}

// Where the database's default is SERIALIZABLE, concurrent callers of the
// same keys and of different keys: each key runs once, every caller of a
// key gets the same answer, and no call of one key fails because of
// another key.
func TestSerializableDefaultManyCallers(t *testing.T) {
	t.Parallel()
	db := testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
		cfg.MaxConns = 8
		cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "serializable"
	})
	store := migratedStore(t, db, idempotency.WithInProgressWait(20*time.Second))
	createLedger(t, db)
	var runs sync.Map
	fn := func(key string) idempotency.Func {
		return func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			v, _ := runs.LoadOrStore(key, new(atomic.Int64))
			v.(*atomic.Int64).Add(1)
			var id int64
			if err := tx.QueryRow(ctx, `INSERT INTO ledger (note) VALUES ($1) RETURNING id`, key).Scan(&id); err != nil {
				return nil, err
			}
			return wrapperspb.String(fmt.Sprintf("%s#%d", key, id)), nil
		}
	}
	const keys, callers = 8, 4
	var wg sync.WaitGroup
	answers := make([][]string, keys)
	for k := range keys {
		answers[k] = make([]string, callers)
		for c := range callers {
			wg.Go(func() {
				key := fmt.Sprintf("k%d", k)
				res, err := store.Execute(context.Background(), idempotency.Call{Key: key, Method: "m"}, fn(key))
				if err != nil {
					answers[k][c] = "error " + status.Code(err).String() + ": " + err.Error()
					return
				}
				answers[k][c] = res.Response.(*wrapperspb.StringValue).GetValue()
			})
		}
	}
	wg.Wait()
	for k := range keys {
		for c := range callers {
			require.NotContains(t, answers[k][c], "error", "key %d caller %d", k, c)
			require.Equal(t, answers[k][0], answers[k][c], "key %d", k)
		}
	}
	require.Equal(t, keys, db.Count(t, `SELECT count(*) FROM ledger`))
}

// Behind PgBouncer in transaction pooling, a setting a handler changes for
// the session (a plain SET) would stay on PgBouncer's server connection,
// which outlives the engine's client connection: the engine resets it
// with the commit, and the next call PgBouncer gives it sees none of it.
func TestThroughPgBouncerSessionSettingIsReset(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	pool := bouncedPoolWith(t, func(cfg *pgxpool.Config) { cfg.MaxConns = 1 })
	store, err := idempotency.NewStore(pool, idempotency.WithTable(db.Schema, idempotency.DefaultTable))
	require.NoError(t, err)
	var pidA, pidB int
	_, err = execString(store, "a", func(ctx context.Context, tx pgx.Tx) (string, error) {
		var err error
		if pidA, err = backendPID(ctx, tx); err != nil {
			return "", err
		}
		_, err = tx.Exec(ctx, `SET app.tenant = 'acme'`)
		return "a", err
	})
	require.NoError(t, err)
	var seen string
	_, err = execString(store, "b", func(ctx context.Context, tx pgx.Tx) (string, error) {
		var err error
		if pidB, err = backendPID(ctx, tx); err != nil {
			return "", err
		}
		return "b", tx.QueryRow(ctx, `SELECT coalesce(current_setting('app.tenant', true), '')`).Scan(&seen)
	})
	require.NoError(t, err)
	t.Logf("call a on server backend %d, call b on %d", pidA, pidB)
	require.Empty(t, seen, "call b sees the tenant call a's handler set for its session")
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

// Tiny TTLs reused concurrently, with the cleaner and Forget racing the
// calls: the handler of a key never runs twice at once, nobody gets an
// error other than "in progress", and no lock is left.
func TestTinyTTLsWithCleanerAndForget(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 10)
	store := migratedStore(t, db, idempotency.WithInProgressWait(5*time.Second))
	createLedger(t, db)
	ctx, cancel := context.WithCancel(context.Background())
	var running sync.Map
	var overlaps, runs atomic.Int64
	fn := func(key string) idempotency.Func {
		return func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			v, _ := running.LoadOrStore(key, new(atomic.Int64))
			if v.(*atomic.Int64).Add(1) > 1 {
				overlaps.Add(1)
			}
			defer v.(*atomic.Int64).Add(-1)
			runs.Add(1)
			if _, err := tx.Exec(ctx, `INSERT INTO ledger (note) SELECT $1::text FROM pg_sleep(0.002)`, key); err != nil {
				return nil, err
			}
			return wrapperspb.String(key), nil
		}
	}
	var bg sync.WaitGroup
	bg.Go(func() { _ = store.RunCleaner(ctx, time.Millisecond, 100, nil) })
	bg.Go(func() {
		for ctx.Err() == nil {
			for k := range 3 {
				_ = store.Forget(ctx, "", fmt.Sprintf("k%d", k), "")
			}
		}
	})
	var mu sync.Mutex
	bad := map[string]int{}
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Go(func() {
			for i := range 30 {
				key := fmt.Sprintf("k%d", (g+i)%3)
				ttl := time.Duration(1+(i%3)*5) * time.Millisecond
				_, err := store.Execute(context.Background(), idempotency.Call{Key: key, Method: "m", TTL: ttl, Retry: i%2 == 0}, fn(key))
				if err != nil && !idempotency.IsInProgress(err) {
					mu.Lock()
					bad[status.Code(err).String()+": "+err.Error()]++
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	cancel()
	bg.Wait()
	t.Logf("%d runs", runs.Load())
	require.Empty(t, bad)
	require.Zero(t, overlaps.Load(), "a key's handler ran twice at once")
	// A Forget cut short by the cancellation may hold its locks until its
	// backend notices the closed connection.
	require.Eventually(t, func() bool { return heldKeyLocks(t, db, "", []string{"k0", "k1", "k2"}) == 0 }, 10*time.Second, 10*time.Millisecond)
}

// A saturated pool (MaxConns 1 and 2) and 16+ callers of few keys, with
// handlers that misbehave in turn (tx.Conn() with a COMMIT, a panic, an
// error, an aborted statement ignored, rows left open): every key's callers
// agree on one answer, a key whose handler committed anything never runs
// again, nobody gets Unavailable, and no lock is left.
func TestSaturatedPoolsWithMisbehavingHandlers(t *testing.T) {
	t.Parallel()
	for _, conns := range []int32{1, 2} {
		t.Run(fmt.Sprintf("MaxConns=%d", conns), func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, conns)
			store := migratedStore(t, db, idempotency.WithInProgressWait(30*time.Second))
			createLedger(t, db)
			const keys = 6
			var runs [keys]atomic.Int64
			fn := func(k int) idempotency.Func {
				return func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
					n := runs[k].Add(1)
					if _, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ($1)`, fmt.Sprintf("k%d run %d", k, n)); err != nil {
						return nil, err
					}
					switch k {
					case 0:
						if _, err := tx.Conn().Exec(ctx, `COMMIT`); err != nil {
							return nil, err
						}
					case 1:
						if n == 1 {
							panic("boom")
						}
					case 2:
						if n == 1 {
							return nil, status.Error(codes.Unavailable, "provider down")
						}
					case 3:
						_, _ = tx.Exec(ctx, `SELECT 1/0`)
					case 4:
						rows, err := tx.Query(ctx, `SELECT generate_series(1, 100000)`)
						if err != nil {
							return nil, err
						}
						_ = rows // left open
					}
					return wrapperspb.String(fmt.Sprintf("k%d run %d", k, n)), nil
				}
			}
			type answer struct {
				code codes.Code
				msg  string
			}
			answers := make([][]answer, keys)
			var mu sync.Mutex
			var wg sync.WaitGroup
			for c := range 18 {
				k := c % keys
				wg.Go(func() {
					var res idempotency.Result
					var err error
					func() {
						defer func() { _ = recover() }()
						res, err = store.Execute(context.Background(), idempotency.Call{Key: fmt.Sprintf("k%d", k), Method: "m"}, fn(k))
					}()
					a := answer{code: status.Code(err), msg: status.Convert(err).Message()}
					if err == nil && res.Response != nil {
						a.msg = res.Response.(*wrapperspb.StringValue).GetValue()
					}
					mu.Lock()
					answers[k] = append(answers[k], a)
					mu.Unlock()
				})
			}
			wg.Wait()
			// Retries of the failed first runs (panic, Unavailable) then
			// settle those keys; everyone after agrees.
			for k := range keys {
				var last answer
				for range 2 {
					var res idempotency.Result
					var err error
					func() {
						defer func() { _ = recover() }()
						res, err = store.Execute(context.Background(), idempotency.Call{Key: fmt.Sprintf("k%d", k), Method: "m"}, fn(k))
					}()
					a := answer{code: status.Code(err), msg: status.Convert(err).Message()}
					if err == nil && res.Response != nil {
						a.msg = res.Response.(*wrapperspb.StringValue).GetValue()
					}
					if last != (answer{}) {
						require.Equal(t, last, a, "key k%d: two later callers disagree", k)
					}
					last = a
				}
				t.Logf("k%d: runs %d, first callers %v, final %v", k, runs[k].Load(), answers[k], last)
				for _, a := range answers[k] {
					if a.msg != "provider down" { // the handler's own error
						require.NotEqual(t, codes.Unavailable, a.code, "k%d: %s", k, a.msg)
					}
				}
			}
			require.EqualValues(t, 1, runs[0].Load(), "committed on tx.Conn(): never again")
			require.EqualValues(t, 1, runs[3].Load(), "ignored failure: stored")
			require.EqualValues(t, 1, runs[4].Load(), "rows left open: stored")
			require.EqualValues(t, 1, runs[5].Load())
			keyNames := make([]string, keys)
			for k := range keys {
				keyNames[k] = fmt.Sprintf("k%d", k)
			}
			requireNoKeyLocks(t, db, "", keyNames, "a key's lock outlived its calls")
		})
	}
}

// Every query mode, REPEATABLE READ and SERIALIZABLE, 16 callers on each of
// a few keys on a pool of 2: each key runs once, every caller of a key gets
// the same bytes, nobody fails.
func TestQueryModesAndIsolationLevelsUnderLoad(t *testing.T) {
	t.Parallel()
	modes := map[string]pgx.QueryExecMode{
		"cache_statement": pgx.QueryExecModeCacheStatement, "cache_describe": pgx.QueryExecModeCacheDescribe,
		"describe_exec": pgx.QueryExecModeDescribeExec, "exec": pgx.QueryExecModeExec, "simple_protocol": pgx.QueryExecModeSimpleProtocol,
	}
	for name, mode := range modes {
		for _, iso := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable, ""} {
			t.Run(name+"/"+string(iso), func(t *testing.T) {
				db := testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
					cfg.MaxConns = 2
					cfg.ConnConfig.DefaultQueryExecMode = mode
					cfg.ConnConfig.RuntimeParams["bytea_output"] = "escape"
					cfg.ConnConfig.RuntimeParams["DateStyle"] = "SQL, DMY"
					cfg.ConnConfig.RuntimeParams["IntervalStyle"] = "iso_8601"
					cfg.ConnConfig.RuntimeParams["TimeZone"] = "Pacific/Chatham"
					cfg.ConnConfig.RuntimeParams["extra_float_digits"] = "-15"
				})
				store := migratedStore(t, db, idempotency.WithInProgressWait(30*time.Second), idempotency.WithIsolation(iso))
				createLedger(t, db)
				var runs atomic.Int64
				fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
					runs.Add(1)
					var id int64
					var now string
					if err := tx.QueryRow(ctx, `INSERT INTO ledger (note) VALUES ('x') RETURNING id, now()::text`).Scan(&id, &now); err != nil {
						return nil, err
					}
					return wrapperspb.Bytes([]byte(fmt.Sprintf("%d %s \x00\xff", id, now))), nil
				}
				const keys, callers = 3, 16
				got := make([][]string, keys)
				var mu sync.Mutex
				var wg sync.WaitGroup
				for k := range keys {
					for range callers {
						wg.Go(func() {
							res, err := store.Execute(context.Background(), idempotency.Call{Key: fmt.Sprintf("k%d", k), Method: "m", Fingerprint: []byte{0, 1, 0xff}}, fn)
							s := ""
							if err != nil {
								s = "error " + err.Error()
							} else {
								b, _ := proto.Marshal(res.Response)
								s = fmt.Sprintf("%x", b)
							}
							mu.Lock()
							got[k] = append(got[k], s)
							mu.Unlock()
						})
					}
				}
				wg.Wait()
				for k := range keys {
					for _, s := range got[k] {
						require.Equal(t, got[k][0], s, "key %d", k)
					}
					require.NotContains(t, got[k][0], "error")
				}
				require.EqualValues(t, keys, runs.Load())
				require.Equal(t, keys, db.Count(t, `SELECT count(*) FROM ledger`))
				requireNoKeyLocks(t, db, "", []string{"k0", "k1", "k2"}, "a key's lock outlived its calls")
			})
		}
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
			first := make(chan error, 1)
			go func() {
				_, err := store.Execute(context.Background(), call, fn)
				first <- err
			}()
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

// beginOnReleasedServer begins a transaction of another client of the same
// PgBouncer, which takes the server connection the handler (on the backend
// handlerPID) has just released, and logs which backend it got.
func beginOnReleasedServer(ctx context.Context, t *testing.T, other *pgx.Conn, handlerPID int) (pgx.Tx, error) {
	tx, err := other.Begin(ctx)
	if err != nil {
		return nil, err
	}
	var otherPID int
	if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&otherPID); err != nil {
		return tx, err // the caller's cleanup rolls it back
	}
	t.Logf("handler's server backend %d, other client's %d", handlerPID, otherPID)
	return tx, nil
}
