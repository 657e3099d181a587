package idempotency_test

import (
	"context"
	"fmt"
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

// withdraw is a handler that reads an account's balance and writes it back
// less 10: a lost update at READ COMMITTED when two run interleaved.
// Before writing, the first run of each key waits until both keys' first
// runs have read, so that they interleave.
type withdrawal struct {
	read    sync.WaitGroup
	mu      sync.Mutex
	ran     map[string]bool
	levels  []string
	aborted atomic.Int64
}

func newWithdrawal() *withdrawal {
	w := &withdrawal{ran: map[string]bool{}}
	w.read.Add(2)
	return w
}

func (w *withdrawal) run(ctx context.Context, tx pgx.Tx, key string) (proto.Message, error) {
	var balance int
	var level string
	if err := tx.QueryRow(ctx, `SELECT balance, current_setting('transaction_isolation') FROM accounts WHERE id = 1`).Scan(&balance, &level); err != nil {
		return nil, err
	}
	w.mu.Lock()
	first := !w.ran[key]
	w.ran[key] = true
	w.levels = append(w.levels, level)
	w.mu.Unlock()
	if first {
		w.read.Done()
		w.read.Wait()
	}
	_, err := tx.Exec(ctx, `UPDATE accounts SET balance = $1 WHERE id = 1`, balance-10)
	return wrapperspb.String(fmt.Sprint("balance ", balance-10)), err
}

// A database whose default is SERIALIZABLE keeps it: two interleaved
// withdrawals cannot both apply to the same balance; one is Aborted, and
// retried with its key it applies to the new balance.
func TestSerializableDefaultIsHonoured(t *testing.T) {
	t.Parallel()
	db := testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "serializable"
	})
	requireSerializableWithdrawals(t, db, migratedStore(t, db), "")
}

// WithIsolation, and Call.Isolation, raise the level where the database's
// default is READ COMMITTED.
func TestIsolationCanBeChosen(t *testing.T) {
	t.Parallel()
	t.Run("WithIsolation", func(t *testing.T) {
		t.Parallel()
		db := testdb.New(t, 4)
		requireSerializableWithdrawals(t, db, migratedStore(t, db, idempotency.WithIsolation(pgx.Serializable)), "")
	})
	t.Run("Call.Isolation", func(t *testing.T) {
		t.Parallel()
		db := testdb.New(t, 4)
		requireSerializableWithdrawals(t, db, migratedStore(t, db), pgx.Serializable)
	})
	t.Run("REPEATABLE READ", func(t *testing.T) {
		t.Parallel()
		db := testdb.New(t, 4)
		requireSerializableWithdrawals(t, db, migratedStore(t, db), pgx.RepeatableRead)
	})
}

func requireSerializableWithdrawals(t *testing.T, db *testdb.DB, store *idempotency.Store, level pgx.TxIsoLevel) {
	t.Helper()
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL); INSERT INTO accounts VALUES (1, 100)`)
	require.NoError(t, err)
	w := newWithdrawal()
	var wg sync.WaitGroup
	for _, key := range []string{"w-1", "w-2"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			call := idempotency.Call{Key: key, Method: "withdraw", Isolation: level}
			fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) { return w.run(ctx, tx, key) }
			for attempt := 0; attempt < 5; attempt++ { // as a client retries Aborted with its key
				_, err := store.Execute(ctx, call, fn)
				if status.Code(err) != codes.Aborted {
					require.NoError(t, err)
					return
				}
				w.aborted.Add(1)
			}
			t.Errorf("%s: still Aborted after 5 attempts", key)
		}()
	}
	wg.Wait()
	require.Equal(t, 80, db.Count(t, `SELECT balance FROM accounts`), "both withdrawals, neither lost")
	require.Positive(t, w.aborted.Load(), "one was Aborted and retried")
	want := "serializable"
	if level == pgx.RepeatableRead {
		want = "repeatable read"
	}
	for _, l := range w.levels {
		require.Equal(t, want, l, "the handler's transaction")
	}
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
