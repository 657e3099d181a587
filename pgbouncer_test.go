package idempotency_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// The core guarantees through PgBouncer in transaction pooling mode, the
// way most production PostgreSQL is reached: consecutive transactions of
// one client may run on different server connections, so nothing may rely
// on session state. PgBouncer does not carry search_path, so the tables are
// named with their schema.

// pgbouncerURLEnv names the PgBouncer URL; scripts/services.sh starts one
// on the default.
const pgbouncerURLEnv = "PGBOUNCER_URL"

const defaultPgbouncerURL = "postgres://postgres@127.0.0.1:6432/test?sslmode=disable&default_query_exec_mode=exec"

// bouncedServer serves the ledger through a store on a PgBouncer pool.
func bouncedServer(t *testing.T, handler func(ctx context.Context, schema string, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error)) (*testdb.DB, *replica) {
	t.Helper()
	url := os.Getenv(pgbouncerURLEnv)
	if url == "" {
		url = defaultPgbouncerURL
	}
	db := suiteDB(t)
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.MaxConns = 16
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	if err := pool.Ping(context.Background()); err != nil {
		t.Fatalf("no PgBouncer at %s (set %s; `bash scripts/services.sh` starts one): %v", strings.Split(url, "?")[0], pgbouncerURLEnv, err)
	}
	srv := startReplica(t, pool, replicaConfig{
		storeOpts: []idempotency.StoreOption{idempotency.WithTable(db.Schema, idempotency.DefaultTable), idempotency.WithInProgressWait(10 * time.Second)},
		handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			return handler(ctx, db.Schema, req)
		},
	})
	return db, srv
}

// bouncedLedger is keyedLedger with the ledger named by its schema.
func bouncedLedger(ctx context.Context, schema string, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
	tx := idempotency.MustTxFromContext(ctx)
	key := metadata.ValueFromIncomingContext(ctx, idempotency.MetadataKey)[0]
	var id int64
	if err := tx.QueryRow(ctx, `INSERT INTO `+pgx.Identifier{schema, "ledger"}.Sanitize()+` (note, key) VALUES ($1, $2) RETURNING id`, req.GetValue(), key).Scan(&id); err != nil {
		return nil, err
	}
	return wrapperspb.String(fmt.Sprintf("%s#%d", req.GetValue(), id)), nil
}

func TestThroughPgBouncerConcurrentDuplicatesAndReplays(t *testing.T) {
	t.Parallel()
	db, srv := bouncedServer(t, func(ctx context.Context, schema string, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		resp, err := bouncedLedger(ctx, schema, req)
		time.Sleep(50 * time.Millisecond) // keep the key held while duplicates arrive
		return resp, err
	})
	conn := dial(t, srv.addr)
	const keys, perKey = 20, 8
	replies := make([][]reply, keys)
	var wg sync.WaitGroup
	for k := range keys {
		replies[k] = make([]reply, perKey)
		for i := range perKey {
			wg.Go(func() {
				ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, fmt.Sprint("pgb-", k))
				replies[k][i] = invoke(ctx, conn, methodCharge, fmt.Sprint("charge ", k))
			})
		}
	}
	wg.Wait()
	for k, rs := range replies {
		var winner []byte
		for _, r := range rs {
			if r.err == nil && !r.replayed {
				require.Nil(t, winner, "key %d executed twice", k)
				winner = r.raw
			}
		}
		require.NotNil(t, winner, "key %d", k)
		for _, r := range rs {
			if r.err == nil {
				require.Equal(t, winner, r.raw, "key %d: every answer is the one execution's", k)
			} else {
				require.Equal(t, codes.Aborted, status.Code(r.err), "key %d: %v", k, r.err)
			}
		}
		// A retry after the fact, marked as a retry: the replay.
		ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, fmt.Sprint("pgb-", k), "x-retry-attempt", "1")
		again := invoke(ctx, conn, methodCharge, fmt.Sprint("charge ", k))
		require.NoError(t, again.err)
		require.True(t, again.replayed)
		require.Equal(t, winner, again.raw)
	}
	require.EqualValues(t, keys, srv.execs.Load())
	require.Equal(t, keys, db.Count(t, `SELECT count(*) FROM ledger`))
	requireKeysMatchLedger(t, db)
}

// A crash mid-call through PgBouncer: the server's session dies with its
// transaction, the key's lock with it, and the retry runs at once.
func TestThroughPgBouncerCrashLeavesNoKey(t *testing.T) {
	t.Parallel()
	var once sync.Once
	db, srv := bouncedServer(t, func(ctx context.Context, schema string, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		resp, err := bouncedLedger(ctx, schema, req)
		crashed := false
		once.Do(func() {
			crashed = true
			// The server side of PgBouncer's connection dies, as in a
			// crash of the database session.
			var pid int
			if err := idempotency.MustTxFromContext(ctx).QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err == nil {
				killBackend(t, uint32(pid))
			}
		})
		if crashed {
			_, err = idempotency.MustTxFromContext(ctx).Exec(ctx, `SELECT 1`)
			return nil, err
		}
		return resp, err
	})
	conn := dial(t, srv.addr)
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "pgb-crash")
	r := invoke(ctx, conn, methodCharge, "x")
	require.Equal(t, codes.Unavailable, status.Code(r.err), "%v", r.err)
	require.Zero(t, db.Count(t, `SELECT count(*) FROM ledger`))
	start := time.Now()
	r = invoke(ctx, conn, methodCharge, "x")
	require.NoError(t, r.err)
	require.False(t, r.replayed)
	require.Less(t, time.Since(start), 2*time.Second, "no lock outlived the dead session")
	requireKeysMatchLedger(t, db)
}
