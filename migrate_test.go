package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// downgradeTo makes the default key table of db look as the release that
// had applied the migrations up to version left it: the later ones are
// reverted and forgotten.
func downgradeTo(t *testing.T, db *testdb.DB, version int) {
	t.Helper()
	ms, err := idempotency.Migrations("", idempotency.DefaultTable)
	require.NoError(t, err)
	for i := len(ms) - 1; i >= 0 && ms[i].Version > version; i-- {
		_, err := db.Pool.Exec(context.Background(), ms[i].Down)
		require.NoError(t, err, ms[i].Name)
		_, err = db.Pool.Exec(context.Background(), `DELETE FROM idempotency_keys_migrations WHERE version = $1`, ms[i].Version)
		require.NoError(t, err)
	}
}

// openReader begins a transaction that has read the key table and stays
// open (a report, a pg_dump, a forgotten psql session): it holds the
// table's ACCESS SHARE lock until the test ends it. It is rolled back
// when t ends, before the pool closes.
func openReader(t *testing.T, db *testdb.DB) (pgx.Tx, uint32) {
	t.Helper()
	ctx := context.Background()
	reader, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = reader.Rollback(context.Background()) })
	_, err = reader.Exec(ctx, `SELECT count(*) FROM idempotency_keys`)
	require.NoError(t, err)
	return reader, reader.Conn().PgConn().PID()
}

// olderReleaseCall is a call as the first release made it on its table
// (no metadata column): it claims its key and reads it back, in a
// transaction of its own.
func olderReleaseCall(ctx context.Context, pool *pgxpool.Pool, key string) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO idempotency_keys (scope, key, method, fingerprint, state, expires_at)
VALUES ('', $1, '/pay.v1.Pay/Charge', '\x01', 'succeeded', now() + interval '1 hour') ON CONFLICT DO NOTHING`, key); err != nil {
			return err
		}
		var state string
		return tx.QueryRow(ctx, `SELECT state FROM idempotency_keys WHERE scope = '' AND key = $1`, key).Scan(&state)
	})
}

// An upgrade whose migration needs the key table's ACCESS EXCLUSIVE lock
// (002 adds a column) while a transaction that read the table stays open:
// the calls of the running release go on while the reader is open, since
// Migrate gives up its place in the lock queue after the lock timeout and
// tries again later; once the reader ends, Migrate finishes the upgrade.
func TestMigrateNeverStallsCallsBehindItsLockRequest(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 16)
	ctx := context.Background()
	store := migratedStore(t, db)
	downgradeTo(t, db, 1) // the first release's table
	require.NoError(t, olderReleaseCall(ctx, db.Pool, "before"))
	reader, _ := openReader(t, db)

	migrated := make(chan error, 1)
	go func() { migrated <- store.Migrate(ctx, idempotency.WithMigrationAttempts(1000)) }()
	require.Eventually(t, func() bool {
		return db.Count(t, `SELECT count(*) FROM pg_locks WHERE relation = 'idempotency_keys'::regclass AND mode = 'AccessExclusiveLock' AND NOT granted`) > 0
	}, liveness, time.Millisecond, "Migrate never asked for the key table's lock")

	// The running release's calls, issued while Migrate asks for the lock.
	const calls = 8
	done := make(chan error, calls)
	for i := range calls {
		go func() { done <- olderReleaseCall(ctx, db.Pool, fmt.Sprintf("during-%d", i)) }()
	}
	guard := time.NewTimer(liveness)
	defer guard.Stop()
	for range calls {
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-guard.C:
			t.Fatal("calls of the running release are stuck behind Migrate's request for the key table's lock while a reader is open")
		}
	}
	select {
	case err := <-migrated:
		t.Fatalf("Migrate returned (%v) while the reader still held the lock 002 needs", err)
	default:
	}
	require.Equal(t, 1+calls, db.Count(t, `SELECT count(*) FROM idempotency_keys`), "every call's row, written while the reader was open")

	require.NoError(t, reader.Rollback(ctx))
	select {
	case err := <-migrated:
		require.NoError(t, err, "once the reader is over")
	case <-time.After(liveness):
		t.Fatal("Migrate never finished after the reader ended")
	}
	all, err := idempotency.Migrations("", idempotency.DefaultTable)
	require.NoError(t, err)
	require.Equal(t, len(all), db.Count(t, `SELECT count(*) FROM idempotency_keys_migrations`))
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'idempotency_keys' AND column_name = 'metadata'`, db.Schema))
	res, err := store.Execute(ctx, idempotency.Call{Key: "after", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) { return wrapperspb.String("ok"), nil })
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
}

// A reader that stays open past Migrate's attempts: Migrate gives up with
// an error that names the migration, the session that holds the lock and
// what to do, and leaves the table at its version, still serving; run
// again after the reader, it finishes.
func TestMigrateGivesUpSayingWhoHoldsTheLock(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	ctx := context.Background()
	store := migratedStore(t, db)
	downgradeTo(t, db, 1)
	reader, readerPID := openReader(t, db)

	var err error
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		err = store.Migrate(ctx, idempotency.WithMigrationLockTimeout(20*time.Millisecond), idempotency.WithMigrationAttempts(3))
	}()
	select {
	case <-finished:
	case <-time.After(liveness):
		t.Fatal("Migrate waited for the lock without end")
	}
	require.Error(t, err)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "55P03", pgErr.Code, "lock_not_available")
	for _, want := range []string{"002_add_metadata", "3 attempts", fmt.Sprintf("pid %d", readerPID), "idle in transaction",
		"SELECT count(*) FROM idempotency_keys", "pg_terminate_backend", "WithMigrationAttempts"} {
		require.Contains(t, err.Error(), want)
	}
	require.Equal(t, 1, db.Count(t, `SELECT max(version) FROM idempotency_keys_migrations`), "002 not applied")
	require.NoError(t, olderReleaseCall(ctx, db.Pool, "still served"))

	require.NoError(t, reader.Rollback(ctx))
	require.NoError(t, store.Migrate(ctx))
	all, err := idempotency.Migrations("", idempotency.DefaultTable)
	require.NoError(t, err)
	require.Equal(t, len(all), db.Count(t, `SELECT count(*) FROM idempotency_keys_migrations`))
}

// Two stores name one table two ways, through the search_path and with its
// schema, as replicas started with and without -schema do: migrating at
// once, 16 times over, they never fail and make one table.
func TestMigrateOneTableNamedTwoWays(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 8)
	ctx := context.Background()
	bare, err := idempotency.NewStore(db.Pool, idempotency.WithTable("", "keys"))
	require.NoError(t, err)
	qualified, err := idempotency.NewStore(db.Pool, idempotency.WithTable(db.Schema, "keys"))
	require.NoError(t, err)
	all, err := idempotency.Migrations("", "keys")
	require.NoError(t, err)
	for round := range 16 {
		_, err := db.Pool.Exec(ctx, `DROP TABLE IF EXISTS keys, keys_migrations`)
		require.NoError(t, err)
		start := make(chan struct{})
		errs := make(chan error, 2)
		for _, s := range []*idempotency.Store{bare, qualified} {
			go func() {
				<-start
				errs <- s.Migrate(ctx)
			}()
		}
		close(start)
		for range 2 {
			require.NoError(t, <-errs, "round %d", round)
		}
		require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'keys'`, db.Schema), "round %d", round)
		require.Equal(t, len(all), db.Count(t, `SELECT count(*) FROM keys_migrations`), "round %d", round)
	}
}

// batchLabel is in the text of every statement of 003's batched move.
const batchLabel = "003_namespace_keys (batch)"

// 10,000 rows an older release wrote (messages, HTTP responses, errors the
// engine stored, gRPC calls, a key whose new name is taken): Migrate moves
// them in batches, to the same keys as 003's single UPDATE, which tools
// run. Cut after three batches, it has moved some and recorded nothing;
// run again, it moves the rest.
func TestMigrateMovesRowsInBatchesAndResumes(t *testing.T) {
	t.Parallel()
	var batches atomic.Int64
	var cut atomic.Pointer[context.CancelFunc]
	db := testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
		cfg.MaxConns = 4
		cfg.ConnConfig.Tracer = &testdb.Tracer{OnRoundTrip: func(_ context.Context, _ *pgx.Conn, statements []string) {
			for _, s := range statements {
				if strings.Contains(s, batchLabel) && batches.Add(1) == 4 {
					if c := cut.Load(); c != nil {
						(*c)()
					}
				}
			}
		}}
	})
	ctx := context.Background()
	store := migratedStore(t, db)
	downgradeTo(t, db, 2) // before 003, as the release that wrote these rows left the table
	_, err := db.Pool.Exec(ctx, `INSERT INTO idempotency_keys (scope, key, method, fingerprint, state, response_type, response, metadata, expires_at)
SELECT 'tenant-' || (i % 7), k || i,
  CASE k WHEN 'm-' THEN 'idempotency/message' WHEN 'g-' THEN '/pay.v1.Pay/Charge' ELSE 'POST /v1/charges' END,
  '\x01', CASE k WHEN 'f-' THEN 'failed' ELSE 'succeeded' END,
  CASE k WHEN 'h-' THEN 'google.protobuf.BytesValue' END, CASE k WHEN 'h-' THEN '\x0a027b7d'::bytea END,
  CASE k WHEN 'h-' THEN '\x08c901'::bytea END, now() + interval '1 hour'
FROM generate_series(1, 2500) i, unnest(ARRAY['m-', 'h-', 'f-', 'g-']) k;
INSERT INTO idempotency_keys (scope, key, method, fingerprint, state, response_type, response, metadata, expires_at)
VALUES ('tenant-1', 'taken', 'POST /v1/charges', '\x01', 'succeeded', 'google.protobuf.BytesValue', '', '\x08c901', now() + interval '1 hour'),
       ('tenant-1', 'http taken', 'POST /v1/charges', '\x01', 'succeeded', 'google.protobuf.BytesValue', '', '\x08c901', now() + interval '1 hour')`)
	require.NoError(t, err)
	require.Equal(t, 10002, db.Count(t, `SELECT count(*) FROM idempotency_keys`))

	// What 003's single UPDATE makes of the same rows, on a copy.
	_, err = db.Pool.Exec(ctx, `CREATE TABLE expected_keys (LIKE idempotency_keys INCLUDING ALL); INSERT INTO expected_keys SELECT * FROM idempotency_keys`)
	require.NoError(t, err)
	copyMs, err := idempotency.Migrations(db.Schema, "expected_keys")
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, copyMs[2].SQL)
	require.NoError(t, err)
	require.Equal(t, 7500, db.Count(t, `SELECT count(*) FROM expected_keys WHERE key LIKE 'message m-%' OR key LIKE 'http h-%' OR key LIKE 'http f-%'`))

	cutCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	cut.Store(&cancel)
	require.ErrorIs(t, store.Migrate(cutCtx), context.Canceled, "cut at its fourth batch")
	cut.Store(nil)
	moved := db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key LIKE '% %'`) - 1 // 'http taken' was there
	require.Greater(t, moved, 0, "the first batches are committed")
	require.Less(t, moved, 7500, "the cut left rows to move")
	require.Zero(t, db.Count(t, `SELECT count(*) FROM idempotency_keys_migrations WHERE version = 3`), "003 is not recorded before its last batch")

	require.NoError(t, store.Migrate(ctx))
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM idempotency_keys_migrations WHERE version = 3`))
	require.Zero(t, db.Count(t, `SELECT count(*) FROM (SELECT scope, key, method FROM idempotency_keys
EXCEPT SELECT scope, key, method FROM expected_keys) d`), "a row the batches moved elsewhere than the single UPDATE")
	require.Zero(t, db.Count(t, `SELECT count(*) FROM (SELECT scope, key, method FROM expected_keys
EXCEPT SELECT scope, key, method FROM idempotency_keys) d`), "a row the single UPDATE moved that the batches did not")
	require.Equal(t, 10002, db.Count(t, `SELECT count(*) FROM idempotency_keys`))
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE scope = 'tenant-1' AND key = 'taken'`), "its new key was taken: it stays")
	require.Equal(t, 2500, db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key LIKE 'g-%'`), "gRPC keys stay")

	// A moved message replays.
	o, err := store.ProcessMessage(ctx, idempotency.Message{Scope: "tenant-1", ID: "m-1", Redelivered: true},
		func(context.Context, pgx.Tx) error { return errors.New("ran again") })
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeReplayed, o)
}

// Migrate run again on a table it brought up to date does nothing: it
// asks for no lock on the key table (it returns while another session
// holds the strongest), writes no row, and moves no key, not even one an
// older release wrote in the old form after the upgrade.
func TestMigrateAgainIsANoOp(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	ctx := context.Background()
	store := migratedStore(t, db)
	_, err := db.Pool.Exec(ctx, `INSERT INTO idempotency_keys (scope, key, method, fingerprint, state, response_type, response, metadata, expires_at)
VALUES ('', 'late', 'POST /v1/charges', '\x01', 'succeeded', 'google.protobuf.BytesValue', '', '\x08c901', now() + interval '1 hour')`)
	require.NoError(t, err)
	versions := func() string {
		var s string
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT string_agg(version || ' ' || name || ' ' || applied_at || ' ' || xmin, ', ' ORDER BY version) FROM idempotency_keys_migrations`).Scan(&s))
		return s
	}
	var rowBefore string
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT key || ' ' || xmin FROM idempotency_keys`).Scan(&rowBefore))
	before := versions()

	locker, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = locker.Rollback(context.Background()) })
	_, err = locker.Exec(ctx, `LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- store.Migrate(ctx) }()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(liveness):
		t.Fatal("Migrate of an up-to-date table waited for the key table's lock")
	}
	require.NoError(t, locker.Rollback(ctx))

	require.Equal(t, before, versions(), "no migration recorded again")
	var rowAfter string
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT key || ' ' || xmin FROM idempotency_keys`).Scan(&rowAfter))
	require.Equal(t, rowBefore, rowAfter, "the row an older release wrote is not moved")
}

// Migrate's options are validated before it touches the database, each
// invalid one named.
func TestUnitMigrateOptionsNameThemselves(t *testing.T) {
	t.Parallel()
	var pool *pgxpool.Pool // never used: validation comes first
	store, err := idempotency.NewStore(pool)
	require.NoError(t, err)
	for name, opt := range map[string]idempotency.MigrateOption{
		"WithMigrationLockTimeout": idempotency.WithMigrationLockTimeout(time.Microsecond),
		"WithMigrationAttempts":    idempotency.WithMigrationAttempts(0),
	} {
		require.ErrorContains(t, store.Migrate(context.Background(), opt), name)
	}
}

// Through PgBouncer in transaction pooling, an upgrade from the first
// release's table works, and leaves no advisory lock on any server
// connection: each of Migrate's transactions holds the table's lock for
// itself alone, never a session's, which would stay with a server
// connection that other clients then get.
func TestMigrateThroughPgBouncer(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	ctx := context.Background()
	migratedStore(t, db)
	downgradeTo(t, db, 1)
	bounced, err := idempotency.NewStore(bouncedPool(t, ""), idempotency.WithTable(db.Schema, idempotency.DefaultTable))
	require.NoError(t, err)
	// A session's lock would be taken on one server connection and waited
	// for on the next: bounded, that is a failure, not a hang.
	bounded, cancel := context.WithTimeout(ctx, liveness)
	defer cancel()
	require.NoError(t, bounced.Migrate(bounded))
	all, err := idempotency.Migrations("", idempotency.DefaultTable)
	require.NoError(t, err)
	require.Equal(t, len(all), db.Count(t, `SELECT count(*) FROM idempotency_keys_migrations`))
	// The lock, as Migrate derives it: FNV-64a of the quoted, qualified name.
	h := fnv.New64a()
	h.Write([]byte(pgx.Identifier{db.Schema, idempotency.DefaultTable}.Sanitize()))
	lock := h.Sum64()
	require.Zero(t, db.Count(t, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = $1 AND objid = $2 AND objsubid = 1`,
		uint32(lock>>32), uint32(lock)), "the table's migration lock is still held")
	res, err := bounced.Execute(ctx, idempotency.Call{Key: "k", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) { return wrapperspb.String("ok"), nil })
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
}

// A table named without a schema, on a session whose search_path names no
// schema that exists: Migrate says what to set, creating nothing.
func TestMigrateWithoutASchemaToCreateIn(t *testing.T) {
	t.Parallel()
	db := testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
		cfg.MaxConns = 2
		cfg.ConnConfig.RuntimeParams["search_path"] = "no_such_schema_w31"
	})
	store, err := idempotency.NewStore(db.Pool)
	require.NoError(t, err)
	err = store.Migrate(context.Background())
	require.ErrorContains(t, err, "none of its schemas exists: set search_path, or name the schema with WithTable")
	require.Zero(t, db.Count(t, `SELECT count(*) FROM pg_catalog.pg_tables WHERE tablename = 'idempotency_keys_migrations' AND schemaname = $1`, db.Schema))
}

// Sixteen replicas start at once on an empty schema, naming one table in
// four ways: with its schema, through a search_path of that schema alone,
// through one whose first schema does not exist, and with the schema
// quoted in the search_path. Every Migrate succeeds, one table is made,
// each version is recorded once, and every store then serves calls.
func TestSixteenReplicasMigrateOneTableSpelledFourWays(t *testing.T) {
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
func TestMigrateWhileSixteenWorkersCall(t *testing.T) {
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

func TestMigrateIsIdempotentAndHonoursTableName(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	ctx := context.Background()
	// Hostile names must be quoted, not interpreted. Migrate creates the
	// schema, whose name would end the dollar quote of the statement that
	// creates it.
	schema := db.Schema + ` odd "schema"; $create_schema$ \' --` // unique per run, so parallel runs do not collide
	const table = `keys'); DROP TABLE victim; --`
	_, err := db.Pool.Exec(ctx, `CREATE TABLE victim (id int)`)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = testdb.Admin(t).Exec(context.Background(), `DROP SCHEMA `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
	})

	store, err := idempotency.NewStore(db.Pool, idempotency.WithTable(schema, table))
	require.NoError(t, err)
	for i := 0; i < 2; i++ {
		require.NoError(t, store.Migrate(ctx), "Migrate run %d", i+1)
	}
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = $2`, schema, table))
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM pg_tables WHERE tablename = 'victim'`))
	all, err := idempotency.Migrations(schema, table)
	require.NoError(t, err)
	require.Equal(t, len(all), db.Count(t, `SELECT count(*) FROM `+pgx.Identifier{schema, table + "_migrations"}.Sanitize()), "each migration applied once")
	require.Equal(t, 0, db.Count(t, `SELECT count(*) FROM pg_class WHERE relname = $1 AND relpersistence = 'u'`, table), "the key table must not be UNLOGGED")

	res, err := store.Execute(ctx, idempotency.Call{Scope: "s'; --", Key: "k", Method: "m", Fingerprint: []byte{1}},
		func(context.Context, pgx.Tx) (proto.Message, error) { return wrapperspb.String("v"), nil })
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)

	ms, err := idempotency.Migrations(schema, table)
	require.NoError(t, err)
	require.NotEmpty(t, ms)
	require.Contains(t, ms[0].SQL, pgx.Identifier{schema, table}.Sanitize(), "exported SQL names the configured table")
}

// Migration 003 moves the HTTP and message rows of older versions into
// their namespaces, the errors the engine stored for HTTP requests too,
// and leaves Store.Execute's alone; a downgrade and an upgrade again never
// make it fail.
func TestMigrationMovesOlderRowsIntoTheirNamespaces(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, func(w http.ResponseWriter, r *http.Request) {
		switch body, _ := io.ReadAll(r.Body); string(body) {
		case "end":
			_, _ = idempotency.MustTxFromContext(r.Context()).Conn().Exec(r.Context(), `COMMIT`)
		}
		w.WriteHeader(http.StatusCreated)
	})
	ctx := context.Background()
	store := e.store
	var runs atomic.Int64
	direct := idempotency.Call{Key: "d", Method: "POST /v1/orders"}
	fn := func(context.Context, pgx.Tx) (proto.Message, error) {
		runs.Add(1)
		return wrapperspb.Bytes([]byte("{}")), nil
	}
	_, err := store.Execute(ctx, direct, fn)
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, e.post("ok", "fine").status)
	require.Equal(t, http.StatusInternalServerError, e.post("ended", "end").status, "an error the engine stored")
	_, err = store.ProcessMessage(ctx, idempotency.Message{ID: "m"}, func(context.Context, pgx.Tx) error { return nil })
	require.NoError(t, err)

	ms, err := idempotency.Migrations("", idempotency.DefaultTable)
	require.NoError(t, err)
	downgrade := func() { // as the older version's table looks
		_, err := e.db.Pool.Exec(ctx, ms[2].Down)
		require.NoError(t, err)
		_, err = e.db.Pool.Exec(ctx, `DELETE FROM idempotency_keys_migrations WHERE version = 3`)
		require.NoError(t, err)
	}
	for round := 0; round < 2; round++ {
		downgrade()
		require.NoError(t, store.Migrate(ctx), "round %d", round)
		require.Equal(t, http.StatusCreated, e.post("ok", "fine").status)
		require.Equal(t, http.StatusInternalServerError, e.post("ended", "end").status)
		o, err := store.ProcessMessage(ctx, idempotency.Message{ID: "m", Redelivered: true}, func(context.Context, pgx.Tx) error { return errors.New("ran") })
		require.NoError(t, err)
		require.Equal(t, idempotency.OutcomeReplayed, o)
		res, err := store.Execute(ctx, direct, fn)
		require.NoError(t, err)
		require.Equal(t, idempotency.OutcomeReplayed, res.Outcome, "Execute's row stays in its namespace")
	}
	require.EqualValues(t, 2, e.runs.Load(), "each HTTP request ran once")
	require.EqualValues(t, 1, runs.Load())

	// A downgrade, then the older version writes the bare key again: the
	// upgrade leaves the row it cannot move, instead of failing.
	downgrade()
	_, err = e.db.Pool.Exec(ctx, `INSERT INTO idempotency_keys (scope, key, method, fingerprint, state, response_type, response, metadata, expires_at)
VALUES ('', 'taken', 'POST /v1/charges', '\x00', 'succeeded', 'google.protobuf.BytesValue', '', '\x08c901', now() + interval '1 hour'),
       ('', 'http taken', 'POST /v1/charges', '\x00', 'succeeded', 'google.protobuf.BytesValue', '', '\x08c901', now() + interval '1 hour')`)
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx))
}

func TestNeverMigratedIsAConfigurationError(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	store, err := idempotency.NewStore(db.Pool) // no Migrate
	require.NoError(t, err)
	ran := false
	res, err := store.Execute(context.Background(), idempotency.Call{Key: "k", Method: "m"},
		func(context.Context, pgx.Tx) (proto.Message, error) { ran = true; return nil, nil })
	require.Equal(t, codes.Internal, status.Code(err), "%v", err)
	require.Contains(t, status.Convert(err).Message(), `key table "idempotency_keys" does not exist: run Store.Migrate`)
	require.Equal(t, idempotency.OutcomeMisconfigured, res.Outcome, "an operator must act; not an outage")
	require.False(t, ran, "nothing runs without a key table")
	require.False(t, errors.Is(err, idempotency.ErrStoreUnavailable))
}
