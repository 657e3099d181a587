package idempotency_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// keyLog records the idempotency key of every call a server receives.
type keyLog struct {
	mu   sync.Mutex
	keys []string
}

func (l *keyLog) add(k string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.keys = append(l.keys, k)
}

func (l *keyLog) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.keys...)
}

func (l *keyLog) intercept(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	l.add(strings.Join(md.Get(idempotency.MetadataKey), ","))
	return h(ctx, req)
}

// dialKeyed is a client connection to addr through interceptors.
func dialKeyed(t *testing.T, addr string, interceptors ...grpc.UnaryClientInterceptor) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithChainUnaryInterceptor(interceptors...))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// requireDerived checks that keys are valid, distinct, derived, and reveal
// none of secrets.
func requireDerived(t *testing.T, keys []string, secrets ...string) {
	t.Helper()
	seen := map[string]bool{}
	for _, k := range keys {
		require.NoError(t, idempotency.ValidateKey(k), k)
		require.True(t, strings.HasPrefix(k, "dk2-"), "a derived key: %q", k)
		require.False(t, seen[k], "keys of different downstream calls differ: %q twice", k)
		seen[k] = true
		for _, s := range secrets {
			require.NotContains(t, k, s, "a derived key does not reveal the parent's key or scope")
		}
	}
}

// A handler that calls another gRPC service through the client interceptor,
// naming each effect, runs twice for one key: its first run fails in a way
// that releases the key, after its downstream calls succeeded. The re-run
// must send the same downstream keys, so the downstream service executes
// each of its calls once, not twice.
func TestDownstreamCallsOfARerunSendTheSameKeys(t *testing.T) {
	t.Parallel()
	var innerKeys keyLog
	inner := newEnv(t, envConfig{interceptors: []grpc.UnaryServerInterceptor{innerKeys.intercept}})
	innerConn := dialKeyed(t, inner.addr, idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1)))

	var runs atomic.Int64
	outer := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		var out []string
		for _, c := range []struct{ method, body string }{
			{methodCharge, req.GetValue() + "/a"}, {methodCharge, req.GetValue() + "/b"}, {methodRefund, req.GetValue() + "/r"},
		} {
			resp := &wrapperspb.StringValue{}
			if err := innerConn.Invoke(idempotency.WithEffect(ctx, c.method+" "+c.body), c.method, wrapperspb.String(c.body), resp); err != nil {
				return nil, err
			}
			out = append(out, resp.GetValue())
		}
		if runs.Add(1) == 1 {
			return nil, status.Error(codes.Unavailable, "the first run fails after its downstream calls")
		}
		return wrapperspb.String(strings.Join(out, " ")), nil
	}})

	const key = "outer-key-7f3a"
	first := outer.call(context.Background(), methodCharge, key, "order-1")
	require.Equal(t, codes.Unavailable, status.Code(first.err), "the first run's error releases the key")
	second := outer.call(context.Background(), methodCharge, key, "order-1")
	require.NoError(t, second.err)

	keys := innerKeys.all()
	require.Len(t, keys, 6, "each run makes three downstream calls")
	require.Equal(t, keys[:3], keys[3:], "the re-run sends the first run's downstream keys, in order")
	requireDerived(t, keys[:3], key)
	require.EqualValues(t, 3, inner.execs.Load(), "the downstream service executed each call once; the re-run's calls were replays")
	require.Equal(t, 3, inner.ledgerRows())
	require.EqualValues(t, 2, runs.Load())

	// Another key of the outer call derives other downstream keys.
	require.NoError(t, outer.call(context.Background(), methodCharge, "outer-key-other", "order-1").err)
	other := innerKeys.all()[6:]
	require.Len(t, other, 3)
	for _, k := range other {
		require.NotContains(t, keys, k)
	}
}

// Outside a running call the client interceptor generates keys as before;
// inside one, an explicit key (WithOutgoingKey or the metadata) wins over
// the name of the effect.
func TestDownstreamExplicitKeysWin(t *testing.T) {
	t.Parallel()
	var innerKeys keyLog
	inner := newEnv(t, envConfig{interceptors: []grpc.UnaryServerInterceptor{innerKeys.intercept}})
	innerConn := dialKeyed(t, inner.addr, idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1)))
	call := func(ctx context.Context, body string) error {
		return innerConn.Invoke(ctx, methodCharge, wrapperspb.String(body), &wrapperspb.StringValue{})
	}

	outer := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		named := idempotency.WithEffect(ctx, "charge")
		if err := call(idempotency.WithOutgoingKey(named, "chosen-by-handler"), "explicit"); err != nil {
			return nil, err
		}
		if err := call(metadata.AppendToOutgoingContext(named, idempotency.MetadataKey, "in-metadata"), "metadata"); err != nil {
			return nil, err
		}
		return req, call(named, "derived")
	}})
	require.NoError(t, outer.call(context.Background(), methodCharge, "outer-1", "x").err)
	require.NoError(t, call(context.Background(), "outside"))

	keys := innerKeys.all()
	require.Len(t, keys, 4)
	require.Equal(t, "chosen-by-handler", keys[0])
	require.Equal(t, "in-metadata", keys[1])
	requireDerived(t, keys[2:3], "outer-1")
	require.False(t, strings.HasPrefix(keys[3], "dk2-"), "outside a running call the key is generated: %q", keys[3])
	require.NoError(t, idempotency.ValidateKey(keys[3]))
}

// CountedKey depends on the scope, the key, the target and the ordinal,
// and on nothing else: the same inputs on another run give the same key.
func TestCountedKeyDependsOnScopeKeyTargetAndOrdinal(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	store := migratedStore(t, db)
	ctx := context.Background()
	_, ok := idempotency.CountedKey(ctx, "x")
	require.False(t, ok, "no running call, no derived key")

	derive := func(scope, key string) []string {
		var got []string
		_, err := store.Execute(ctx, idempotency.Call{Scope: scope, Key: key, Method: "m"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
			for _, target := range []string{"a", "b", "a"} {
				k, ok := idempotency.CountedKey(ctx, target)
				require.True(t, ok)
				got = append(got, k)
			}
			return nil, errors.New("release the key so the next Execute runs again")
		})
		require.Error(t, err)
		return got
	}
	first := derive("tenant-1", "k")
	requireDerived(t, first, "tenant-1")
	require.Equal(t, first, derive("tenant-1", "k"), "a re-run derives the same keys")
	// A message with the same scope and ID is another operation than the
	// call: its downstream keys differ too.
	var fromMessage []string
	_, err := store.ProcessMessage(ctx, idempotency.Message{Scope: "tenant-1", ID: "k"}, func(ctx context.Context, _ pgx.Tx) error {
		for _, target := range []string{"a", "b", "a"} {
			k, _ := idempotency.CountedKey(ctx, target)
			fromMessage = append(fromMessage, k)
		}
		return nil
	})
	require.NoError(t, err)
	for _, other := range [][]string{derive("tenant-2", "k"), derive("tenant-1", "k2"), fromMessage} {
		for i := range other {
			require.NotEqual(t, first[i], other[i])
		}
	}
}

// provider is an HTTP service that honours Idempotency-Key with this
// package's middleware and counts what it executed.
type provider struct {
	url     string
	execs   atomic.Int64
	headers keyLog
}

func startProvider(t *testing.T) *provider {
	t.Helper()
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	createLedger(t, db)
	p := &provider{}
	protected := idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var id int64
		if err := idempotency.MustTxFromContext(r.Context()).QueryRow(r.Context(), `INSERT INTO ledger (note) VALUES ($1) RETURNING id`, string(body)).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		p.execs.Add(1)
		_, _ = io.WriteString(w, string(body))
	}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.headers.add(r.Method + " " + r.Header.Get(idempotency.HeaderKey))
		if r.Method == http.MethodGet {
			_, _ = io.WriteString(w, "read")
			return
		}
		protected.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	p.url = srv.URL
	return p
}

// post sends body to path through client, returning the status.
func post(ctx context.Context, client *http.Client, method, url, body string) (int, error) {
	req, err := http.NewRequestWithContext(ctx, method, url, strings.NewReader(body))
	if err != nil {
		return 0, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, nil
}

// A call that charges a provider over HTTP through HTTPTransport, naming
// each effect, and then fails in a way that releases its key: its re-run
// sends the same Idempotency-Key headers, and the provider executes each
// request once. The GET, unnamed, is sent without a key.
func TestHTTPTransportRerunSendsTheSameKeys(t *testing.T) {
	t.Parallel()
	p := startProvider(t)
	db := testdb.New(t, 2)
	store := migratedStore(t, db)
	client := &http.Client{Transport: &idempotency.HTTPTransport{}}
	ctx := context.Background()

	run := func() error {
		_, err := store.Execute(ctx, idempotency.Call{Scope: "shop", Key: "order-9", Method: "Checkout"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
			for _, c := range []struct{ method, path, body string }{
				{"POST", "/v1/charges", "charge 1"}, {"POST", "/v1/charges", "charge 2"}, {"PATCH", "/v1/orders/9", "ship"}, {"GET", "/v1/orders/9", ""},
			} {
				effect := ctx
				if c.method != http.MethodGet {
					effect = idempotency.WithEffect(ctx, c.method+" "+c.path+" "+c.body)
				}
				code, err := post(effect, client, c.method, p.url+c.path, c.body)
				if err != nil || code != http.StatusOK {
					return nil, status.Errorf(codes.Unavailable, "%s %s: %d %v", c.method, c.path, code, err)
				}
			}
			return nil, status.Error(codes.Unavailable, "fail after the provider answered, releasing the key")
		})
		return err
	}
	require.Equal(t, codes.Unavailable, status.Code(run()))
	require.Equal(t, codes.Unavailable, status.Code(run()))

	h := p.headers.all()
	require.Len(t, h, 8)
	require.Equal(t, h[:4], h[4:], "the re-run sends the first run's keys")
	require.Equal(t, "GET ", h[3], "a GET gets no key")
	var keys []string
	for _, v := range h[:3] {
		keys = append(keys, strings.TrimPrefix(strings.TrimPrefix(v, "POST "), "PATCH "))
	}
	requireDerived(t, keys, "order-9", "shop")
	require.EqualValues(t, 3, p.execs.Load(), "the provider executed each request once")
}

// A request that is redirected (307, 308: the method and body are kept)
// reaches the provider with the key of the request the call made: a
// re-run that is not redirected, because the move has finished, sends the
// provider the same keys.
func TestHTTPTransportRedirectKeepsTheKey(t *testing.T) {
	t.Parallel()
	p := startProvider(t)
	old := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, p.url+r.URL.Path, http.StatusTemporaryRedirect)
	}))
	t.Cleanup(old.Close)
	db := testdb.New(t, 2)
	store := migratedStore(t, db)
	client := &http.Client{Transport: &idempotency.HTTPTransport{}}

	run := func(base string) error {
		_, err := store.Execute(context.Background(), idempotency.Call{Scope: "shop", Key: "order-10", Method: "Checkout"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
			for _, body := range []string{"charge 1", "charge 2"} {
				code, err := post(idempotency.WithEffect(ctx, body), client, "POST", base+"/v1/charges", body)
				if err != nil || code != http.StatusOK {
					return nil, status.Errorf(codes.Unavailable, "%s: %d %v", body, code, err)
				}
			}
			return nil, status.Error(codes.Unavailable, "fail after the provider answered, releasing the key")
		})
		return err
	}
	require.Equal(t, codes.Unavailable, status.Code(run(old.URL)), "through the old address, redirected")
	require.Equal(t, codes.Unavailable, status.Code(run(p.url)), "straight to the provider")

	h := p.headers.all()
	require.Len(t, h, 4)
	require.Equal(t, h[:2], h[2:], "the re-run sends the provider the first run's keys")
	require.NotEqual(t, h[0], h[1])
	require.EqualValues(t, 2, p.execs.Load(), "the provider executed each charge once")
}

// HTTPTransport outside a running call sends no key unless one is chosen,
// keeps a key the request carries, and refuses an invalid chosen key
// without sending anything.
func TestHTTPTransportExplicitKeys(t *testing.T) {
	t.Parallel()
	p := startProvider(t)
	client := &http.Client{Transport: &idempotency.HTTPTransport{}}
	ctx := context.Background()

	code, err := post(ctx, client, "POST", p.url+"/v1/charges", "no key")
	require.NoError(t, err)
	require.Equal(t, http.StatusBadRequest, code, "the provider requires a key, and none is invented outside a running call")

	chosen, err := http.NewRequestWithContext(idempotency.WithOutgoingKey(ctx, "chosen-1"), "POST", p.url+"/v1/charges", strings.NewReader("chosen"))
	require.NoError(t, err)
	resp, err := client.Do(chosen)
	require.NoError(t, err)
	_ = resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Empty(t, chosen.Header.Get(idempotency.HeaderKey), "the transport sends a copy; the caller's request is not modified")

	req, err := http.NewRequestWithContext(idempotency.WithOutgoingKey(ctx, "not-this"), "POST", p.url+"/v1/charges", strings.NewReader("own header"))
	require.NoError(t, err)
	req.Header.Set(idempotency.HeaderKey, "own-1")
	resp, err = client.Do(req)
	require.NoError(t, err)
	_ = resp.Body.Close()

	_, err = post(idempotency.WithOutgoingKey(ctx, "bad key"), client, "POST", p.url+"/v1/charges", "invalid")
	require.ErrorIs(t, err, idempotency.ErrInvalidKey)

	require.Equal(t, []string{"POST ", "POST chosen-1", "POST own-1"}, p.headers.all(), "the invalid key sent nothing")
	require.EqualValues(t, 2, p.execs.Load())
}

// roundTripFunc is an http.RoundTripper made of a function.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// A request built by hand, without a Header map, gets its key like any
// other (RoundTrip is called directly by wrapping transports).
func TestHTTPTransportRequestWithoutHeaderMap(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, testdb.New(t, 2))
	var sent string
	tr := &idempotency.HTTPTransport{Base: roundTripFunc(func(r *http.Request) (*http.Response, error) {
		sent = r.Header.Get(idempotency.HeaderKey)
		return &http.Response{StatusCode: http.StatusOK, Body: http.NoBody, Request: r}, nil
	})}
	_, err := store.Execute(context.Background(), idempotency.Call{Key: "k-1", Method: "m"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		u, _ := url.Parse("http://provider.invalid/v1/charges")
		req := (&http.Request{Method: http.MethodPost, URL: u}).WithContext(idempotency.WithEffect(ctx, "charge"))
		resp, err := tr.RoundTrip(req)
		if err == nil {
			_ = resp.Body.Close()
		}
		return nil, err
	})
	require.NoError(t, err)
	requireDerived(t, []string{sent}, "k-1")
}
