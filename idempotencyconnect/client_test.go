package idempotencyconnect_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencyconnect"
	"github.com/exactlyonce/idempotency/internal/faultproxy"
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// keysSeen records the Idempotency-Key of every request that reaches h.
func keysSeen(h http.Handler) (http.Handler, func() []string) {
	var mu sync.Mutex
	var keys []string
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			keys = append(keys, r.Header.Get(idempotency.HeaderKey))
			mu.Unlock()
			h.ServeHTTP(w, r)
		}), func() []string {
			mu.Lock()
			defer mu.Unlock()
			return append([]string(nil), keys...)
		}
}

// The handler fails twice with Unavailable (the ledger is busy, its
// transaction rolled back): the client interceptor retries the call with
// the key of its first attempt, in each protocol, and the third attempt
// executes it. Three attempts, one key, one effect.
func TestRetriesKeepTheCallsKey(t *testing.T) {
	t.Parallel()
	for _, p := range protocols {
		t.Run(p.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			var fails atomic.Int64
			e.handle = func(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
				if fails.Add(1) <= 2 {
					return nil, connect.NewError(connect.CodeUnavailable, errors.New("the ledger is busy"))
				}
				return ledger(ctx, req)
			}
			h, keys := keysSeen(e.mux)
			url := serve(t, h)
			c := client(t, url, procRequired, p, false, idempotency.WithRetryBackoff(time.Millisecond, 5*time.Millisecond))
			req := connect.NewRequest(&testingv1.Request{Body: "9"})
			resp, err := c.CallUnary(context.Background(), req)
			require.NoError(t, err)
			require.Positive(t, resp.Msg.GetLedgerId())
			seen := keys()
			require.Len(t, seen, 3, "three attempts")
			require.NotEmpty(t, seen[0])
			require.Equal(t, []string{seen[0], seen[0], seen[0]}, seen, "one key for every attempt")
			require.Equal(t, seen[0], idempotencyconnect.KeyOf(req), "KeyOf gives the call's key")
			require.Equal(t, 1, e.ledgerRows())
		})
	}
}

// WithMaxAttempts counts attempts as the gRPC chain and go-grpc-middleware
// do, the first included; the error of the last attempt says why no other
// followed, with its code and details.
func TestMaxAttemptsCountsAttempts(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.handle = func(context.Context, *testingv1.Request) (*testingv1.Response, error) {
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("down for good"))
	}
	h, keys := keysSeen(e.mux)
	url := serve(t, h)
	_, err := client(t, url, procRequired, protocols[0], false, idempotency.WithMaxAttempts(3), idempotency.WithRetryBackoff(time.Millisecond, time.Millisecond)).
		CallUnary(context.Background(), connect.NewRequest(&testingv1.Request{Body: "1"}))
	require.Equal(t, connect.CodeUnavailable, connectCode(err))
	require.ErrorContains(t, err, "down for good")
	require.ErrorContains(t, err, "gave up after 3 attempts")
	require.ErrorContains(t, err, "WithMaxAttempts(3)")
	require.Len(t, keys(), 3)
}

// An application's own retry of a call whose answer it never got: the
// key it captured (KeyOf) given to WithOutgoingKey makes it the same call,
// answered from the store.
func TestAnApplicationRetryWithTheCapturedKeyIsAReplay(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c := client(t, e.url, procRequired, protocols[0], false)
	ctx := context.Background()
	req := connect.NewRequest(&testingv1.Request{Body: "3"})
	first, err := c.CallUnary(ctx, req)
	require.NoError(t, err)
	again, err := c.CallUnary(idempotency.WithOutgoingKey(ctx, idempotencyconnect.KeyOf(req)), connect.NewRequest(&testingv1.Request{Body: "3"}))
	require.NoError(t, err)
	require.Equal(t, first.Msg.GetLedgerId(), again.Msg.GetLedgerId())
	require.Equal(t, "true", again.Trailer().Get(idempotency.ReplayedTrailer))
	require.Equal(t, 1, e.ledgerRows())

	h := connect.NewRequest(&testingv1.Request{Body: "3"})
	h.Header().Set(idempotency.HeaderKey, "edge-b")
	_, err = c.CallUnary(idempotency.WithOutgoingKey(ctx, "edge-a"), h)
	require.Equal(t, connect.CodeInvalidArgument, connectCode(err), "two keys for one call")
	require.ErrorContains(t, err, "set it one way only")
}

// A handler's downstream connect call, through the client interceptor,
// carries the key of the effect it names, derived from the call the
// handler runs: when the handler
// fails after the downstream call and runs again (the client retried it),
// the downstream call is sent with the same key, and the downstream
// service answers it from its store. Two upstream runs, one downstream
// effect.
func TestDownstreamCallsOfARerunSendTheSameKey(t *testing.T) {
	t.Parallel()
	down := newEnv(t)
	dh, downKeys := keysSeen(down.mux)
	downURL := serve(t, dh)
	downstream := client(t, downURL, procRequired, protocols[0], false)

	up := newEnv(t)
	var runs atomic.Int64
	up.handle = func(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
		resp, err := downstream.CallUnary(idempotency.WithEffect(ctx, "charge"), connect.NewRequest(&testingv1.Request{Body: "provider " + req.GetBody()}))
		if err != nil {
			return nil, err
		}
		if runs.Add(1) == 1 {
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("lost the answer of the provider's charge"))
		}
		return &testingv1.Response{Body: resp.Msg.GetBody(), LedgerId: resp.Msg.GetLedgerId()}, nil
	}
	resp, err := client(t, up.url, procRequired, protocols[1], false, idempotency.WithRetryBackoff(time.Millisecond, 5*time.Millisecond)).
		CallUnary(context.Background(), connect.NewRequest(&testingv1.Request{Body: "12"}))
	require.NoError(t, err)
	keys := downKeys()
	require.Len(t, keys, 2, "the downstream call made by each run")
	require.True(t, strings.HasPrefix(keys[0], "dk2-"), "a derived key: %s", keys[0])
	require.Equal(t, keys[0], keys[1], "the re-run sends the same downstream key")
	require.Equal(t, 1, down.ledgerRows(), "the provider charged once")
	require.Equal(t, int64(1), resp.Msg.GetLedgerId())
	require.EqualValues(t, 2, runs.Load())
}

// The database behind the handler's store goes away (every connection
// cut, new ones refused) while a call is made: the server answers
// Unavailable with RetryInfo (STORE_UNAVAILABLE), never Unknown or
// Internal; the client interceptor retries with the call's key until the
// database is back, and the call executes once.
func TestADatabaseOutageIsOutlastedByTheClient(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	proxy, err := faultproxy.New(pgAddress(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	pool := schemaPool(t, db, proxy.Addr())
	store, err := idempotency.NewStore(pool)
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, store.Migrate(ctx))
	_, err = pool.Exec(ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, body text NOT NULL)`)
	require.NoError(t, err)
	mux := handlers(t, store, ledger)
	var (
		mu    sync.Mutex
		codes []connect.Code
		delay []time.Duration
	)
	url := serve(t, mux)
	observe := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			resp, err := next(ctx, req)
			mu.Lock()
			codes = append(codes, connectCode(err))
			if d, ok := idempotencyconnect.RetryDelay(err); ok {
				delay = append(delay, d)
			}
			mu.Unlock()
			return resp, err
		}
	})
	ic, err := idempotencyconnect.NewClientInterceptor(idempotency.WithRetryBackoff(10*time.Millisecond, 100*time.Millisecond))
	require.NoError(t, err)
	c := connect.NewClient[testingv1.Request, testingv1.Response](httpClient(t, false), url+procRequired, connect.WithProtoJSON(),
		connect.WithInterceptors(ic, observe))

	proxy.SetRefusing(true)
	proxy.CutAll()
	done := make(chan error, 1)
	var resp *connect.Response[testingv1.Response]
	go func() {
		var err error
		resp, err = c.CallUnary(ctx, connect.NewRequest(&testingv1.Request{Body: "outage"}))
		done <- err
	}()
	waitFor(t, "three attempts refused", func() bool { mu.Lock(); defer mu.Unlock(); return len(codes) >= 3 })
	proxy.SetRefusing(false)
	require.NoError(t, <-done)
	require.Positive(t, resp.Msg.GetLedgerId())
	mu.Lock()
	defer mu.Unlock()
	for _, c := range codes[:len(codes)-1] {
		require.Equal(t, connect.CodeUnavailable, c, "every failed attempt says a retry can help")
	}
	require.Equal(t, connect.Code(0), codes[len(codes)-1])
	require.Len(t, delay, len(codes)-1, "every Unavailable carries RetryInfo")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`), "executed once")
}

// pgAddress is the host:port of the test database.
func pgAddress(t testing.TB) string {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	require.NoError(t, err)
	return net.JoinHostPort(cfg.ConnConfig.Host, fmt.Sprint(cfg.ConnConfig.Port))
}

// A MODE_DISABLED method failing with Unavailable: nothing deduplicates a
// retry, so the client makes one attempt; a NO_SIDE_EFFECTS one is
// retried.
func TestClientRetriesOnlyWhatIsSafe(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		if runs.Add(1) <= 2 {
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("busy"))
		}
		return connect.NewResponse(&testingv1.Response{Body: "ok"}), nil
	}
	url := mount(t, e.store, fn, nil, nil, nil)
	opts := []idempotency.ClientOption{idempotency.WithRetryBackoff(time.Millisecond, time.Millisecond)}
	_, err := client(t, url, "/idempotency.testing.v1.PolicyService/Disabled", protocols[0], false, opts...).CallUnary(context.Background(), connect.NewRequest(&testingv1.Request{Body: "d"}))
	require.Equal(t, connect.CodeUnavailable, connectCode(err))
	require.EqualValues(t, 1, runs.Load(), "one attempt of a call nothing deduplicates")
	_, err = client(t, url, procNoSideEffects, protocols[0], false, opts...).CallUnary(context.Background(), connect.NewRequest(&testingv1.Request{Body: "n"}))
	require.NoError(t, err)
	require.EqualValues(t, 3, runs.Load(), "a safe call retried")
}

// loseFirstAnswer is a transport that delivers the first request and loses
// its answer (the connection broke after the server committed).
type loseFirstAnswer struct {
	base http.RoundTripper
	n    atomic.Int64
}

func (l *loseFirstAnswer) RoundTrip(r *http.Request) (*http.Response, error) {
	res, err := l.base.RoundTrip(r)
	if err == nil && l.n.Add(1) == 1 {
		_ = res.Body.Close()
		return nil, errors.New("connection reset by peer")
	}
	return res, err
}

// An application's own retry loop around a client whose interceptor makes
// one attempt (WithMaxAttempts(1)): the loop sends the same request again
// after the answer was lost, and the key the interceptor put on it the
// first time makes the second attempt a replay. So does a new request
// with the key captured (KeyOf) given to WithOutgoingKey, and one with the
// key as a header beside the same WithOutgoingKey.
func TestApplicationRetryLoopOutsideTheInterceptorIsAReplay(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := mount(t, e.store, ledgerFn(&runs), nil, nil, nil)
	ic, err := idempotencyconnect.NewClientInterceptor(idempotency.WithMaxAttempts(1))
	require.NoError(t, err)
	tr := &loseFirstAnswer{base: httpClient(t, false).Transport}
	c := connect.NewClient[testingv1.Request, testingv1.Response](&http.Client{Transport: tr}, url+procRequired, connect.WithInterceptors(ic))
	ctx := context.Background()
	req := connect.NewRequest(&testingv1.Request{Body: "loop"})
	var resp *connect.Response[testingv1.Response]
	for range 3 {
		if resp, err = c.CallUnary(ctx, req); err == nil {
			break
		}
	}
	require.NoError(t, err)
	require.Equal(t, "true", resp.Trailer().Get(idempotency.ReplayedTrailer), "the loop's second send is a replay")
	key := idempotencyconnect.KeyOf(req)
	again, err := c.CallUnary(idempotency.WithOutgoingKey(ctx, key), connect.NewRequest(&testingv1.Request{Body: "loop"}))
	require.NoError(t, err)
	require.Equal(t, resp.Msg.GetLedgerId(), again.Msg.GetLedgerId())
	both := keyed(key, "loop")
	third, err := c.CallUnary(idempotency.WithOutgoingKey(ctx, key), both)
	require.NoError(t, err, "the same key both ways is one key")
	require.Equal(t, resp.Msg.GetLedgerId(), third.Msg.GetLedgerId())
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, e.ledgerRows())

	bin := connect.NewRequest(&testingv1.Request{Body: "bin"})
	bin.Header().Set("Idempotency-Key-Bin", connect.EncodeBinaryHeader([]byte("k")))
	_, err = c.CallUnary(ctx, bin)
	require.Equal(t, connect.CodeInvalidArgument, connectCode(err), "the binary key refused by the client: %v", err)
	require.EqualValues(t, 1, runs.Load())
}

// An application sets the key header in the map in gRPC's lower case (as
// HTTP/2 sends it), through the client interceptor: the call is sent with
// that one key, and executes.
func TestLowerCaseKeyHeaderThroughTheClientIsTheOneKeySent(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	h, keys := keysSeen(e.mux)
	url := serve(t, h)
	req := connect.NewRequest(&testingv1.Request{Body: "lc"})
	req.Header()["idempotency-key"] = []string{"r32-lower"}
	resp, err := client(t, url, procRequired, protocols[0], false).CallUnary(context.Background(), req)
	require.NoError(t, err, "one key, set once")
	require.Positive(t, resp.Msg.GetLedgerId())
	require.Equal(t, []string{"r32-lower"}, keys())
	require.Equal(t, 1, e.ledgerRows())
}

// The caller cancels its call while the client interceptor waits before a
// retry (the first attempt answered Unavailable). The caller asked to stop:
// the call ends with Canceled, as grpc-go's (idempotency.UnaryClientInterceptor)
// ends it, not with the attempt's Unavailable, which tells the caller to
// retry a call it gave up.
func TestCancelledDuringTheBackoffEndsWithCanceled(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := mount(t, e.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("busy"))
	}, nil, nil, nil)
	backoff := idempotency.WithRetryBackoff(20*time.Second, 20*time.Second)

	// connect-go, the idempotency client interceptor outermost.
	answered := make(chan struct{}, 1)
	inner := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			resp, err := next(ctx, req)
			answered <- struct{}{}
			return resp, err
		}
	})
	ic, err := idempotencyconnect.NewClientInterceptor(backoff)
	require.NoError(t, err)
	c := connect.NewClient[testingv1.Request, testingv1.Response](httpClient(t, false), url+procRequired, connect.WithInterceptors(ic, inner))
	ctx, cancel := context.WithCancel(context.Background())
	go func() { <-answered; cancel() }()
	_, err = c.CallUnary(ctx, connect.NewRequest(&testingv1.Request{Body: "c"}))
	connectErr := err

	// grpc-go, the library's chain, against the same handler.
	answered2 := make(chan struct{}, 1)
	gc := grpcClient(t, url, idempotency.UnaryClientInterceptor(backoff), func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		answered2 <- struct{}{}
		return err
	})
	ctx2, cancel2 := context.WithCancel(context.Background())
	go func() { <-answered2; cancel2() }()
	_, err = gc.Required(ctx2, &testingv1.Request{Body: "g"})
	require.Equal(t, codes.Canceled, status.Code(err), "grpc-go's chain: %v", err)

	require.Equal(t, connect.CodeCanceled, connectCode(connectErr), "connect's interceptor: %v", connectErr)
	_, hasDelay := idempotencyconnect.RetryDelay(connectErr)
	require.False(t, hasDelay, "no RetryInfo on a call the caller cancelled")
	require.EqualValues(t, 2, runs.Load(), "one attempt each")
}

// The server asks for a wait longer than the retry budget (RetryInfo of
// 10 s, budget 1 s), and a call's deadline is shorter than the backoff:
// one attempt each, the handler's code and RetryInfo kept, the message
// saying why no retry followed.
func TestNoRetryPastTheBudgetOrTheDeadline(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := mount(t, e.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		ce := connect.NewError(connect.CodeUnavailable, errors.New("maintenance"))
		d, err := connect.NewErrorDetail(&errdetails.RetryInfo{RetryDelay: durationpb.New(10 * time.Second)})
		require.NoError(t, err)
		ce.AddDetail(d)
		return nil, ce
	}, nil, nil, nil)
	c := client(t, url, procRequired, protocols[1], false, idempotency.WithRetryBudget(time.Second))
	_, err := c.CallUnary(context.Background(), connect.NewRequest(&testingv1.Request{Body: "a"}))
	require.Equal(t, connect.CodeUnavailable, connectCode(err))
	d, ok := idempotencyconnect.RetryDelay(err)
	require.True(t, ok)
	require.Equal(t, 10*time.Second, d)
	require.Contains(t, err.Error(), "WithRetryBudget")
	require.EqualValues(t, 1, runs.Load())

	c = client(t, url, procRequired, protocols[2], false, idempotency.WithRetryBackoff(5*time.Second, 5*time.Second))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err = c.CallUnary(ctx, connect.NewRequest(&testingv1.Request{Body: "b"}))
	require.Equal(t, connect.CodeUnavailable, connectCode(err))
	require.Contains(t, err.Error(), "deadline")
	require.EqualValues(t, 2, runs.Load())
}
