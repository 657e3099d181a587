package idempotencyconnect_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencyconnect"
	"github.com/exactlyonce/idempotency/internal/crashproc"
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// The tests serve connect-go handlers over real sockets (HTTP/1.1 and
// HTTP/2 without TLS), call them with connect-go's client in its three
// protocols, grpc-go's client and curl, and keep keys in the real
// PostgreSQL.

func TestMain(m *testing.M) {
	if os.Getenv(crashChildEnv) != "" {
		os.Exit(crashproc.Main(serveCrashChild))
	}
	os.Exit(testdb.RunWithLeakCheck(m))
}

// The procedures of the test service (internal/testpb): Required is
// annotated MODE_REQUIRED, NoSideEffects idempotency_level NO_SIDE_EFFECTS.
const (
	procRequired      = "/idempotency.testing.v1.PolicyService/Required"
	procNoSideEffects = "/idempotency.testing.v1.PolicyService/NoSideEffects"
	procStream        = "/idempotency.testing.v1.PolicyService/Stream"
)

// method is the descriptor of a method of the test service, which
// generated connect code would hand connect.WithSchema.
func method(name protoreflect.Name) protoreflect.MethodDescriptor {
	return testingv1.File_idempotency_testing_v1_policy_proto.Services().ByName("PolicyService").Methods().ByName(name)
}

// env is a database with a ledger table, a store, and a connect handler
// of the test service in front of them.
type env struct {
	t     *testing.T
	db    *testdb.DB
	store *idempotency.Store
	runs  atomic.Int64
	// hold, when set, is waited for by every run of the handler.
	hold chan struct{}
	// handle replaces the handler's default work when set.
	handle func(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error)
	url    string // the h2c and HTTP/1.1 server
	mux    *http.ServeMux
}

func newEnv(t *testing.T, opts ...idempotency.ServerOption) *env {
	t.Helper()
	e := &env{t: t, db: testdb.New(t, 8)}
	var err error
	e.store, err = idempotency.NewStore(e.db.Pool)
	require.NoError(t, err)
	require.NoError(t, e.store.Migrate(context.Background()))
	_, err = e.db.Pool.Exec(context.Background(), `CREATE TABLE ledger (id bigserial PRIMARY KEY, body text NOT NULL)`)
	require.NoError(t, err)
	e.mux = handlers(t, e.store, e.serve, opts...)
	e.url = serve(t, e.mux)
	return e
}

// handlers is the test service's connect handlers on a mux, with the
// idempotency interceptor.
func handlers(t testing.TB, store *idempotency.Store, fn func(context.Context, *testingv1.Request) (*testingv1.Response, error), opts ...idempotency.ServerOption) *http.ServeMux {
	t.Helper()
	mux, err := newHandlers(store, fn, opts...)
	require.NoError(t, err)
	return mux
}

func newHandlers(store *idempotency.Store, fn func(context.Context, *testingv1.Request) (*testingv1.Response, error), opts ...idempotency.ServerOption) (*http.ServeMux, error) {
	ic, err := idempotencyconnect.NewHandlerInterceptor(store, opts...)
	if err != nil {
		return nil, err
	}
	unary := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		resp, err := fn(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		r := connect.NewResponse(resp)
		r.Header().Set("X-Ledger-Id", strconv.FormatInt(resp.GetLedgerId(), 10))
		r.Trailer().Set("X-Handler", "ran")
		return r, nil
	}
	mux := http.NewServeMux()
	for _, name := range []protoreflect.Name{"Required", "NoSideEffects", "Optional", "Unannotated"} {
		m := method(name)
		path := "/" + string(m.Parent().FullName()) + "/" + string(m.Name())
		mux.Handle(path, connect.NewUnaryHandler(path, unary, connect.WithSchema(m), connect.WithInterceptors(ic)))
	}
	mux.Handle(procStream, connect.NewServerStreamHandler(procStream, func(ctx context.Context, req *connect.Request[testingv1.Request], s *connect.ServerStream[testingv1.Response]) error {
		return s.Send(&testingv1.Response{Body: "streamed"})
	}, connect.WithInterceptors(ic)))
	return mux, nil
}

// h2cServer is a server of h over HTTP/1.1 and HTTP/2 without TLS.
func h2cServer(h http.Handler) *http.Server {
	srv := &http.Server{Handler: h, Protocols: new(http.Protocols)}
	srv.Protocols.SetHTTP1(true)
	srv.Protocols.SetUnencryptedHTTP2(true)
	return srv
}

// serve serves h over HTTP/1.1 and HTTP/2 without TLS (h2c), as
// connect-go's and grpc-go's clients reach it.
func serve(t testing.TB, h http.Handler) string {
	t.Helper()
	srv := httptest.NewUnstartedServer(h)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.URL
}

// serve is the handler's default work: a ledger row through the call's
// transaction, answered with its id.
func (e *env) serve(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
	e.runs.Add(1)
	if e.hold != nil {
		select {
		case <-e.hold:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if e.handle != nil {
		return e.handle(ctx, req)
	}
	return ledger(ctx, req)
}

// ledger writes a ledger row named by the request through the call's
// transaction (or the pool's, for a call that passed through).
func ledger(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
	tx, ok := idempotency.TxFromContext(ctx)
	if !ok {
		return &testingv1.Response{Body: "unprotected " + req.GetBody()}, nil
	}
	var id int64
	if err := tx.QueryRow(ctx, `INSERT INTO ledger (body) VALUES ($1) RETURNING id`, req.GetBody()).Scan(&id); err != nil {
		return nil, err
	}
	return &testingv1.Response{Body: "charged " + req.GetBody(), LedgerId: id}, nil
}

func (e *env) ledgerRows() int { return e.db.Count(e.t, `SELECT count(*) FROM ledger`) }

// protocol is a way a connect client calls.
type protocol struct {
	name string
	opts []connect.ClientOption
	h2c  bool
}

var protocols = []protocol{
	{"connect+json", []connect.ClientOption{connect.WithProtoJSON()}, false},
	{"connect+proto", nil, false},
	{"grpc", []connect.ClientOption{connect.WithGRPC()}, true},
	{"grpc-web", []connect.ClientOption{connect.WithGRPCWeb()}, false},
}

// httpClient is a client for the test server: HTTP/1.1, or HTTP/2 without
// TLS, which the gRPC protocol needs. Its connections close when t ends.
func httpClient(t testing.TB, h2c bool) *http.Client {
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	if h2c {
		tr.Protocols = new(http.Protocols)
		tr.Protocols.SetUnencryptedHTTP2(true)
	}
	return &http.Client{Transport: tr}
}

// client is a connect client of procedure in protocol p, with the
// idempotency client interceptor (options opts) unless plain.
func client(t testing.TB, url, procedure string, p protocol, plain bool, opts ...idempotency.ClientOption) *connect.Client[testingv1.Request, testingv1.Response] {
	t.Helper()
	copts := append([]connect.ClientOption{}, p.opts...)
	if !plain {
		ic, err := idempotencyconnect.NewClientInterceptor(opts...)
		require.NoError(t, err)
		copts = append(copts, connect.WithInterceptors(ic))
	}
	return connect.NewClient[testingv1.Request, testingv1.Response](httpClient(t, p.h2c), url+procedure, copts...)
}

// grpcClient is a grpc-go client of the server at url (h2c).
func grpcClient(t testing.TB, url string, interceptors ...grpc.UnaryClientInterceptor) testingv1.PolicyServiceClient {
	t.Helper()
	conn, err := grpc.NewClient(url[len("http://"):], grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithChainUnaryInterceptor(interceptors...))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return testingv1.NewPolicyServiceClient(conn)
}

// keyed is a request with the key header set.
func keyed(key, body string) *connect.Request[testingv1.Request] {
	req := connect.NewRequest(&testingv1.Request{Body: body})
	req.Header().Set(idempotency.HeaderKey, key)
	return req
}

// waitFor waits until done, for at most a minute.
func waitFor(t *testing.T, what string, done func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !done() {
		if time.Now().After(deadline) {
			t.Fatalf("not reached in a minute: %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// connectCode is err's connect code, CodeUnknown for an error that is not
// a connect error, 0 for nil.
func connectCode(err error) connect.Code {
	if err == nil {
		return 0
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Code()
	}
	return connect.CodeUnknown
}

// schemaPool is a pool on the test database with the schema of db, whose
// connections go through addr ("host:port") when it is not empty.
func schemaPool(t testing.TB, db *testdb.DB, addr string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(db.URL())
	require.NoError(t, err)
	cfg.MaxConns = 4
	if addr != "" {
		host, port, err := net.SplitHostPort(addr)
		require.NoError(t, err)
		p, err := strconv.ParseUint(port, 10, 16)
		require.NoError(t, err)
		cfg.ConnConfig.Host, cfg.ConnConfig.Port = host, uint16(p)
		cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// listen is a loopback listener, closed when the test ends.
func listen(t testing.TB) net.Listener {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = lis.Close() })
	return lis
}

// unaryFn is a connect handler of the test service's methods.
type unaryFn func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error)

// mount serves fn for every unary method named, behind the idempotency
// interceptor (with handler options before and after it), and returns the
// server's URL.
func mount(t *testing.T, store *idempotency.Store, fn unaryFn, before, after []connect.Interceptor, hopts []connect.HandlerOption, opts ...idempotency.ServerOption) string {
	t.Helper()
	ic, err := idempotencyconnect.NewHandlerInterceptor(store, opts...)
	require.NoError(t, err)
	chain := append(append(append([]connect.Interceptor{}, before...), ic), after...)
	mux := http.NewServeMux()
	for _, name := range []protoreflect.Name{"Required", "NoSideEffects", "Optional", "Unannotated", "Disabled"} {
		m := method(name)
		path := "/" + string(m.Parent().FullName()) + "/" + string(m.Name())
		o := append([]connect.HandlerOption{connect.WithSchema(m)}, hopts...)
		o = append(o, connect.WithInterceptors(chain...))
		mux.Handle(path, connect.NewUnaryHandler(path, fn, o...))
	}
	return serve(t, mux)
}

// ledgerFn is the default work as a connect handler: a ledger row.
func ledgerFn(runs *atomic.Int64) unaryFn {
	return func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		resp, err := ledger(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(resp), nil
	}
}
