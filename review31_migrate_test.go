package idempotency_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// Sixteen replicas start at once on an empty schema, naming one table in
// four ways: with its schema, through a search_path of that schema alone,
// through one whose first schema does not exist, and with the schema
// quoted in the search_path. Every Migrate succeeds, one table is made,
// each version is recorded once, and every store then serves calls.
func TestReview31SixteenReplicasMigrateOneTableSpelledFourWays(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	ctx := context.Background()
	paths := []string{"", db.Schema, "r31_absent_schema, " + db.Schema, `"` + db.Schema + `"`}
	var stores []*idempotency.Store
	for i := range 16 {
		path := paths[i%len(paths)]
		var opt idempotency.StoreOption
		pool := db.Pool
		if path == "" {
			opt = idempotency.WithTable(db.Schema, "keys")
		} else {
			pool = schemaPool(t, path, 1, nil)
			opt = idempotency.WithTable("", "keys")
		}
		s, err := idempotency.NewStore(pool, opt)
		require.NoError(t, err)
		stores = append(stores, s)
	}
	all, err := idempotency.Migrations("", "keys")
	require.NoError(t, err)
	for round := range 3 {
		_, err := db.Pool.Exec(ctx, `DROP TABLE IF EXISTS keys, keys_migrations`)
		require.NoError(t, err)
		start := make(chan struct{})
		errs := make(chan error, len(stores))
		for _, s := range stores {
			go func() {
				<-start
				errs <- s.Migrate(ctx)
			}()
		}
		close(start)
		for range stores {
			require.NoError(t, <-errs, "round %d", round)
		}
		require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM pg_tables WHERE tablename = 'keys' AND schemaname IN ($1, 'public', 'r31_absent_schema')`, db.Schema), "round %d", round)
		require.Equal(t, len(all), db.Count(t, `SELECT count(*) FROM keys_migrations`), "round %d", round)
		for i, s := range stores {
			res, err := s.Execute(ctx, idempotency.Call{Scope: "s", Key: fmt.Sprintf("r%d-k%d", round, i%4), Method: "/r31.Svc/Do"},
				func(context.Context, pgx.Tx) (proto.Message, error) { return wrapperspb.String("ok"), nil })
			require.NoError(t, err, "store %d", i)
			if i >= 4 {
				require.Equal(t, idempotency.OutcomeReplayed, res.Outcome, "store %d shares the table", i)
			}
		}
	}
}

// Migrate brings a table from version 2 (rows of an older release to move,
// 003; the fillfactor, 004) while sixteen workers make calls through the
// same table: no call fails, none runs twice (each key's handler writes one
// ledger row in the call's transaction; each key is sent twice), and
// Migrate succeeds.
func TestReview31MigrateWhileSixteenWorkersCall(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 20)
	ctx := context.Background()
	store := migratedStore(t, db)
	downgradeTo(t, db, 2)
	_, err := db.Pool.Exec(ctx, `INSERT INTO idempotency_keys (scope, key, method, fingerprint, state, response_type, response, metadata, expires_at)
SELECT 'tenant-' || (i % 7), 'h-' || i, 'POST /v1/charges', '\x01', 'succeeded', 'google.protobuf.BytesValue', '\x0a027b7d'::bytea, '\x08c901'::bytea, now() + interval '1 hour'
FROM generate_series(1, 6000) i;
CREATE TABLE ledger (key text PRIMARY KEY)`)
	require.NoError(t, err)

	var wg sync.WaitGroup
	var stop atomic.Bool
	var calls, failures atomic.Int64
	var firstErr atomic.Value
	for w := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; !stop.Load() || i < 5; i++ {
				key := fmt.Sprintf("w%d-%d", w, i)
				for range 2 {
					_, err := store.Execute(ctx, idempotency.Call{Scope: "tenant-1", Key: key, Method: "/r31.Svc/Charge"},
						func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
							_, err := tx.Exec(ctx, `INSERT INTO ledger (key) VALUES ($1)`, key)
							return wrapperspb.String(key), err
						})
					calls.Add(1)
					if err != nil {
						failures.Add(1)
						firstErr.CompareAndSwap(nil, err)
					}
				}
			}
		}()
	}
	migrateErr := store.Migrate(ctx)
	stop.Store(true)
	wg.Wait()
	require.NoError(t, migrateErr)
	require.Zero(t, failures.Load(), "of %d calls; first: %v", calls.Load(), firstErr.Load())
	require.Equal(t, 6000, db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key LIKE 'http h-%'`))
	require.Equal(t, db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key LIKE 'w%'`), db.Count(t, `SELECT count(*) FROM ledger`))
	require.EqualValues(t, calls.Load()/2, db.Count(t, `SELECT count(*) FROM ledger`), "each key ran once")
}
