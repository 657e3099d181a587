package idempotency_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// The engine prepares the statements of its round trips once per
// connection, and a pgx tracer on the pool sees each round trip as the
// batch it is, the COMMIT's included, in the order they were sent.
func TestRoundTripsPrepareOncePerConnectionAndReachTheTracer(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var batches [][]string
	db := testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
		cfg.MaxConns = 1
		cfg.ConnConfig.Tracer = &testdb.Tracer{OnRoundTrip: func(_ context.Context, _ *pgx.Conn, statements []string) {
			mu.Lock()
			batches = append(batches, statements)
			mu.Unlock()
		}}
	})
	store := migratedStore(t, db)
	createLedger(t, db)
	write := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) { return writeLedger(ctx, tx) }
	prepared := func() int {
		return db.Count(t, `SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'idempotency\_%'`)
	}
	call := func(i int) {
		res, err := store.Execute(context.Background(), idempotency.Call{Key: fmt.Sprintf("k%d", i), Method: "m"}, write)
		require.NoError(t, err)
		require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
	}
	call(0)
	first := prepared()
	require.NotZero(t, first, "the engine's statements are prepared on the connection")
	mu.Lock()
	batches = nil
	mu.Unlock()
	for i := 1; i <= 5; i++ {
		call(i)
	}
	require.Equal(t, first, prepared(), "later calls on the connection prepare nothing more")
	mu.Lock()
	defer mu.Unlock()
	var claims, commits int
	for _, b := range batches {
		if slices.ContainsFunc(b, func(s string) bool { return strings.HasPrefix(s, "SAVEPOINT idempotency_claim_") }) {
			claims++
		}
		if testdb.HasCommit(b) {
			require.Equal(t, 1, claims-commits, "each call's COMMIT follows its claim: %q", b)
			commits++
		}
	}
	require.Equal(t, 5, claims, "every claim's round trip reached the tracer")
	require.Equal(t, 5, commits, "every commit's round trip reached the tracer")
}

// A pool that deallocates everything with pgx's DeallocateAll whenever a
// connection goes back (AfterRelease), or an application that does so
// between calls: the engine prepares its statements again on the same
// connection, instead of replacing the connection on every call.
func TestRoundTripsFollowPgxDeallocateAllOutsideTheEngine(t *testing.T) {
	t.Parallel()
	for _, where := range []string{"AfterRelease", "between calls"} {
		t.Run(where, func(t *testing.T) {
			t.Parallel()
			db := testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
				cfg.MaxConns = 1
				if where == "AfterRelease" {
					cfg.AfterRelease = func(c *pgx.Conn) bool { return c.DeallocateAll(context.Background()) == nil }
				}
			})
			store := migratedStore(t, db)
			createLedger(t, db)
			ctx := context.Background()
			pids := map[int]bool{}
			for i := range 5 {
				if where == "between calls" && i > 0 {
					c, err := db.Pool.Acquire(ctx)
					require.NoError(t, err)
					require.NoError(t, c.Conn().DeallocateAll(ctx))
					c.Release()
				}
				var pid int
				res, err := store.Execute(ctx, idempotency.Call{Key: fmt.Sprintf("k%d", i), Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
					var err error
					if pid, err = backendPID(ctx, tx); err != nil {
						return nil, err
					}
					return writeLedger(ctx, tx)
				})
				require.NoError(t, err, "call %d", i)
				require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
				pids[pid] = true
			}
			require.Equal(t, 5, db.Count(t, `SELECT count(*) FROM ledger`))
			require.Len(t, pids, 1, "the connection is kept: pgx's DeallocateAll does not cost it")
		})
	}
}

// A handler that deallocates one of the engine's statements by its name
// (in a DO block, which pgx cannot see): the call fails once, truthfully,
// nothing of it committed, and the next calls on the same pool run.
func TestRoundTripsSurviveAHandlerDeallocatingAnEngineStatement(t *testing.T) {
	t.Parallel()
	for _, sql := range []string{"COMMIT", "RESET ALL", "UNLISTEN *"} {
		t.Run(sql, func(t *testing.T) {
			t.Parallel()
			db, store := onePool(t)
			ctx := context.Background()
			call := func(key string, then string) (idempotency.Result, error) {
				return store.Execute(ctx, idempotency.Call{Key: key, Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
					resp, err := writeLedger(ctx, tx)
					if err == nil && then != "" {
						_, err = tx.Exec(ctx, then)
					}
					return resp, err
				})
			}
			_, err := call("warm", "")
			require.NoError(t, err)
			digest := sha256.Sum256([]byte(sql))
			name := "idempotency_" + hex.EncodeToString(digest[:24])
			require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM pg_prepared_statements WHERE name = '`+name+`'`), "the engine's statement, under its name")
			_, err = call("x", `DO $$ BEGIN EXECUTE 'DEALLOCATE `+name+`'; END $$`)
			if err != nil {
				require.NotContains(t, err.Error(), "deferred trigger", "the error names the cause")
				require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`), "a failed call committed nothing")
			}
			for i := range 3 {
				res, err := call(fmt.Sprintf("after%d", i), "")
				require.NoError(t, err, "call %d after", i)
				require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
			}
			retry, _ := call("x", "")
			if err == nil {
				require.Equal(t, idempotency.OutcomeReplayed, retry.Outcome)
			}
		})
	}
}
