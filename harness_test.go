package idempotency_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// The test harness of the package: a hand-declared gRPC service, servers on
// loopback sockets with stores on real PostgreSQL schemas, and the clients
// and checks that the suites share. Every test file builds on it.

// The test service is declared by hand so that the core tests need no
// generated code: two unary methods taking and returning StringValue.
const (
	methodCharge = "/idempotency.test.Ledger/Charge"
	methodRefund = "/idempotency.test.Ledger/Refund"
)

type handlerFunc func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error)

func ledgerDesc() *grpc.ServiceDesc {
	method := func(name string) grpc.MethodDesc {
		return grpc.MethodDesc{MethodName: name, Handler: func(srv any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
			req := &wrapperspb.StringValue{}
			if err := dec(req); err != nil {
				return nil, err
			}
			h := srv.(*ledger).handler
			info := &grpc.UnaryServerInfo{Server: srv, FullMethod: "/idempotency.test.Ledger/" + name}
			if icpt == nil {
				return h(ctx, req)
			}
			return icpt(ctx, req, info, func(ctx context.Context, req any) (any, error) {
				return h(ctx, req.(*wrapperspb.StringValue))
			})
		}}
	}
	return &grpc.ServiceDesc{
		ServiceName: "idempotency.test.Ledger",
		HandlerType: (*any)(nil),
		Methods:     []grpc.MethodDesc{method("Charge"), method("Refund")},
	}
}

type ledger struct{ handler handlerFunc }

// env is one test's world: its own schema with a migrated key table and a
// ledger table, a store, and a gRPC server on a loopback TCP socket.
type env struct {
	t       *testing.T
	db      *testdb.DB
	store   *idempotency.Store
	conn    *grpc.ClientConn
	addr    string
	runs    atomic.Int64 // handler invocations, committed or not
	execs   atomic.Int64 // calls whose execution committed (OutcomeExecuted)
	arrived atomic.Int64 // calls that reached the server, before any interceptor
	srv     *grpc.Server
}

// liveness bounds how long a test waits for something that must happen;
// reaching it is a failure, never a measurement.
const liveness = 30 * time.Second

// gate holds a handler until the test opens it.
type gate struct {
	ch   chan struct{}
	once sync.Once
}

func newGate() *gate { return &gate{ch: make(chan struct{})} }

func (g *gate) open() { g.once.Do(func() { close(g.ch) }) }

// wait returns once the gate is open, or an error when the call ends or
// the test never opens it.
func (g *gate) wait(ctx context.Context) error {
	t := time.NewTimer(liveness)
	defer t.Stop()
	select {
	case <-g.ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return fmt.Errorf("the test never opened the gate within %v", liveness)
	}
}

// heldDuplicates makes n calls at once while the one that runs is held at
// release. It opens release once ready (told how many calls are back)
// says so, then waits for every call.
func heldDuplicates(t *testing.T, n int, release *gate, call func(i int), ready func(back int64) bool, what string) {
	t.Helper()
	var wg sync.WaitGroup
	var back atomic.Int64
	for i := range n {
		wg.Go(func() {
			call(i)
			back.Add(1)
		})
	}
	require.Eventually(t, func() bool { return ready(back.Load()) }, liveness, time.Millisecond, what)
	release.open()
	wg.Wait()
}

type envConfig struct {
	handler      handlerFunc
	opts         []idempotency.ServerOption
	storeOpts    []idempotency.StoreOption
	interceptors []grpc.UnaryServerInterceptor // outside ours
	tracer       idempotency.Tracer            // the store's, beside the harness's own
}

func newEnv(t *testing.T, cfg envConfig) *env {
	t.Helper()
	e := &env{t: t, db: testdb.New(t, 40)}
	e.store = migratedStore(t, e.db, append(slices.Clone(cfg.storeOpts), idempotency.WithTracer(countExecutions(&e.execs, cfg.tracer)))...)
	createLedger(t, e.db)

	h := cfg.handler
	if h == nil {
		h = e.insertLedger
	}
	counted := func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		e.runs.Add(1)
		return h(ctx, req)
	}
	arrive := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
		e.arrived.Add(1)
		return next(ctx, req)
	}
	chain := append([]grpc.UnaryServerInterceptor{arrive}, cfg.interceptors...)
	chain = append(chain, idempotency.UnaryServerInterceptor(e.store, cfg.opts...))
	e.srv = grpc.NewServer(grpc.ChainUnaryInterceptor(chain...))
	e.srv.RegisterService(ledgerDesc(), &ledger{handler: counted})
	e.addr = serve(t, e.srv)
	e.conn = dial(t, e.addr)
	return e
}

func dial(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// insertLedger is the default handler: one business row, written through the
// call's transaction, and a response naming that row.
func (e *env) insertLedger(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
	var db interface {
		QueryRow(context.Context, string, ...any) pgx.Row
	} = e.db.Pool // calls without a key have no transaction
	if tx, ok := idempotency.TxFromContext(ctx); ok {
		db = tx
	}
	var id int64
	if err := db.QueryRow(ctx, `INSERT INTO ledger (note) VALUES ($1) RETURNING id`, req.GetValue()).Scan(&id); err != nil {
		return nil, err
	}
	return wrapperspb.String(req.GetValue() + "#" + time.Now().Format(time.RFC3339Nano) + "#" + strconv.FormatInt(id, 10)), nil
}

// reply is what a client saw of one call.
type reply struct {
	resp     *wrapperspb.StringValue
	raw      []byte // the response re-encoded, for byte comparisons
	err      error
	replayed bool
}

func (e *env) call(ctx context.Context, method, key, body string) reply {
	if key != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, key)
	}
	return invoke(ctx, e.conn, method, body)
}

func invoke(ctx context.Context, conn *grpc.ClientConn, method, body string) reply {
	var trailer metadata.MD
	resp := &wrapperspb.StringValue{}
	err := conn.Invoke(ctx, method, wrapperspb.String(body), resp, grpc.Trailer(&trailer))
	r := reply{err: err, replayed: len(trailer.Get(idempotency.ReplayedTrailer)) == 1 && trailer.Get(idempotency.ReplayedTrailer)[0] == "true"}
	if err == nil {
		r.resp = resp
		r.raw, _ = proto.Marshal(resp)
	}
	return r
}

func (e *env) ledgerRows() int { return e.db.Count(e.t, `SELECT count(*) FROM ledger`) }

func (e *env) keyRows() int { return e.db.Count(e.t, `SELECT count(*) FROM idempotency_keys`) }

func (e *env) keyState(key string) string {
	var st string
	err := e.db.Pool.QueryRow(context.Background(), `SELECT state FROM idempotency_keys WHERE key = $1`, key).Scan(&st)
	if err == pgx.ErrNoRows {
		return ""
	}
	require.NoError(e.t, err)
	return st
}

// init registers a descriptor for idempotency.test.Catalog in the global
// registry, as generated code would: Get is NO_SIDE_EFFECTS, Put is
// IDEMPOTENT, Buy is unmarked.
func init() {
	level := func(l descriptorpb.MethodOptions_IdempotencyLevel) *descriptorpb.MethodOptions {
		return &descriptorpb.MethodOptions{IdempotencyLevel: l.Enum()}
	}
	method := func(name string, opts *descriptorpb.MethodOptions) *descriptorpb.MethodDescriptorProto {
		return &descriptorpb.MethodDescriptorProto{
			Name: proto.String(name), InputType: proto.String(".google.protobuf.StringValue"),
			OutputType: proto.String(".google.protobuf.StringValue"), Options: opts,
		}
	}
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name:       proto.String("idempotency/test/catalog.proto"),
		Package:    proto.String("idempotency.test"),
		Dependency: []string{"google/protobuf/wrappers.proto"},
		Syntax:     proto.String("proto3"),
		Service: []*descriptorpb.ServiceDescriptorProto{{
			Name: proto.String("Catalog"),
			Method: []*descriptorpb.MethodDescriptorProto{
				method("Get", level(descriptorpb.MethodOptions_NO_SIDE_EFFECTS)),
				method("Put", level(descriptorpb.MethodOptions_IDEMPOTENT)),
				method("Buy", nil),
			},
		}},
	}, protoregistry.GlobalFiles)
	if err != nil {
		panic(err)
	}
	if err := protoregistry.GlobalFiles.RegisterFile(fd); err != nil {
		panic(err)
	}
}

// migratedStore returns a store on db's schema with its table migrated.
func migratedStore(t testing.TB, db *testdb.DB, opts ...idempotency.StoreOption) *idempotency.Store {
	t.Helper()
	store, err := idempotency.NewStore(db.Pool, opts...)
	require.NoError(t, err)
	require.NoError(t, store.Migrate(context.Background()))
	return store
}

// serve starts srv on a loopback port, stopped when t ends, and returns the
// address.
func serve(t *testing.T, srv *grpc.Server) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

// What the reliability suite (crash, outage, replicas, races) adds:
// servers built on a pool the test chooses, a ledger that names the key of
// every business row, and a client that records every attempt.

// suiteDB is a schema with a migrated key table and a ledger whose rows name
// the key of the call that wrote them, so keys and business rows can be
// matched one to one.
func suiteDB(t *testing.T) *testdb.DB {
	t.Helper()
	db := testdb.New(t, 4)
	ctx := context.Background()
	migratedStore(t, db)
	_, err := db.Pool.Exec(ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, note text NOT NULL, key text NOT NULL)`)
	require.NoError(t, err)
	return db
}

// schemaPool opens a pool on the schema of db, for a server of its own;
// tweak, when set, adjusts the configuration first (its address, a tracer).
func schemaPool(t testing.TB, schema string, maxConns int32, tweak func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = maxConns
	if tweak != nil {
		tweak(cfg)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// keyedLedger is the suite's handler: one ledger row per execution, written
// through the call's transaction and naming the call's key, and a response
// naming that row ("<body>#<row id>").
func keyedLedger(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
	tx := idempotency.MustTxFromContext(ctx)
	key := metadata.ValueFromIncomingContext(ctx, idempotency.MetadataKey)[0]
	var id int64
	if err := tx.QueryRow(ctx, `INSERT INTO ledger (note, key) VALUES ($1, $2) RETURNING id`, req.GetValue(), key).Scan(&id); err != nil {
		return nil, err // as a handler would: the library decides what the client sees
	}
	return wrapperspb.String(fmt.Sprintf("%s#%d", req.GetValue(), id)), nil
}

// replica is one server on a shared database.
type replica struct {
	srv   *grpc.Server
	addr  string
	execs atomic.Int64 // committed executions
}

type replicaConfig struct {
	handler      handlerFunc // defaults to keyedLedger
	interceptors []grpc.UnaryServerInterceptor
	storeOpts    []idempotency.StoreOption
	tracer       idempotency.Tracer // the store's, beside the replica's own
}

// startReplica serves the test ledger on a loopback port with a store on
// pool. The server stops when the test ends; a test may stop it earlier.
func startReplica(t *testing.T, pool *pgxpool.Pool, cfg replicaConfig) *replica {
	t.Helper()
	r := &replica{}
	store, err := idempotency.NewStore(pool, append(slices.Clone(cfg.storeOpts), idempotency.WithTracer(countExecutions(&r.execs, cfg.tracer)))...)
	require.NoError(t, err)
	h := cfg.handler
	if h == nil {
		h = keyedLedger
	}
	r.srv = grpc.NewServer(grpc.ChainUnaryInterceptor(append(slices.Clone(cfg.interceptors), idempotency.UnaryServerInterceptor(store))...))
	r.srv.RegisterService(ledgerDesc(), &ledger{handler: h})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	r.addr = lis.Addr().String()
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = r.srv.Serve(lis)
	}()
	t.Cleanup(func() {
		r.srv.Stop()
		<-done
	})
	return r
}

// requireKeysMatchLedger checks the database after a fault: every key has
// exactly one business row and every business row its key, and no key is
// left unfinished.
func requireKeysMatchLedger(t *testing.T, db *testdb.DB) {
	t.Helper()
	for what, sql := range map[string]string{
		"keys without a ledger row":      `SELECT count(*) FROM idempotency_keys k WHERE NOT EXISTS (SELECT FROM ledger l WHERE l.key = k.key)`,
		"ledger rows without a key":      `SELECT count(*) FROM ledger l WHERE NOT EXISTS (SELECT FROM idempotency_keys k WHERE k.key = l.key)`,
		"keys with several ledger rows":  `SELECT count(*) FROM (SELECT key FROM ledger GROUP BY key HAVING count(*) > 1) d`,
		"keys not finished successfully": `SELECT count(*) FROM idempotency_keys WHERE state <> 'succeeded'`,
	} {
		require.Zero(t, db.Count(t, sql), what)
	}
}

// attemptLog is a client interceptor placed below the retry interceptor, so
// it sees every attempt: it tallies their status codes and the longest one.
type attemptLog struct {
	mu      sync.Mutex
	codes   map[codes.Code]int
	longest time.Duration
}

func (a *attemptLog) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	start := time.Now()
	err := invoker(ctx, method, req, reply, cc, opts...)
	d := time.Since(start)
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.codes == nil {
		a.codes = map[codes.Code]int{}
	}
	a.codes[status.Code(err)]++
	a.longest = max(a.longest, d)
	return err
}

// failures returns the failed attempts by code, e.g. "Unavailable=12".
func (a *attemptLog) failures() (n int, byCode string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	var parts []string
	for c, k := range a.codes {
		if c != codes.OK {
			n += k
			parts = append(parts, fmt.Sprintf("%s=%d", c, k))
		}
	}
	slices.Sort(parts)
	return n, strings.Join(parts, " ")
}

// requireOnlyFailures fails the test if any attempt ended with a code not
// in allowed.
func (a *attemptLog) requireOnlyFailures(t *testing.T, allowed ...codes.Code) {
	t.Helper()
	a.mu.Lock()
	defer a.mu.Unlock()
	for c, n := range a.codes {
		if c != codes.OK && !slices.Contains(allowed, c) {
			t.Errorf("%d attempts ended with %s; only %v are expected", n, c, allowed)
		}
	}
}

// retryingClient dials target with the library's client interceptor and
// an attemptLog below it.
func retryingClient(t *testing.T, target string, retryMax uint, extra ...grpc.DialOption) (*grpc.ClientConn, *attemptLog) {
	t.Helper()
	log := &attemptLog{}
	chain := []grpc.UnaryClientInterceptor{idempotency.UnaryClientInterceptor(
		idempotency.WithMaxAttempts(int(retryMax)+1),
		idempotency.WithRetryBackoff(10*time.Millisecond, 250*time.Millisecond),
		idempotency.WithPerAttemptTimeout(30*time.Second),
	), log.intercept}
	opts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(chain...),
	}, extra...)
	conn, err := grpc.NewClient(target, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn, log
}

// retryCounter is a call option counting the retry interceptor's retries.
func retryCounter(n *atomic.Int64) grpc.CallOption {
	return retry.WithOnRetryCallback(func(context.Context, uint, error) { n.Add(1) })
}

// retryCodes are the codes UnaryClientInterceptor retries, as its doc lists
// them.
var retryCodes = []codes.Code{codes.Unavailable, codes.Aborted, codes.ResourceExhausted}

// chargeUntilDone finishes logical call i: the retry chain retries it with
// one key; when the chain gives up on a retryable error, the application
// retries the same logical call later with the key it captured.
func chargeUntilDone(ctx context.Context, conn *grpc.ClientConn, i int, retries, appRetries *atomic.Int64) (*wrapperspb.StringValue, error) {
	var key string
	onRetry := retryCounter(retries)
	resp, err := charge(ctx, conn, i, idempotency.CaptureKey(&key), onRetry)
	for err != nil && slices.Contains(retryCodes, status.Code(err)) && ctx.Err() == nil {
		appRetries.Add(1)
		time.Sleep(100 * time.Millisecond)
		resp, err = charge(idempotency.WithOutgoingKey(ctx, key), conn, i, onRetry)
	}
	return resp, err
}

// killBackend terminates the PostgreSQL session with pid and waits until it
// is gone, so that whatever its client sends next meets a dead session.
func killBackend(t testing.TB, pid uint32) {
	t.Helper()
	admin := testdb.Admin(t)
	ctx := context.Background()
	if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Errorf("terminate backend %d: %v", pid, err)
		return
	}
	deadline := time.Now().Add(liveness)
	for {
		var alive bool
		if err := admin.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)`, pid).Scan(&alive); err != nil || !alive {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("backend %d still alive %v after pg_terminate_backend", pid, liveness)
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// executeAsync runs call on store in a goroutine of its own; its error
// comes on the channel returned.
func executeAsync(store *idempotency.Store, call idempotency.Call, fn idempotency.Func) <-chan error {
	done := make(chan error, 1)
	go func() {
		_, err := store.Execute(context.Background(), call, fn)
		done <- err
	}()
	return done
}

// await receives from ch, failing the test after 10 s instead of hanging the
// whole binary when what it waits for never happens.
func await[T any](t testing.TB, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(liveness):
		t.Fatalf("gave up after %v waiting for %s", liveness, what)
		panic("unreachable")
	}
}

// countExecutions is a store's tracer that counts the calls that executed
// in n, and passes every call on to also, when it is not nil.
func countExecutions(n *atomic.Int64, also idempotency.Tracer) idempotency.Tracer {
	counting := endTracer(func(_ context.Context, data idempotency.TraceCallEndData) {
		if data.Outcome == idempotency.OutcomeExecuted {
			n.Add(1)
		}
	})
	if also == nil {
		return counting
	}
	return idempotency.JoinTracers(counting, also)
}

// createLedger creates the ledger table the simple handlers write to.
func createLedger(t testing.TB, db *testdb.DB) {
	t.Helper()
	_, err := db.Pool.Exec(context.Background(), `CREATE TABLE ledger (id bigserial PRIMARY KEY, note text NOT NULL)`)
	require.NoError(t, err)
}

// requireNoKeyLocks asserts that no backend holds the lock of any of keys.
// A connection the engine closed holds its locks until its backend has
// seen the close and exited, a moment after the call returned: the check
// waits for that, and a lock a live connection keeps fails it.
func requireNoKeyLocks(t testing.TB, db *testdb.DB, scope string, keys []string, msg string) {
	t.Helper()
	require.Eventually(t, func() bool { return heldKeyLocks(t, db, scope, keys) == 0 }, liveness, 5*time.Millisecond, msg)
}

// heldKeyLocks counts the advisory locks that backends hold on the keys of
// scope in db's key table: a lock's 64-bit key is the hash the engine
// computes (see renderStatements), split by pg_locks into classid and objid.
func heldKeyLocks(t testing.TB, db *testdb.DB, scope string, keys []string) int {
	t.Helper()
	table := pgx.Identifier{db.Schema, idempotency.DefaultTable}.Sanitize()
	return db.Count(t, `SELECT count(*) FROM pg_locks l
JOIN (SELECT hashtextextended(k, hashtextextended($1, $2::regclass::oid::bigint)) AS h FROM unnest($3::text[]) k) key
ON l.locktype = 'advisory' AND l.objsubid = 1 AND l.classid::bigint = (key.h >> 32) & 4294967295 AND l.objid::bigint = key.h & 4294967295`,
		scope, table, keys)
}

// endTracer is an idempotency.Tracer that only looks at the end of each
// call.
type endTracer func(ctx context.Context, data idempotency.TraceCallEndData)

func (f endTracer) TraceCallStart(ctx context.Context, _ idempotency.TraceCallStartData) context.Context {
	return ctx
}

func (f endTracer) TraceCallEnd(ctx context.Context, data idempotency.TraceCallEndData) { f(ctx, data) }

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

// requireStoredInternal requires err to be a stored Internal error saying
// what.
func requireStoredInternal(t *testing.T, err error, what string) {
	t.Helper()
	require.Equal(t, codes.Internal, status.Code(err), "%v", err)
	require.True(t, idempotency.IsFinal(err), "stored: %v", err)
	require.Contains(t, status.Convert(err).Message(), what)
}

// keyState is the state of key's row in db's key table, "" when it has none.
func keyState(t *testing.T, db *testdb.DB, key string) string {
	t.Helper()
	var state string
	err := db.Pool.QueryRow(context.Background(), `SELECT state FROM idempotency_keys WHERE key = $1`, key).Scan(&state)
	if errors.Is(err, pgx.ErrNoRows) {
		return ""
	}
	require.NoError(t, err)
	return state
}

// testRole creates a login role for t (dropped when t ends) with the
// privileges of the test database's schema, and runs each alter on it (%s
// is the role's quoted name). Creating roles needs CREATEROLE, and some
// settings a superuser: the tests' role has both on the local server.
func testRole(t *testing.T, alters ...string) string {
	t.Helper()
	var b [4]byte
	_, _ = rand.Read(b[:])
	name := "idempotency_test_" + hex.EncodeToString(b[:])
	quoted := pgx.Identifier{name}.Sanitize()
	admin := testdb.Admin(t)
	ctx := context.Background()
	if _, err := admin.Exec(ctx, "CREATE ROLE "+quoted+" LOGIN"); err != nil {
		t.Fatalf("create role %s (the tests need CREATEROLE): %v", name, err)
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", name)
		if _, err := admin.Exec(ctx, "DROP OWNED BY "+quoted+"; DROP ROLE "+quoted); err != nil {
			t.Errorf("drop role %s: %v", name, err)
		}
	})
	for _, alter := range alters {
		if _, err := admin.Exec(ctx, strings.ReplaceAll(alter, "%s", quoted)); err != nil {
			t.Fatalf("%s: %v", alter, err)
		}
	}
	return name
}

// deadlineCue makes contexts whose deadline passes when the test says so:
// Err is context.DeadlineExceeded once expired, as a timer's would be.
type deadlineCue struct {
	done chan struct{}
	once sync.Once
}

func newDeadlineCue() *deadlineCue { return &deadlineCue{done: make(chan struct{})} }

func (c *deadlineCue) wrap(parent context.Context) context.Context {
	return cuedContext{Context: parent, cue: c}
}

func (c *deadlineCue) expire() { c.once.Do(func() { close(c.done) }) }

// expireWhenSleeping expires the cue once the backend in pid is inside the
// handler's pg_sleep.
func (c *deadlineCue) expireWhenSleeping(t *testing.T, db *testdb.DB, pid *atomic.Uint32) {
	t.Helper()
	defer c.expire() // a failed wait must not leave the call sleeping
	require.Eventually(t, func() bool {
		p := pid.Load()
		return p != 0 && db.Count(t, fmt.Sprintf(`SELECT count(*) FROM pg_stat_activity WHERE pid = %d AND wait_event = 'PgSleep'`, p)) == 1
	}, liveness, time.Millisecond, "the handler's statement to run")
}

type cuedContext struct {
	context.Context
	cue *deadlineCue
}

func (c cuedContext) Deadline() (time.Time, bool) { return time.Now().Add(time.Hour), true }

func (c cuedContext) Done() <-chan struct{} { return c.cue.done }

func (c cuedContext) Err() error {
	select {
	case <-c.cue.done:
		return context.DeadlineExceeded
	default:
		return c.Context.Err()
	}
}

// What the HTTP tests share: a client that sends a request under a key
// and reads the whole response, trailers included, and a POST of a body
// under a Content-Type.

// mountedReply is what a client received, trailers included.
type mountedReply struct {
	status  int
	header  http.Header
	trailer http.Header
	body    string
}

// do sends req with the key and reads the whole response.
func do(t *testing.T, client *http.Client, req *http.Request, key string) mountedReply {
	t.Helper()
	if key != "" {
		req.Header.Set(idempotency.HeaderKey, key)
	}
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return mountedReply{resp.StatusCode, resp.Header, resp.Trailer, string(b)}
}

func mountedPost(t *testing.T, url, contentType, body string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	return req
}

// lockTriesDB is a test database whose round trips that try a key's
// advisory lock (a claim, a probe of a wait) are counted in tries while
// counting is set; pool, when not nil, configures the pool further.
func lockTriesDB(t *testing.T, counting *atomic.Bool, pool func(*pgxpool.Config)) (db *testdb.DB, tries *atomic.Int64) {
	t.Helper()
	tries = new(atomic.Int64)
	db = testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.Tracer = &testdb.Tracer{OnRoundTrip: func(_ context.Context, _ *pgx.Conn, statements []string) {
			if counting.Load() && strings.Contains(strings.Join(statements, ";"), "pg_try_advisory") {
				tries.Add(1)
			}
		}}
		if pool != nil {
			pool(cfg)
		}
	})
	return db, tries
}
