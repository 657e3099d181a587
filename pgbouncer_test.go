package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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

// pgbouncerURL is the PgBouncer the tests use; a test without one fails,
// saying how to start one.
func pgbouncerURL(t testing.TB) string {
	t.Helper()
	url, hint := testdb.PgBouncerURL()
	if url == "" {
		t.Fatal(hint)
	}
	return url
}

// bouncedPool is a pool through PgBouncer; mode, when set, replaces the
// URL's query mode.
func bouncedPool(t *testing.T, mode string) *pgxpool.Pool {
	t.Helper()
	return bouncedPoolWith(t, func(cfg *pgxpool.Config) {
		if mode != "" {
			cfg.ConnConfig.DefaultQueryExecMode = map[string]pgx.QueryExecMode{"describe_exec": pgx.QueryExecModeDescribeExec, "exec": pgx.QueryExecModeExec}[mode]
		}
	})
}

// bouncedPoolWith is a pool through PgBouncer, its configuration adjusted
// by tweak.
func bouncedPoolWith(t *testing.T, tweak func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	return bouncedPoolAt(t, pgbouncerURL(t), tweak)
}

// bouncedPoolAt is bouncedPoolWith through the PgBouncer at url: a test
// that ends a server connection the pooler may have handed to another
// client uses a PgBouncer of its own (pgbouncerOf), so that no other
// test's session is the one it ends.
func bouncedPoolAt(t *testing.T, url string, tweak func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.MaxConns = 16
	tweak(cfg)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	if err := pool.Ping(context.Background()); err != nil {
		t.Fatalf("no PgBouncer at %s (set %s; `bash scripts/services.sh` at the repository's root starts one): %v", strings.Split(url, "?")[0], testdb.PgBouncerEnvVar, err)
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
	// A lock that outlived the dead session would make the retry wait out
	// the in-progress wait and fail Aborted.
	r = invoke(ctx, conn, methodCharge, "x")
	require.NoError(t, r.err, "no lock outlived the dead session")
	require.False(t, r.replayed)
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
	requireNoKeyLocks(t, db, "", names, "a key's lock outlived its calls")
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

// Through PgBouncer at SERIALIZABLE, every way a call can fail (a panic
// after tx.Conn(), a deferred constraint at COMMIT, the caller's deadline
// mid-statement, a plain error after tx.Conn(), a transaction the handler
// made read-only while another client waits for a server connection)
// releases the key's session lock in the round trip that ends the
// transaction: the key is free again, and its retry runs.
func TestThroughPgBouncerEveryFailureReleasesTheKey(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `CREATE TABLE deferred (id int, CONSTRAINT u UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)`)
	require.NoError(t, err)
	// Another client of PgBouncer, taking whichever server connection PgBouncer
	// released last when the engine asks whether it is on a standby.
	other, err := pgx.Connect(ctx, pgbouncerURL(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = other.Close(context.Background()) })
	var grab atomic.Bool
	pool := bouncedPoolWith(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.Tracer = &testdb.Tracer{OnRoundTrip: func(_ context.Context, _ *pgx.Conn, statements []string) {
			if strings.Contains(statements[0], "pg_is_in_recovery") && grab.CompareAndSwap(true, false) {
				_, _ = other.Exec(context.Background(), "BEGIN")
			}
		}}
	})
	store, err := idempotency.NewStore(pool, idempotency.WithTable(db.Schema, idempotency.DefaultTable),
		idempotency.WithIsolation(pgx.Serializable), idempotency.WithInProgressWait(300*time.Millisecond))
	require.NoError(t, err)
	table := pgx.Identifier{db.Schema, "deferred"}.Sanitize()
	for name, fn := range map[string]idempotency.Func{
		"panic after tx.Conn()": func(ctx context.Context, tx pgx.Tx) (proto.Message, error) { tx.Conn(); panic("boom") },
		"deferred constraint": func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			_, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES (1), (1)`)
			return wrapperspb.String("x"), err
		},
		"deadline mid-statement": func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			_, err := tx.Exec(ctx, `SELECT pg_sleep(5)`)
			return nil, err
		},
		"error after tx.Conn()": func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			tx.Conn()
			return nil, errors.New("plain")
		},
		"made read-only": func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			_, err := tx.Exec(ctx, `SELECT set_config('transaction_read_only', 'on', true)`)
			grab.Store(true)
			return wrapperspb.String("x"), err
		},
	} {
		key := "fail-" + strings.ReplaceAll(name, " ", "-")
		func() {
			defer func() { _ = recover() }()
			ctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
			defer cancel()
			_, _ = store.Execute(ctx, idempotency.Call{Key: key, Method: "m"}, fn)
		}()
		_, _ = other.Exec(ctx, "ROLLBACK")
		// A dead session releases its locks once its backend notices; no
		// live one may keep one.
		require.Eventually(t, func() bool { return heldKeyLocks(t, db, "", []string{key}) == 0 }, liveness, 10*time.Millisecond, "%s: the key's lock outlived the call", name)
		res, err := store.Execute(ctx, idempotency.Call{Key: key + "-again", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) { return wrapperspb.String("ok"), nil })
		require.NoError(t, err, name)
		require.Equal(t, idempotency.OutcomeExecuted, res.Outcome, name)
	}
}

// pgbouncerOfOne starts a PgBouncer of t's own in front of the test
// database, in transaction pooling mode with a single server connection,
// and returns its URL (exec query mode): every transaction through it runs
// on that one server connection, so what a call leaves on the session
// meets the next call, as it does in production whenever the pooler hands
// the same server connection on. It is stopped when t ends.
func pgbouncerOfOne(t *testing.T) string {
	t.Helper()
	return pgbouncerOf(t, 1)
}

// pgbouncerOf is pgbouncerOfOne with servers server connections.
func pgbouncerOf(t *testing.T, servers int) string {
	t.Helper()
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		bin = "/usr/sbin/pgbouncer"
	}
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("no pgbouncer binary (apt-get install pgbouncer; `bash scripts/services.sh` installs it): %v", err)
	}
	db, err := pgconn.ParseConfig(testdb.URL())
	require.NoError(t, err)
	var cred *syscall.Credential
	if os.Geteuid() == 0 {
		// PgBouncer refuses to run as root.
		u, err := user.Lookup("postgres")
		require.NoError(t, err, "running as root, PgBouncer needs another user")
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	}
	dir, err := os.MkdirTemp("", "idempotency-pgbouncer-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o777))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "userlist.txt"), fmt.Appendf(nil, "%q %q\n", db.User, db.Password), 0o644))
	for try := 0; ; try++ {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		port := lis.Addr().(*net.TCPAddr).Port
		_ = lis.Close()
		ini := filepath.Join(dir, "pgbouncer.ini")
		require.NoError(t, os.WriteFile(ini, fmt.Appendf(nil, `[databases]
%s = host=%s port=%d dbname=%s
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = transaction
default_pool_size = %d
max_client_conn = 100
ignore_startup_parameters = extra_float_digits
logfile = %s
`, db.Database, db.Host, db.Port, db.Database, port, filepath.Join(dir, "userlist.txt"), servers, filepath.Join(dir, "pgbouncer.log")), 0o644))
		cmd := exec.Command(bin, "-q", ini)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
		require.NoError(t, cmd.Start())
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		t.Cleanup(func() {
			_ = cmd.Process.Kill()
			<-exited
		})
		url := fmt.Sprintf("postgres://%s:%s@127.0.0.1:%d/%s?sslmode=disable&default_query_exec_mode=exec", db.User, db.Password, port, db.Database)
		if waitForPgBouncer(url, exited) {
			return url
		}
		if try == 2 {
			log, _ := os.ReadFile(filepath.Join(dir, "pgbouncer.log"))
			t.Fatalf("PgBouncer did not start: %s", log)
		}
	}
}

// waitForPgBouncer reports whether a PgBouncer at url accepts a session
// before its process exits (it may have lost its port to another) or ten
// seconds pass.
func waitForPgBouncer(url string, exited <-chan struct{}) bool {
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		conn, err := pgx.Connect(ctx, url)
		cancel()
		if err == nil {
			_ = conn.Close(context.Background())
			return true
		}
		select {
		case <-exited:
			return false
		case <-time.After(20 * time.Millisecond):
		}
	}
	return false
}

// Through a transaction pooler the reset after each call (RESET ALL among
// it) costs no client connection either, even when the client sets a
// setting the pooler tracks (application_name), which RESET ALL takes back
// on the server connection and the pooler sets again for the next
// transaction.
func TestThroughPgBouncerCallsKeepTheirConnection(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	cfg, err := pgxpool.ParseConfig(pgbouncerOfOne(t))
	require.NoError(t, err)
	cfg.MaxConns = 2
	cfg.ConnConfig.RuntimeParams["application_name"] = "payments"
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	store, err := idempotency.NewStore(pool, idempotency.WithTable(db.Schema, idempotency.DefaultTable))
	require.NoError(t, err)
	ctx := context.Background()
	for i := range 20 {
		tenant := fmt.Sprint("tenant-", i)
		var app string
		res, err := store.Execute(ctx, idempotency.Call{Key: tenant, Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			if _, err := tx.Exec(ctx, `SELECT set_config('app.tenant', $1, true)`, tenant); err != nil {
				return nil, err
			}
			err := tx.QueryRow(ctx, `SELECT current_setting('application_name')`).Scan(&app)
			return wrapperspb.String(tenant), err
		})
		require.NoError(t, err)
		require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
		require.Equal(t, "payments", app, "the pooler set the client's application_name for the call")
	}
	require.LessOrEqual(t, pool.Stat().NewConnsCount(), int64(2), "20 calls on a pool of 2 opened %d client connections", pool.Stat().NewConnsCount())
}

// Behind PgBouncer, a handler that commits the call's transaction itself
// hands its server connection back to the pooler, where another client
// begins a transaction on it; the handler's next statement is then cut by
// its deadline, and the engine, its connection lost, learns what became of
// the claim. The server connection that made the claim is another
// client's by then: the engine must not end it, and the other client's
// transaction commits. The caller is told the stored Internal, as every
// caller of the key is.
func TestThroughPgBouncerLostAttemptNeverEndsAnotherClientsSession(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	url := pgbouncerOf(t, 2)
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	store, err := idempotency.NewStore(pool, idempotency.WithTable(db.Schema, idempotency.DefaultTable), idempotency.WithoutSQLCheck())
	require.NoError(t, err)
	ledger := pgx.Identifier{db.Schema, "ledger"}.Sanitize()
	ctx := context.Background()

	// Two clients that can hold both server connections, to find the one
	// the handler released.
	var others [2]*pgx.Conn
	for i := range others {
		c, err := pgx.Connect(ctx, url)
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close(context.Background()) })
		others[i] = c
	}
	var otherTx pgx.Tx
	var runs atomic.Int64
	fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		if runs.Add(1) > 1 {
			return wrapperspb.String("ran again"), nil
		}
		var pid int
		if err := tx.QueryRow(ctx, `INSERT INTO `+ledger+` (note, key) VALUES ('handler', 'k') RETURNING pg_backend_pid()`).Scan(&pid); err != nil {
			return nil, err
		}
		c := tx.Conn() // the engine refuses statements through tx once its transaction ended
		if _, err := c.Exec(ctx, `COMMIT`); err != nil {
			return nil, err
		}
		// Take the released server connection with another client; a
		// first client that got the other server holds it meanwhile.
		var held []pgx.Tx
		for _, c := range others {
			otx, err := c.Begin(context.Background())
			if err != nil {
				return nil, err
			}
			var got int
			if err := otx.QueryRow(context.Background(), `SELECT pg_backend_pid()`).Scan(&got); err != nil {
				return nil, err
			}
			if got == pid {
				otherTx = otx
				break
			}
			held = append(held, otx)
		}
		for _, h := range held {
			_ = h.Rollback(context.Background())
		}
		if otherTx == nil {
			return nil, fmt.Errorf("no other client got the server connection %d", pid)
		}
		if _, err := otherTx.Exec(context.Background(), `INSERT INTO `+ledger+` (note, key) VALUES ('other client', 'o')`); err != nil {
			return nil, err
		}
		// Cut by the deadline: pgx closes the handler's connection.
		_, err := c.Exec(ctx, `SELECT pg_sleep(30)`)
		return nil, err
	}
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	_, err1 := store.Execute(cctx, idempotency.Call{Key: "k", Method: "m"}, fn)
	t.Logf("first call: %v", err1)
	require.NotNil(t, otherTx, "the handler did not get as far as the other client's transaction")
	require.NoError(t, otherTx.Commit(ctx), "the other client's transaction was ended by the engine")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger WHERE note = 'other client'`))

	require.Equal(t, codes.Internal, status.Code(err1), "the handler committed the claim: the stored Internal, not released")
	_, err2 := store.Execute(ctx, idempotency.Call{Key: "k", Method: "m"}, fn)
	require.Equal(t, status.Convert(err1).Proto().String(), status.Convert(err2).Proto().String(), "every caller of the key gets the same answer")
	require.EqualValues(t, 1, runs.Load())
}

// Behind PgBouncer the key's lock is the call's transaction's alone. A
// handler's final error must be stored before that transaction's lock and
// claim lapse: a duplicate that claimed the key in between would run the
// handler again, and the first caller would get the duplicate's answer
// (or "in progress") instead of its own stored error. A trigger of the
// test's on the key table holds the first call's first write of the key
// table once its handler has returned (the handler marks its session with
// an advisory lock of its own, which outlives any rollback), so that a
// duplicate comes in that moment every time: the handler must still run
// once, and every caller get the final error its one run returned.
func TestThroughPgBouncerFinalErrorIsStoredBeforeADuplicateCanClaim(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	pool := bouncedPool(t, "")
	store, err := idempotency.NewStore(pool, idempotency.WithTable(db.Schema, idempotency.DefaultTable),
		idempotency.WithInProgressWait(500*time.Millisecond))
	require.NoError(t, err)
	ctx := context.Background()
	lockKey := time.Now().UnixNano() & (1<<31 - 1)
	marker := lockKey + 1
	_, err = db.Pool.Exec(ctx, fmt.Sprintf(`CREATE FUNCTION held() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF EXISTS (SELECT FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory' AND classid = 0 AND objid = %d AND objsubid = 1) THEN
    PERFORM pg_advisory_xact_lock(%d);
  END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER held BEFORE UPDATE OR DELETE ON %s FOR EACH STATEMENT EXECUTE FUNCTION held()`, marker, lockKey, pgx.Identifier{db.Schema, idempotency.DefaultTable}.Sanitize()))
	require.NoError(t, err)
	holder, err := testdb.Admin(t).Acquire(ctx)
	require.NoError(t, err)
	t.Cleanup(holder.Release)
	_, err = holder.Exec(ctx, `SELECT pg_advisory_lock($1)`, lockKey)
	require.NoError(t, err)
	var unlockOnce sync.Once
	unlock := func() {
		unlockOnce.Do(func() {
			_, err := holder.Exec(context.Background(), `SELECT pg_advisory_unlock($1)`, lockKey)
			require.NoError(t, err)
		})
	}
	t.Cleanup(unlock)

	var runs atomic.Int64
	call := idempotency.Call{Key: "k", Method: "m"}
	fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		if runs.Add(1) > 1 {
			return wrapperspb.String("ran again"), nil
		}
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_lock($1)`, marker); err != nil {
			return nil, err
		}
		return nil, idempotency.Final(status.Error(codes.NotFound, "no such card"))
	}
	type answer struct {
		res idempotency.Result
		err error
	}
	first := make(chan answer, 1)
	go func() {
		res, err := store.Execute(ctx, call, fn)
		first <- answer{res, err}
	}()
	// The first call is held in its first write of the key table after
	// its handler returned, or has answered already.
	require.Eventually(t, func() bool {
		return len(first) > 0 || db.Count(t, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
AND classid = 0 AND objid = $1 AND objsubid = 1`, lockKey) > 0
	}, liveness, time.Millisecond, "the first call to store its final error")
	res, err := store.Execute(ctx, call, fn)
	t.Logf("the caller that came meanwhile: %v, %v", res.Outcome, err)
	unlock()
	got := await(t, first, "the first caller")
	require.EqualValues(t, 1, runs.Load(), "the handler ran once; the first caller got %v: %v", got.res.Outcome, got.err)
	require.Equal(t, codes.NotFound, status.Code(got.err), "the first caller: %v", got.err)
	for range 4 {
		res, err := store.Execute(ctx, call, fn)
		require.Equal(t, idempotency.OutcomeReplayed, res.Outcome, "%v", err)
		require.Equal(t, statusBytes(t, got.err), statusBytes(t, err), "every caller of the key gets the first caller's answer")
	}
	require.EqualValues(t, 1, runs.Load(), "the handler ran once")
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
