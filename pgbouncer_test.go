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
	"google.golang.org/protobuf/proto"
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
func bouncedServer(t *testing.T, handler func(ctx context.Context, schema string, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error), opts ...idempotency.StoreOption) (*testdb.DB, *replica) {
	t.Helper()
	db := suiteDB(t)
	pool := bouncedPool(t, "")
	srv := startReplica(t, pool, replicaConfig{
		storeOpts: append([]idempotency.StoreOption{idempotency.WithTable(db.Schema, idempotency.DefaultTable), idempotency.WithInProgressWait(10 * time.Second)}, opts...),
		handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			return handler(ctx, db.Schema, req)
		},
	})
	return db, srv
}

// bouncedPool is a pool through PgBouncer; mode, when set, replaces the
// URL's query mode.
func bouncedPool(t *testing.T, mode string) *pgxpool.Pool {
	t.Helper()
	url := os.Getenv(pgbouncerURLEnv)
	if url == "" {
		url = defaultPgbouncerURL
	}
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.MaxConns = 16
	if mode != "" {
		cfg.ConnConfig.DefaultQueryExecMode = map[string]pgx.QueryExecMode{"describe_exec": pgx.QueryExecModeDescribeExec, "exec": pgx.QueryExecModeExec}[mode]
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	if err := pool.Ping(context.Background()); err != nil {
		t.Fatalf("no PgBouncer at %s (set %s; `bash scripts/services.sh` starts one): %v", strings.Split(url, "?")[0], pgbouncerURLEnv, err)
	}
	return pool
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

// At SERIALIZABLE the key is locked by the session before the call's
// transaction begins, and a handler that uses tx.Conn() holds it by the
// session too: through PgBouncer, every such lock is released in the round
// trip that took it or in the one that ends the transaction, so no server
// connection goes back to PgBouncer's pool holding one.
func TestThroughPgBouncerAtSerializableNoLockOutlivesItsCall(t *testing.T) {
	t.Parallel()
	db, srv := bouncedServer(t, func(ctx context.Context, schema string, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		if strings.HasSuffix(req.GetValue(), "odd") {
			_ = idempotency.MustTxFromContext(ctx).Conn().TypeMap() // as code that reads the connection's types
		}
		return bouncedLedger(ctx, schema, req)
	}, idempotency.WithIsolation(pgx.Serializable))
	conn := dial(t, srv.addr)
	const keys, perKey = 10, 4
	var wg sync.WaitGroup
	errs := make(chan error, keys*perKey)
	for k := range keys {
		for range perKey {
			wg.Go(func() {
				ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, fmt.Sprint("pgb-ser-", k))
				body := fmt.Sprint("charge ", k, []string{" even", " odd"}[k%2])
				// No call fails: the engine's own reads of the key table run
				// outside the SERIALIZABLE transactions, so calls of different
				// keys never fail each other's serialization.
				if r := invoke(ctx, conn, methodCharge, body); r.err != nil {
					errs <- r.err
				}
			})
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	require.EqualValues(t, keys, srv.execs.Load())
	requireKeysMatchLedger(t, db)
	// A session lock left behind would be held by a server connection that
	// is idle in PgBouncer's pool: no backend holds any of these keys' locks.
	var names []string
	for k := range keys {
		names = append(names, fmt.Sprint("pgb-ser-", k))
	}
	require.Zero(t, heldKeyLocks(t, db, "", names))
}

// heldKeyLocks counts the advisory locks that backends hold on the keys of
// scope in db's key table: a lock's 64-bit key is the hash the engine
// computes (see renderStatements), split by pg_locks into classid and objid.
func heldKeyLocks(t *testing.T, db *testdb.DB, scope string, keys []string) int {
	t.Helper()
	table := pgx.Identifier{db.Schema, idempotency.DefaultTable}.Sanitize()
	return db.Count(t, `SELECT count(*) FROM pg_locks l
JOIN (SELECT hashtextextended(k, hashtextextended($1, $2::regclass::oid::bigint)) AS h FROM unnest($3::text[]) k) key
ON l.locktype = 'advisory' AND l.objsubid = 1 AND l.classid::bigint = (key.h >> 32) & 4294967295 AND l.objid::bigint = key.h & 4294967295`,
		scope, table, keys)
}

// describe_exec prepares a statement in one round trip and binds it in the
// next, which a pooler may send to another server connection: behind one,
// the store refuses it, saying what to use; directly it works.
func TestDescribeExecBehindAPoolerIsRefused(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	ctx := context.Background()
	call := idempotency.Call{Key: "k", Method: "m"}
	run := func(context.Context, pgx.Tx) (proto.Message, error) { return nil, nil }
	store, err := idempotency.NewStore(bouncedPool(t, "describe_exec"), idempotency.WithTable(db.Schema, idempotency.DefaultTable))
	require.NoError(t, err)
	res, err := store.Execute(ctx, call, run)
	require.Equal(t, codes.Internal, status.Code(err), "%v", err)
	require.Contains(t, status.Convert(err).Message(), "use cache_describe or exec")
	require.Equal(t, idempotency.OutcomeMisconfigured, res.Outcome)

	direct := schemaPool(t, db.Schema, 2, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeDescribeExec })
	store, err = idempotency.NewStore(direct)
	require.NoError(t, err)
	res, err = store.Execute(ctx, call, run)
	require.NoError(t, err, "no pooler in between")
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
}
