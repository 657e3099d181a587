package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/faultproxy"
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// keyRecorder is a server interceptor, outside ours, that records the key of
// every attempt reaching the server.
type keyRecorder struct {
	mu       sync.Mutex
	attempts int
	keys     map[string]int // key -> attempts carrying it
	bodies   map[string]map[string]bool
}

func newKeyRecorder() *keyRecorder {
	return &keyRecorder{keys: map[string]int{}, bodies: map[string]map[string]bool{}}
}

func (k *keyRecorder) intercept(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	key := strings.Join(metadata.ValueFromIncomingContext(ctx, idempotency.MetadataKey), ",")
	body := req.(*wrapperspb.StringValue).GetValue()
	k.mu.Lock()
	k.attempts++
	k.keys[key]++
	if k.bodies[body] == nil {
		k.bodies[body] = map[string]bool{}
	}
	k.bodies[body][key] = true
	k.mu.Unlock()
	return h(ctx, req)
}

// keysPerBody returns the largest number of distinct keys one request body
// was sent with: 1 when every logical call kept its key.
func (k *keyRecorder) keysPerBody() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	most := 0
	for _, keys := range k.bodies {
		most = max(most, len(keys))
	}
	return most
}

// faultyEnv is an env whose clients reach the server through a proxy that
// drops responses after the server committed.
type faultyEnv struct {
	*env
	proxy *faultproxy.Proxy
	rec   *keyRecorder
}

func newFaultyEnv(t *testing.T, dropRate float64, seed int64) *faultyEnv {
	rec := newKeyRecorder()
	e := newEnv(t, envConfig{interceptors: []grpc.UnaryServerInterceptor{rec.intercept}})
	p, err := faultproxy.New(e.addr, faultproxy.WithSeed(seed), faultproxy.WithDropResponseRate(dropRate))
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return &faultyEnv{env: e, proxy: p, rec: rec}
}

func (f *faultyEnv) dial(t *testing.T, opts ...grpc.DialOption) *grpc.ClientConn {
	conn, err := grpc.NewClient("passthrough:///"+f.proxy.Addr(),
		append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// exactlyOnce checks the business effect of n logical calls "charge 0" ..
// "charge n-1": one ledger row each, no more, no fewer. It returns a
// description of every violation.
func (e *env) exactlyOnce(n int) []string {
	rows, err := e.db.Pool.Query(context.Background(), `SELECT note, count(*) FROM ledger GROUP BY note`)
	require.NoError(e.t, err)
	counts := map[string]int{}
	for rows.Next() {
		var note string
		var c int
		require.NoError(e.t, rows.Scan(&note, &c))
		counts[note] = c
	}
	require.NoError(e.t, rows.Err())
	var bad []string
	for i := 0; i < n; i++ {
		if c := counts[body(i)]; c != 1 {
			bad = append(bad, fmt.Sprintf("%s executed %d times", body(i), c))
		}
	}
	return bad
}

func body(i int) string { return fmt.Sprintf("charge %d", i) }

// runLogical runs n logical calls from workers goroutines; call must finish
// one logical call (retrying as it sees fit) and return its response.
func runLogical(t *testing.T, n, workers int, call func(ctx context.Context, i int) (*wrapperspb.StringValue, error)) {
	t.Helper()
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				resp, err := call(ctx, i)
				cancel()
				switch {
				case err != nil:
					errs <- fmt.Errorf("%s: %w", body(i), err)
				case !strings.HasPrefix(resp.GetValue(), body(i)+"#"):
					errs <- fmt.Errorf("%s: got response %q, which belongs to another call", body(i), resp.GetValue())
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func charge(ctx context.Context, conn *grpc.ClientConn, i int, opts ...grpc.CallOption) (*wrapperspb.StringValue, error) {
	resp := &wrapperspb.StringValue{}
	return resp, conn.Invoke(ctx, methodCharge, wrapperspb.String(body(i)), resp, opts...)
}

const (
	e2eCalls   = 500
	e2eWorkers = 8
	e2eDrop    = 0.3
)

// The headline guarantee: 30% of responses are lost after the server
// committed, the client retries through go-grpc-middleware's retry
// interceptor, and every charge happens exactly once.
//
// The proxy loses a response by cutting its connection, which fails every
// call in flight on it too, so under load a call can use up the chain's
// retries; the application then retries it with the key it captured, as
// the README says to.
func TestDroppedResponsesWithRetryInterceptor(t *testing.T) {
	t.Parallel()
	f := newFaultyEnv(t, e2eDrop, 1)
	var retries, appRetries atomic.Int64
	conn := f.dial(t, grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor(
		idempotency.WithMaxAttempts(31),
		idempotency.WithRetryBackoff(5*time.Millisecond, 100*time.Millisecond),
	)))
	runLogical(t, e2eCalls, e2eWorkers, func(ctx context.Context, i int) (*wrapperspb.StringValue, error) {
		return chargeUntilDone(ctx, conn, i, &retries, &appRetries)
	})
	require.Empty(t, f.exactlyOnce(e2eCalls))
	require.Equal(t, 1, f.rec.keysPerBody(), "every attempt of a logical call carries its one key")
	st := f.proxy.Stats()
	require.Positive(t, st.ResponsesDropped)
	t.Logf("retry interceptor: %d logical calls, %d attempts at the server, %d client retries, %d application retries, %d responses dropped after commit, %d committed executions (%d handler runs incl. rolled back)",
		e2eCalls, f.rec.attempts, retries.Load(), appRetries.Load(), st.ResponsesDropped, f.execs.Load(), f.runs.Load())
	require.EqualValues(t, e2eCalls, f.execs.Load(), "committed executions")
}

// The same with gRPC's own retry policy from the service config: the key
// interceptor runs once per logical call, above the transport's attempts.
func TestDroppedResponsesWithNativeRetryPolicy(t *testing.T) {
	t.Parallel()
	f := newFaultyEnv(t, e2eDrop, 2)
	conn := f.dial(t,
		grpc.WithDefaultServiceConfig(nativeRetryServiceConfig),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1))),
	)
	// gRPC caps maxAttempts at 5, so a few logical calls lose every attempt;
	// the application then retries them with the key the call used.
	var appRetries atomic.Int64
	runLogical(t, e2eCalls, e2eWorkers, func(ctx context.Context, i int) (*wrapperspb.StringValue, error) {
		var key string
		resp, err := charge(ctx, conn, i, idempotency.CaptureKey(&key))
		// Under heavy load grpc-go's native retry can surface the lost
		// connection as a bare io.EOF rather than Unavailable.
		for err != nil && (status.Code(err) == codes.Unavailable || errors.Is(err, io.EOF)) && ctx.Err() == nil {
			appRetries.Add(1)
			time.Sleep(10 * time.Millisecond)
			resp, err = charge(idempotency.WithOutgoingKey(ctx, key), conn, i)
		}
		return resp, err
	})
	require.Empty(t, f.exactlyOnce(e2eCalls))
	require.Equal(t, 1, f.rec.keysPerBody(), "every attempt of a logical call carries its one key")
	st := f.proxy.Stats()
	t.Logf("native retry: %d logical calls, %d attempts at the server, %d responses dropped after commit, %d application retries after 5 attempts, %d committed executions (%d handler runs incl. rolled back)",
		e2eCalls, f.rec.attempts, st.ResponsesDropped, appRetries.Load(), f.execs.Load(), f.runs.Load())
	require.Positive(t, st.ResponsesDropped)
	require.EqualValues(t, e2eCalls, f.execs.Load(), "committed executions")
}

// nativeRetryServiceConfig is the service config shown in the README.
const nativeRetryServiceConfig = `{
  "methodConfig": [{
    "name": [{"service": "idempotency.test.Ledger"}],
    "retryPolicy": {
      "maxAttempts": 5,
      "initialBackoff": "0.01s",
      "maxBackoff": "0.2s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE", "ABORTED", "RESOURCE_EXHAUSTED"]
    }
  }]
}`

// Two goroutines send the same logical call (same key) at once, through the
// faulty network: one execution, both get its response.
func TestSameKeyFromTwoClientsAtOnce(t *testing.T) {
	t.Parallel()
	f := newFaultyEnv(t, e2eDrop, 3)
	conn := f.dial(t, grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor(
		idempotency.WithMaxAttempts(31), idempotency.WithRetryBackoff(5*time.Millisecond, 100*time.Millisecond))))
	const n = 100
	var retries, appRetries atomic.Int64
	for i := 0; i < n; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		ctx = idempotency.WithOutgoingKey(ctx, uuid.Must(uuid.NewV7()).String())
		var wg sync.WaitGroup
		var got [2]*wrapperspb.StringValue
		for g := range got {
			wg.Add(1)
			go func() {
				defer wg.Done()
				resp, err := chargeUntilDone(ctx, conn, i, &retries, &appRetries)
				if err != nil {
					t.Errorf("charge %d: %v", i, err)
				}
				got[g] = resp
			}()
		}
		wg.Wait()
		cancel()
		require.Equal(t, got[0].GetValue(), got[1].GetValue(), "both senders of one key get the same response")
	}
	require.Empty(t, f.exactlyOnce(n))
	t.Logf("same key twice at once: %d keys, %d attempts at the server, %d client retries, %d application retries, %d dropped responses, %d committed executions",
		n, f.rec.attempts, retries.Load(), appRetries.Load(), f.proxy.Stats().ResponsesDropped, f.execs.Load())
	require.EqualValues(t, n, f.execs.Load())
}

// With the key interceptor after the retry interceptor, a retry attempt
// would get a fresh key and charge again. It must fail loudly instead.
func TestWrongChainOrderFailsLoudly(t *testing.T) {
	t.Parallel()
	f := newFaultyEnv(t, 0, 4)
	conn := f.dial(t, grpc.WithChainUnaryInterceptor(
		retry.UnaryClientInterceptor(retry.WithMax(3), retry.WithCodes(codes.Unavailable)),
		idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1)),
	))
	f.proxy.DropNextResponse()
	_, err := charge(context.Background(), conn, 0)
	require.ErrorIs(t, err, idempotency.ErrChainOrder)
	require.Equal(t, codes.Internal, status.Code(err))
	require.Empty(t, f.exactlyOnce(1), "the first attempt charged; the retry did not charge again")
}

// The exactly-once check above would catch a client that mints a key per
// attempt: here a naive key interceptor runs below the retry interceptor.
func TestPerAttemptKeysAreCaught(t *testing.T) {
	t.Parallel()
	f := newFaultyEnv(t, e2eDrop, 5)
	naive := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		ctx = metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, uuid.NewString())
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	conn := f.dial(t, grpc.WithChainUnaryInterceptor(
		retry.UnaryClientInterceptor(retry.WithMax(30), retry.WithCodes(codes.Unavailable), retry.WithBackoff(retry.BackoffLinear(5*time.Millisecond))),
		naive,
	))
	const n = 100
	runLogical(t, n, 4, func(ctx context.Context, i int) (*wrapperspb.StringValue, error) {
		resp, err := charge(ctx, conn, i)
		for status.Code(err) == codes.Unavailable && ctx.Err() == nil { // the connection cuts took every retry
			resp, err = charge(ctx, conn, i)
		}
		return resp, err
	})
	bad := f.exactlyOnce(n)
	require.NotEmpty(t, bad, "a new key per retry must show up as double execution")
	require.Greater(t, f.rec.keysPerBody(), 1)
	t.Logf("per-attempt keys: %d of %d logical calls executed more than once", len(bad), n)
}

func TestClientKeySelection(t *testing.T) {
	t.Parallel()
	rec := newKeyRecorder()
	e := newEnv(t, envConfig{interceptors: []grpc.UnaryServerInterceptor{rec.intercept}})
	conn := dial(t, e.addr)
	icpt := idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1))
	call := func(ctx context.Context, method string, opts ...grpc.CallOption) (string, error) {
		var sent string
		err := icpt(ctx, method, wrapperspb.String("x"), &wrapperspb.StringValue{}, conn,
			func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, opts ...grpc.CallOption) error {
				sent = strings.Join(metadata.ValueFromOutgoingContext(ctx, idempotency.MetadataKey), ",")
				return cc.Invoke(ctx, method, req, reply, opts...)
			}, opts...)
		return sent, err
	}
	ctx := context.Background()

	generated, err := call(ctx, methodCharge)
	require.NoError(t, err)
	v, err := uuid.Parse(generated)
	require.NoError(t, err, "generated keys are UUIDs")
	require.EqualValues(t, 7, v.Version(), "generated keys are UUIDv7")
	other, _ := call(ctx, methodCharge)
	require.NotEqual(t, generated, other, "each logical call gets its own key")

	sent, err := call(idempotency.WithOutgoingKey(ctx, "order-42"), methodCharge)
	require.NoError(t, err)
	require.Equal(t, "order-42", sent, "WithOutgoingKey wins over generation")

	sent, err = call(metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, "from-md"), methodCharge)
	require.NoError(t, err)
	require.Equal(t, "from-md", sent, "a key already in metadata wins")

	var captured string
	sent, err = call(ctx, methodRefund, idempotency.CaptureKey(&captured))
	require.NoError(t, err)
	require.Equal(t, sent, captured)

	for name, bad := range map[string]context.Context{
		"WithOutgoingKey too long": idempotency.WithOutgoingKey(ctx, strings.Repeat("k", 256)),
		"WithOutgoingKey empty":    idempotency.WithOutgoingKey(ctx, ""),
		"metadata non-ASCII":       metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, "ключ"),
		"two in metadata":          metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, "a", idempotency.MetadataKey, "b"),
		"conflicting":              idempotency.WithOutgoingKey(metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, "a"), "b"),
	} {
		before := rec.attempts
		_, err := call(bad, methodCharge)
		require.Equal(t, codes.InvalidArgument, status.Code(err), name)
		var br *errdetails.BadRequest
		for _, d := range status.Convert(err).Details() {
			if b, ok := d.(*errdetails.BadRequest); ok {
				br = b
			}
		}
		require.NotNil(t, br, name)
		require.Equal(t, before, rec.attempts, "%s: rejected on the client, nothing sent", name)
	}

	// Methods protobuf marks as safe to repeat get no generated key (an
	// explicit one is still sent); unknown methods follow the option.
	for method, want := range map[string]bool{
		"/idempotency.test.Catalog/Get": false,
		"/idempotency.test.Catalog/Put": false,
		"/idempotency.test.Catalog/Buy": true,
	} {
		sent, _ := call(ctx, method)
		require.Equal(t, want, sent != "", method)
	}
	sent, _ = call(idempotency.WithOutgoingKey(ctx, "explicit"), "/idempotency.test.Catalog/Get")
	require.Equal(t, "explicit", sent)
	noKeys := idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1), idempotency.WithKeysForUnknownMethods(false))
	var sentUnknown []string
	err = noKeys(ctx, methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{}, conn,
		func(ctx context.Context, _ string, _, _ any, _ *grpc.ClientConn, _ ...grpc.CallOption) error {
			sentUnknown = metadata.ValueFromOutgoingContext(ctx, idempotency.MetadataKey)
			return nil
		})
	require.NoError(t, err)
	require.Empty(t, sentUnknown, "WithKeysForUnknownMethods(false) sends no key for unknown methods")
}

// The ready chain waits at least as long as the server's RetryInfo says.
func TestRetryHonoursRetryInfo(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var arrivals []time.Time
	e := newEnv(t, envConfig{
		interceptors: []grpc.UnaryServerInterceptor{func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			mu.Lock()
			arrivals = append(arrivals, time.Now())
			first := len(arrivals) == 1
			mu.Unlock()
			if first {
				st, _ := status.New(codes.Aborted, "busy").WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(300 * time.Millisecond)})
				return nil, st.Err()
			}
			return h(ctx, req)
		}},
	})
	conn, err := grpc.NewClient("passthrough:///"+e.addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor(idempotency.WithRetryBackoff(time.Millisecond, 5*time.Millisecond))))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	_, err = charge(context.Background(), conn, 0)
	require.NoError(t, err)
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, arrivals, 2)
	require.GreaterOrEqual(t, arrivals[1].Sub(arrivals[0]), 300*time.Millisecond, "the server's RetryInfo delay is a lower bound")
}

// The ready chain retries only what something deduplicates: a call without
// a key to an unmarked method is not retried (the response was lost after
// the server ran it; a retry would run it again), while a side-effect-free
// read is, even with the retry interceptor wrongly placed first.
func TestRetriesWithoutKeyOnlyWhenSafe(t *testing.T) {
	t.Parallel()
	f := newFaultyEnv(t, 0, 6)
	noKeys := f.dial(t, grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor(
		idempotency.WithKeysForUnknownMethods(false), idempotency.WithRetryBackoff(time.Millisecond, 10*time.Millisecond))))
	f.proxy.DropNextResponse()
	_, err := charge(context.Background(), noKeys, 0)
	require.Equal(t, codes.Unavailable, status.Code(err), "not retried: %v", err)
	require.EqualValues(t, 1, f.runs.Load(), "the handler ran once, and only once")

	db := testdb.New(t, 4)
	migratedStore(t, db)
	createLedger(t, db)
	srv := grpc.NewServer()
	testingv1.RegisterPolicyServiceServer(srv, &policyServer{db: db})
	p, err := faultproxy.New(serve(t, srv))
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	conn, err := grpc.NewClient("passthrough:///"+p.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(
			retry.UnaryClientInterceptor(retry.WithMax(3), retry.WithCodes(codes.Unavailable)),
			idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1)),
		))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	p.DropNextResponse()
	_, err = testingv1.NewPolicyServiceClient(conn).NoSideEffects(context.Background(), &testingv1.Request{Body: "read"})
	require.NoError(t, err, "a safe read is retried without a key, whatever the chain order")
}

// Both retry styles mark their retries, and the server uses the mark: the
// replay of a call whose first response was lost costs one round trip to
// PostgreSQL and no transaction.
func TestRetryAttemptsReplayInOneRoundTrip(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	var roundTrips atomic.Int64
	pool := schemaPool(t, db.Schema, 4, func(c *pgxpool.Config) {
		c.ConnConfig.Tracer = &testdb.Tracer{OnRoundTrip: func(context.Context, *pgx.Conn, []string) { roundTrips.Add(1) }}
	})
	var attempts atomic.Int64
	var marked atomic.Int64
	loseFirstResponse := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		if len(md.Get("grpc-previous-rpc-attempts"))+len(md.Get(retry.AttemptMetadataKey)) > 0 {
			marked.Add(1)
		}
		resp, err := h(ctx, req)
		if attempts.Add(1)%2 == 1 {
			return nil, status.Error(codes.Unavailable, "response lost") // committed, but the client never hears of it
		}
		return resp, err
	}
	srv := startReplica(t, pool, replicaConfig{interceptors: []grpc.UnaryServerInterceptor{loseFirstResponse}})

	interceptorChain, _ := retryingClient(t, "passthrough:///"+srv.addr, 3)
	native, err := grpc.NewClient("passthrough:///"+srv.addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1))),
		grpc.WithDefaultServiceConfig(`{"methodConfig": [{"name": [{"service": "idempotency.test.Ledger"}],
		  "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.05s", "backoffMultiplier": 2,
		    "retryableStatusCodes": ["UNAVAILABLE"]}}]}`))
	require.NoError(t, err)
	t.Cleanup(func() { _ = native.Close() })

	// The store's first call finds its table (one statement, once per
	// store): warm it, its response lost and retried like the others.
	_, err = charge(context.Background(), interceptorChain, 2)
	require.NoError(t, err)
	for name, conn := range map[string]*grpc.ClientConn{"retry interceptor": interceptorChain, "native retry policy": native} {
		before, markedBefore := roundTrips.Load(), marked.Load()
		resp, err := charge(context.Background(), conn, 1)
		require.NoError(t, err, name)
		require.Contains(t, resp.GetValue(), "#", name)
		require.EqualValues(t, 1, marked.Load()-markedBefore, "%s: the retry arrives marked", name)
		require.EqualValues(t, 3+1, roundTrips.Load()-before, "%s: a fresh call (3 round trips), then its replay (1)", name)
	}
	require.EqualValues(t, 3, srv.execs.Load())
}

// Client defaults that survive what users meet: a slow handler, a
// database failover, a count of attempts, two keys for one call.

// The ready chain puts no deadline of its own on an attempt: a handler
// slower than the old per-attempt timeout (10 s) is never cut, rolled back
// and run again. The handler sees the call's own deadline, or none.
func TestReadyChainLetsASlowHandlerFinish(t *testing.T) {
	t.Parallel()
	type seen struct {
		deadline time.Time
		ok       bool
	}
	deadlines := make(chan seen, 2)
	var e *env
	e = newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		d, ok := ctx.Deadline()
		deadlines <- seen{d, ok}
		return e.insertLedger(ctx, req)
	}})
	conn, err := grpc.NewClient("passthrough:///"+e.addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })

	_, err = charge(context.Background(), conn, 0)
	require.NoError(t, err)
	got := await(t, deadlines, "the handler")
	require.False(t, got.ok, "a call without a deadline reaches the handler without one (was: the chain's 10 s, after which the attempt was cut); it had %v left", time.Until(got.deadline))

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	_, err = charge(ctx, conn, 1)
	require.NoError(t, err)
	got = await(t, deadlines, "the handler")
	require.True(t, got.ok)
	require.Greater(t, time.Until(got.deadline), 5*time.Minute, "the handler has the call's own deadline, not a shorter one of the chain")

	require.Empty(t, e.exactlyOnce(2))
	require.EqualValues(t, 2, e.runs.Load(), "each handler ran once")
}

// With WithPerAttemptTimeout set, an attempt it cuts fails with an error
// that names the option, and the chain's attempts are counted at the
// server: each started the handler, which the cut rolled back.
func TestPerAttemptTimeoutErrorNamesTheOption(t *testing.T) {
	t.Parallel()
	rec := newKeyRecorder()
	e := newEnv(t, envConfig{
		interceptors: []grpc.UnaryServerInterceptor{rec.intercept},
		handler: func(ctx context.Context, _ *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			<-ctx.Done() // slower than any attempt: runs until cut
			return nil, status.FromContextError(ctx.Err()).Err()
		},
	})
	conn, err := grpc.NewClient("passthrough:///"+e.addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor(
			idempotency.WithPerAttemptTimeout(500*time.Millisecond), idempotency.WithMaxAttempts(2),
			idempotency.WithRetryBackoff(time.Millisecond, time.Millisecond))))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })

	_, err = charge(context.Background(), conn, 0)
	require.Equal(t, codes.DeadlineExceeded, status.Code(err), "%v", err)
	require.ErrorIs(t, err, idempotency.ErrAttemptTimeout)
	msg := status.Convert(err).Message()
	require.Contains(t, msg, "WithPerAttemptTimeout", "the error names the option that cut the call")
	require.Contains(t, msg, "gave up after 2 attempts")
	require.Contains(t, msg, "WithMaxAttempts(2)")
	rec.mu.Lock()
	defer rec.mu.Unlock()
	require.Equal(t, 2, rec.attempts, "two attempts reached the server")
	require.Len(t, rec.keys, 1, "both with the call's one key")
	require.Zero(t, e.execs.Load(), "nothing committed")
}

// failoverEnv is a server whose store reaches PostgreSQL through a proxy
// that can refuse every connection: a database failover, made without
// touching the shared database.
type failoverEnv struct {
	db       *testdb.DB
	proxy    *faultproxy.Proxy
	srv      *replica
	arrivals atomic.Int64 // attempts that reached the server
}

func newFailoverEnv(t *testing.T, storeOpts ...idempotency.StoreOption) *failoverEnv {
	t.Helper()
	f := &failoverEnv{db: suiteDB(t)}
	proxy, err := faultproxy.New(pgAddress(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	f.proxy = proxy
	pool := schemaPool(t, f.db.Schema, 2, func(c *pgxpool.Config) {
		host, port, _ := net.SplitHostPort(proxy.Addr())
		p, _ := strconv.ParseUint(port, 10, 16)
		c.ConnConfig.Host, c.ConnConfig.Port = host, uint16(p)
		c.ConnConfig.ConnectTimeout = 2 * time.Second
	})
	arrive := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		f.arrivals.Add(1)
		return h(ctx, req)
	}
	f.srv = startReplica(t, pool, replicaConfig{interceptors: []grpc.UnaryServerInterceptor{arrive}, storeOpts: storeOpts})
	return f
}

// down makes the database unreachable: every connection is cut and every
// new one refused, until up.
func (f *failoverEnv) down() {
	f.proxy.SetRefusing(true)
	f.proxy.CutAll()
}

func (f *failoverEnv) up() { f.proxy.SetRefusing(false) }

func (f *failoverEnv) dial(t *testing.T, chain ...grpc.UnaryClientInterceptor) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+f.srv.addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(chain...))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// answerLog is a client interceptor below the retry interceptor: it keeps
// every attempt's error.
type answerLog struct {
	mu   sync.Mutex
	errs []error
}

func (a *answerLog) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	err := invoker(ctx, method, req, reply, cc, opts...)
	if err != nil {
		a.mu.Lock()
		a.errs = append(a.errs, err)
		a.mu.Unlock()
	}
	return err
}

func (a *answerLog) failed() []error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.errs)
}

// storeUnavailable reports whether err is the layer's STORE_UNAVAILABLE.
func storeUnavailable(err error) bool {
	for _, d := range status.Convert(err).Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok {
			return ei.GetDomain() == idempotency.ErrorDomain && ei.GetReason() == "STORE_UNAVAILABLE"
		}
	}
	return false
}

// The database is down for longer than the old chain retried (6 attempts
// in about 1.6 s): the default chain outlasts it, the call succeeds and is
// executed once, and every STORE_UNAVAILABLE on the way said when to retry.
func TestReadyChainOutlastsADatabaseFailover(t *testing.T) {
	t.Parallel()
	f := newFailoverEnv(t)
	var answers answerLog
	conn := f.dial(t, idempotency.UnaryClientInterceptor(), answers.intercept)
	_, err := charge(context.Background(), conn, 0) // the store finds its table before the outage
	require.NoError(t, err)

	f.down()
	var returned atomic.Bool
	done := make(chan error, 1)
	go func() {
		_, err := charge(context.Background(), conn, 1)
		returned.Store(true)
		done <- err
	}()
	// The outage lasts until the call has failed more attempts than the
	// old chain made before giving up.
	const oldChainAttempts = 6
	require.Eventually(t, func() bool { return len(answers.failed()) > oldChainAttempts || returned.Load() }, liveness, time.Millisecond)
	f.up()
	err = await(t, done, "the call")
	require.NoError(t, err, "the chain outlasted the outage")

	require.Empty(t, (&env{t: t, db: f.db}).exactlyOnce(2))
	require.EqualValues(t, 2, f.srv.execs.Load(), "executions")
	failed := answers.failed()
	require.Greater(t, len(failed), oldChainAttempts)
	for _, err := range failed {
		require.True(t, storeUnavailable(err), "%v", err)
		d, ok := idempotency.RetryDelay(err)
		require.True(t, ok, "STORE_UNAVAILABLE carries RetryInfo: %v", err)
		require.Equal(t, 500*time.Millisecond, d, "the store's WithSuggestedRetryDelay, by default")
	}
	t.Logf("failover: %d attempts failed with STORE_UNAVAILABLE, then the call succeeded; %d attempts reached the server", len(failed), f.arrivals.Load())
}

// What bounds the retries, counted at the server: WithMaxAttempts(n) makes
// n attempts, the first included, as go-grpc-middleware's retry.WithMax(n)
// does in the chain the README shows; the budget, shortened here (its
// default is checked by TestUnitClientDefaults), ends them too. The error
// is the last attempt's, saying how many attempts were made and why no more.
func TestRetryLimitsCountAttemptsAtTheServer(t *testing.T) {
	t.Parallel()
	f := newFailoverEnv(t, idempotency.WithSuggestedRetryDelay(time.Millisecond))
	f.down()
	fast := idempotency.WithRetryBackoff(time.Millisecond, 5*time.Millisecond)
	for _, tc := range []struct {
		name     string
		chain    []grpc.UnaryClientInterceptor
		attempts int64
		says     string
	}{
		{"WithMaxAttempts(3)", []grpc.UnaryClientInterceptor{idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(3), fast)}, 3, "WithMaxAttempts(3)"},
		{"WithMaxAttempts(1)", []grpc.UnaryClientInterceptor{idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1), fast)}, 1, ""},
		{"retry.WithMax(3)", []grpc.UnaryClientInterceptor{
			idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1)),
			retry.UnaryClientInterceptor(retry.WithMax(3), retry.WithCodes(codes.Unavailable, codes.Aborted), retry.WithBackoff(retry.BackoffLinear(time.Millisecond))),
		}, 3, ""},
		{"WithRetryBudget", []grpc.UnaryClientInterceptor{idempotency.UnaryClientInterceptor(idempotency.WithRetryBudget(300*time.Millisecond), fast)}, 0, "the retry budget of 300ms (WithRetryBudget)"},
	} {
		before := f.arrivals.Load()
		_, err := charge(context.Background(), f.dial(t, tc.chain...), 0)
		attempts := f.arrivals.Load() - before
		require.True(t, storeUnavailable(err), "%s: the last attempt's error, details kept: %v", tc.name, err)
		msg := status.Convert(err).Message()
		if tc.attempts > 0 {
			require.Equal(t, tc.attempts, attempts, tc.name)
		} else {
			require.Greater(t, attempts, int64(1), tc.name)
		}
		if tc.says != "" {
			require.Contains(t, msg, fmt.Sprintf("gave up after %d attempts", attempts), "%s: the count the error reports is the server's", tc.name)
			require.Contains(t, msg, tc.says, tc.name)
		}
		t.Logf("%s: %d attempts at the server; %q", tc.name, attempts, msg)
	}
}

// A database outage answers over gRPC and over HTTP with one suggested
// delay: RetryInfo carries the store's WithSuggestedRetryDelay, and HTTP's
// Retry-After the same delay rounded up to whole seconds, at least 1.
func TestStoreUnavailableSuggestsOneDelayOverGRPCAndHTTP(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=2")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	for _, tc := range []struct {
		opts       []idempotency.StoreOption
		retryInfo  time.Duration
		retryAfter string
	}{
		{nil, 500 * time.Millisecond, "1"}, // WithSuggestedRetryDelay's default
		{[]idempotency.StoreOption{idempotency.WithSuggestedRetryDelay(2500 * time.Millisecond)}, 2500 * time.Millisecond, "3"},
	} {
		store, err := idempotency.NewStore(pool, tc.opts...)
		require.NoError(t, err)
		srv := grpc.NewServer(grpc.UnaryInterceptor(idempotency.UnaryServerInterceptor(store)))
		srv.RegisterService(ledgerDesc(), &ledger{handler: func(context.Context, *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			return wrapperspb.String("ran"), nil
		}})
		r := invoke(metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "k"), dial(t, serve(t, srv)), methodCharge, "x")
		require.True(t, storeUnavailable(r.err), "%v", r.err)
		d, ok := idempotency.RetryDelay(r.err)
		require.True(t, ok, "STORE_UNAVAILABLE carries RetryInfo")
		require.Equal(t, tc.retryInfo, d)

		hs := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusCreated) })))
		t.Cleanup(hs.Close)
		req, err := http.NewRequest(http.MethodPost, hs.URL, strings.NewReader("x"))
		require.NoError(t, err)
		req.Header.Set(idempotency.HeaderKey, "k")
		resp, err := hs.Client().Do(req)
		require.NoError(t, err)
		_ = resp.Body.Close()
		require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
		require.Equal(t, tc.retryAfter, resp.Header.Get("Retry-After"))
	}
}

// WithOutgoingKey beside another key in the outgoing metadata, in either
// order: the call fails on the client, saying to set the key one way only;
// nothing is sent.
func TestOutgoingKeyConflictSaysWhatToDo(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	conn, err := grpc.NewClient("passthrough:///"+e.addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ctx := context.Background()
	for name, ctx := range map[string]context.Context{
		"metadata, then WithOutgoingKey": idempotency.WithOutgoingKey(metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, "edge-b"), "edge-a"),
		"WithOutgoingKey, then metadata": metadata.AppendToOutgoingContext(idempotency.WithOutgoingKey(ctx, "edge-a"), idempotency.MetadataKey, "edge-b"),
		"metadata replaced":              metadata.NewOutgoingContext(idempotency.WithOutgoingKey(ctx, "edge-a"), metadata.Pairs(idempotency.MetadataKey, "edge-b")),
	} {
		_, err := charge(ctx, conn, 0)
		require.Equal(t, codes.InvalidArgument, status.Code(err), name)
		require.ErrorIs(t, err, idempotency.ErrInvalidKey, name)
		require.Contains(t, status.Convert(err).Message(), "set it one way only", name)
	}
	require.Zero(t, e.arrived.Load(), "nothing was sent")

	// The same key both ways is one key.
	_, err = charge(idempotency.WithOutgoingKey(metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, "edge-a"), "edge-a"), conn, 0)
	require.NoError(t, err)
}

// README, Server: gRPC's infrastructure services "always pass through,
// keyed or not, and the client interceptor sends them no key"; the binary
// key is refused "on protected methods". The client interceptor refuses a
// binary key, or a text key it finds invalid, in the outgoing metadata of
// every method, health checks included, before looking at the method's
// policy: a health probe or a NO_SIDE_EFFECTS read made from a context
// that carries forwarded metadata (a proxy, a handler passing its incoming
// metadata on) fails on the client with InvalidArgument, where the server
// would answer it, keys ignored.
//
// Correct: calls the server passes through whatever their keys are pass
// the client interceptor too (their keys ignored or stripped).
func TestClientPassesInfrastructureCallsWhateverTheKey(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(store, idempotency.WithKeyRequired())))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	addr := serve(t, srv)
	plain := dial(t, addr)
	keyed := dialWith(t, addr, grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1))))

	for _, pairs := range [][]string{
		{idempotency.MetadataKey + "-bin", "forwarded"},
		{idempotency.MetadataKey, "not a valid key"},
	} {
		ctx := metadata.AppendToOutgoingContext(context.Background(), pairs...)
		_, err := healthpb.NewHealthClient(plain).Check(ctx, &healthpb.HealthCheckRequest{})
		require.NoError(t, err, "the server passes the health check with %v", pairs)
		_, err = healthpb.NewHealthClient(keyed).Check(ctx, &healthpb.HealthCheckRequest{})
		require.NotEqual(t, codes.InvalidArgument, status.Code(err), "the client interceptor refuses a health check carrying %v: %v", pairs, err)
	}
}

// handRolledRetry is a retry interceptor of an application's own: it
// retries Unavailable once. marker, when set, is the metadata it adds to
// the retry (as go-grpc-middleware v1 and its many copies add
// x-retry-attempty); carryKey makes it capture the key of the first attempt
// and send the retry with it.
func handRolledRetry(marker string, carryKey bool) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		var key string
		first := opts
		if carryKey {
			first = append(first, idempotency.CaptureKey(&key))
		}
		err := invoker(ctx, method, req, reply, cc, first...)
		if status.Code(err) != codes.Unavailable {
			return err
		}
		if marker != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, marker, strconv.Itoa(1))
		}
		if carryKey {
			ctx = idempotency.WithOutgoingKey(ctx, key)
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
}

// A retry interceptor chained outside the key interceptor is caught when
// its retries say they are retries: go-grpc-middleware v2's marker and
// v1's (x-retry-attempty). A retry loop that says nothing cannot be told
// from a new call, and gets a new key per attempt (the second charge below);
// such a loop must carry the key itself, with CaptureKey and
// WithOutgoingKey, or run below the key interceptor.
func TestGRPCRetryOutsideTheKeyInterceptor(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name     string
		marker   string
		carryKey bool
		code     codes.Code
		charges  int
	}{
		{"go-grpc-middleware v1 marker", "x-retry-attempty", false, codes.Internal, 1},
		{"no marker", "", false, codes.OK, 2},
		{"no marker, the loop carries the key", "", true, codes.OK, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			f := newFaultyEnv(t, 0, 7)
			conn := f.dial(t, grpc.WithChainUnaryInterceptor(handRolledRetry(c.marker, c.carryKey), idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1))))
			f.proxy.DropNextResponse()
			_, err := charge(context.Background(), conn, 0)
			require.Equal(t, c.code, status.Code(err), "%v", err)
			if c.code == codes.Internal {
				require.ErrorIs(t, err, idempotency.ErrChainOrder)
			}
			require.Equal(t, c.charges, f.ledgerRows(), "charges of the one logical call")
		})
	}
}

// heldNaturalKey serves the annotated test service; its NaturalKey handler
// (key_field meta.request_id) signals entered and waits for release.
type heldNaturalKey struct {
	policyServer
	entered chan struct{}
	release *gate
}

func (s *heldNaturalKey) NaturalKey(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	s.entered <- struct{}{}
	if err := s.release.wait(ctx); err != nil {
		return nil, err
	}
	return s.write(ctx, r)
}

// The ready chain retries a call whose key is in its request (key_field)
// like one whose key is in the metadata: a duplicate that meets the first
// call still running gets KEY_IN_PROGRESS, waits the chain's backoff and
// the server's RetryInfo, and is answered with the first call's result.
func TestGRPCNaturalKeyDuplicateIsRetriedByTheChain(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 8)
	store := migratedStore(t, db, idempotency.WithInProgressWait(10*time.Millisecond), idempotency.WithSuggestedRetryDelay(20*time.Millisecond))
	createLedger(t, db)
	h := &heldNaturalKey{policyServer: policyServer{db: db}, entered: make(chan struct{}, 8), release: newGate()}
	srv := grpc.NewServer(grpc.UnaryInterceptor(idempotency.UnaryServerInterceptor(store)))
	testingv1.RegisterPolicyServiceServer(srv, h)
	conn, log := retryingClient(t, "passthrough:///"+serve(t, srv), 50)
	client := testingv1.NewPolicyServiceClient(conn)

	req := &testingv1.Request{Body: "natural", Meta: &testingv1.Meta{RequestId: "nk-1"}}
	type answer struct {
		resp     *testingv1.Response
		err      error
		replayed bool
	}
	answers := make([]answer, 2)
	var wg sync.WaitGroup
	call := func(i int) {
		var tr metadata.MD
		resp, err := client.NaturalKey(context.Background(), req, grpc.Trailer(&tr))
		answers[i] = answer{resp, err, len(tr.Get(idempotency.ReplayedTrailer)) > 0}
	}
	wg.Go(func() { call(0) })
	await(t, h.entered, "the first call's handler")
	wg.Go(func() { call(1) })
	require.Eventually(t, func() bool {
		log.mu.Lock()
		defer log.mu.Unlock()
		return log.codes[codes.Aborted] > 0
	}, liveness, time.Millisecond, "the duplicate meets the running call")
	time.Sleep(100 * time.Millisecond) // a few retries of the duplicate while the first runs
	h.release.open()
	wg.Wait()

	for i, a := range answers {
		require.NoError(t, a.err, "call %d", i)
	}
	require.Equal(t, answers[0].resp.GetLedgerId(), answers[1].resp.GetLedgerId())
	require.False(t, answers[0].replayed)
	require.True(t, answers[1].replayed, "the duplicate is answered from the store")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))
	log.requireOnlyFailures(t, codes.Aborted)
}

// failingServerConn serves the ledger's Charge with fail(n), n the attempt
// (from 1), and counts the attempts.
func failingServerConn(t *testing.T, fail func(n int64) error, opts ...idempotency.ClientOption) (*grpc.ClientConn, *atomic.Int64) {
	t.Helper()
	var n atomic.Int64
	srv := grpc.NewServer()
	srv.RegisterService(ledgerDesc(), &ledger{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		if err := fail(n.Add(1)); err != nil {
			return nil, err
		}
		return wrapperspb.String("ok"), nil
	}})
	addr := serve(t, srv)
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor(opts...)))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn, &n
}

func withRetryInfo(c codes.Code, reason string, d time.Duration) error {
	st, err := status.New(c, "try later").WithDetails(
		&errdetails.ErrorInfo{Reason: reason, Domain: "idempotency"},
		&errdetails.RetryInfo{RetryDelay: durationpb.New(d)})
	if err != nil {
		panic(err)
	}
	return st.Err()
}

// A RetryInfo longer than what is left of the budget, or of the call's
// deadline, ends the retries at once: one attempt, the server's code and
// details kept, the message naming the limit. KEY_IN_PROGRESS with a short
// RetryInfo is retried until the key is free.
func TestRetryInfoAgainstBudgetAndDeadline(t *testing.T) {
	t.Parallel()
	unavailable := func(int64) error {
		return withRetryInfo(codes.Unavailable, "STORE_UNAVAILABLE", 10*time.Second)
	}

	conn, n := failingServerConn(t, unavailable, idempotency.WithRetryBudget(time.Second))
	err := conn.Invoke(context.Background(), methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{})
	require.Equal(t, codes.Unavailable, status.Code(err))
	require.EqualValues(t, 1, n.Load())
	require.Contains(t, err.Error(), "WithRetryBudget")
	d, ok := idempotency.RetryDelay(err)
	require.True(t, ok)
	require.Equal(t, 10*time.Second, d, "the server's RetryInfo is kept")

	conn, n = failingServerConn(t, unavailable)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	err = conn.Invoke(ctx, methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{})
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	require.EqualValues(t, 1, n.Load())
	require.Contains(t, err.Error(), "deadline")

	conn, n = failingServerConn(t, func(n int64) error {
		if n < 4 {
			return withRetryInfo(codes.Aborted, "KEY_IN_PROGRESS", 20*time.Millisecond)
		}
		return nil
	}, idempotency.WithRetryBackoff(time.Millisecond, 2*time.Millisecond))
	require.NoError(t, conn.Invoke(context.Background(), methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{}))
	require.EqualValues(t, 4, n.Load())

	// WithMaxAttempts(2) against a budget that would allow more.
	conn, n = failingServerConn(t, func(int64) error {
		return withRetryInfo(codes.Unavailable, "STORE_UNAVAILABLE", time.Millisecond)
	},
		idempotency.WithMaxAttempts(2), idempotency.WithRetryBackoff(time.Millisecond, time.Millisecond))
	err = conn.Invoke(context.Background(), methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{})
	require.Equal(t, codes.Unavailable, status.Code(err))
	require.EqualValues(t, 2, n.Load())
	require.Contains(t, err.Error(), "WithMaxAttempts(2)")
}
