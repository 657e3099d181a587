package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
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

// What derived keys are made of: the operation (store, scope, key with its
// transport, method, request), and for each downstream effect its name or
// its target and ordinal. Two operations under one client key never share
// downstream keys; a re-run of one operation always sends the same.

// errRelease fails a call so that its key is released and the next
// Execute runs it again.
var errRelease = errors.New("release the key so the next Execute runs again")

// derivedKeys runs one call on store, releases its key, and returns the
// keys its handler derived: counted ones for targets "a", "b", "a", then
// the effect "charge".
func derivedKeys(t *testing.T, store *idempotency.Store, call idempotency.Call) []string {
	t.Helper()
	var got []string
	_, err := store.Execute(context.Background(), call, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		for _, target := range []string{"a", "b", "a"} {
			k, ok := idempotency.CountedKey(ctx, target)
			require.True(t, ok)
			got = append(got, k)
		}
		k, ok := idempotency.EffectKey(ctx, "charge")
		require.True(t, ok)
		got = append(got, k)
		return nil, errRelease
	})
	require.ErrorIs(t, err, errRelease)
	return got
}

// requireAllDiffer asserts that no key of a is one of b's.
func requireAllDiffer(t *testing.T, a, b []string, what string) {
	t.Helper()
	for _, k := range a {
		require.NotContains(t, b, k, "%s: derives other keys", what)
	}
}

// Two stores (two services) that receive the same client key
// for the same method and request send a shared provider different keys;
// so do two methods of one store, and a corrected request, after a release,
// while a re-run of the same request sends the same keys.
func TestTwoOperationsUnderOneClientKeyDeriveDifferentKeys(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	orders := migratedStore(t, db, idempotency.WithTable("", "order_keys"))
	billing := migratedStore(t, db, idempotency.WithTable("", "billing_keys"))
	eu := migratedStore(t, db, idempotency.WithTable("", "order_keys"), idempotency.WithDerivedKeyNamespace("eu"))
	call := idempotency.Call{Scope: "merchant-1", Key: "order-1001", Method: "/shop.v1.Orders/Pay", Fingerprint: []byte("amount=250")}

	first := derivedKeys(t, orders, call)
	requireDerived(t, first, "merchant-1", "order-1001")
	for _, k := range first {
		require.Len(t, k, 44, "within Square's limit of 45 characters: %q", k)
	}
	require.Equal(t, first, derivedKeys(t, orders, call), "a re-run of the same operation sends the same keys")

	otherMethod, corrected := call, call
	otherMethod.Method = "/shop.v1.Orders/Refund"
	corrected.Fingerprint = []byte("amount=200")
	for what, keys := range map[string][]string{
		"another store's table":                derivedKeys(t, billing, call),
		"another namespace on one table":       derivedKeys(t, eu, call),
		"another method, after a release":      derivedKeys(t, orders, otherMethod),
		"a corrected request, after a release": derivedKeys(t, orders, corrected),
	} {
		requireAllDiffer(t, first, keys, what)
	}
}

// Named effects do not count: the same name gives the same key however
// many goroutines ask, in whatever order, beside counted calls made only
// on some runs.
func TestEffectKeysDoNotDependOnOrderOrConcurrency(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	store := migratedStore(t, db)
	call := idempotency.Call{Scope: "s", Key: "k", Method: "m"}
	run := func(extraCalls int) map[string]string {
		keys := map[string]string{}
		var mu sync.Mutex
		_, err := store.Execute(context.Background(), call, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
			for range extraCalls { // a conditional call, counted: it shifts nothing named
				idempotency.CountedKey(ctx, "POST /v1/charges")
			}
			var wg sync.WaitGroup
			for i := range 16 {
				wg.Go(func() {
					name := fmt.Sprintf("charge item-%d", i%4)
					k, ok := idempotency.EffectKey(ctx, name)
					require.True(t, ok)
					mu.Lock()
					defer mu.Unlock()
					if prev, seen := keys[name]; seen {
						require.Equal(t, prev, k, "one name, one key")
					}
					keys[name] = k
				})
			}
			wg.Wait()
			return nil, errRelease
		})
		require.ErrorIs(t, err, errRelease)
		return keys
	}
	first := run(0)
	require.Len(t, first, 4)
	require.Equal(t, first, run(3), "a re-run that makes other calls first sends the same named keys")
}

// WithDerivedKeyVersion(1) derives the keys of the releases before
// version 2, for the deploy that upgrades: a call that ran under the old
// release and runs again under the new one sends the keys it sent. The
// values are those of the first derivation, pinned (computed
// independently of this package's code).
func TestDerivedKeyVersion1KeepsTheFirstReleasesKeys(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	store := migratedStore(t, db, idempotency.WithDerivedKeyVersion(1))
	call := idempotency.Call{Scope: "s", Key: "k", Method: "m"}
	keys := derivedKeys(t, store, call)
	require.Equal(t, []string{
		"dk1-bjhXX6jtz1stDhBmgbdSYt0c1B6GAV-18t4mcts0w5Y",
		"dk1-SCpROsNjgpX3bi674x9mkAXKJp6IjFAOs3uV2XSUW1w",
		"dk1-ieqHiHV3HCw773JT2TQ7L_F-L6-EelDbBi5IrXNcIxI",
	}, keys[:3])
	call.Method, call.Fingerprint = "another", []byte("another")
	again := derivedKeys(t, store, call)
	require.Equal(t, keys[:3], again[:3], "version 1 knew neither method nor request")
	require.True(t, strings.HasPrefix(keys[3], "dk2-"), "named effects, new with version 2, derive version 2 keys: %q", keys[3])
	require.NotEqual(t, keys[3], again[3])

	for _, v := range []int{0, 4} {
		_, err := idempotency.NewStore(db.Pool, idempotency.WithDerivedKeyVersion(v))
		require.ErrorContains(t, err, "WithDerivedKeyVersion")
	}
	_, err := idempotency.NewStore(db.Pool, idempotency.WithDerivedKeyNamespace("\xff"))
	require.ErrorContains(t, err, "WithDerivedKeyNamespace")
}

// A deploy between a call's crash and its re-run: the new build knows a
// field of the request that the old one held as unknown. The request's
// digest ignores the schema, so the re-run derives the keys the first run
// sent; a corrected request derives others.
func TestDerivedKeysSurviveASchemaDeploy(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	oldSchema := paySchema(t, "proto3", []payField{{name: "amount", number: 1, kind: descriptorpb.FieldDescriptorProto_TYPE_INT64}}, false)
	newSchema := paySchema(t, "proto3", []payField{
		{name: "amount", number: 1, kind: descriptorpb.FieldDescriptorProto_TYPE_INT64},
		{name: "note", number: 2, kind: descriptorpb.FieldDescriptorProto_TYPE_STRING},
	}, false)
	var mu sync.Mutex
	var sent []string
	release := func(md protoreflect.MessageDescriptor) *grpc.ClientConn {
		return servePay(t, store, md, func(ctx context.Context, _ proto.Message) (any, error) {
			k, ok := idempotency.EffectKey(ctx, "charge")
			require.True(t, ok)
			mu.Lock()
			sent = append(sent, k)
			mu.Unlock()
			return nil, status.Error(codes.Unavailable, "the process dies before its commit")
		})
	}
	// Fields out of number order, as another language's client may send
	// them.
	body := varintField(bytesField(nil, 2, []byte("gift")), 1, 500)
	corrected := varintField(bytesField(nil, 2, []byte("gift")), 1, 400)
	for _, conn := range []*grpc.ClientConn{release(oldSchema), release(newSchema), release(newSchema)} {
		b := body
		if len(sent) == 2 {
			b = corrected
		}
		r := sendRaw(conn, "order-7", b)
		require.Equal(t, codes.Unavailable, status.Code(r.err), "%v", r.err)
	}
	require.Len(t, sent, 3)
	require.Equal(t, sent[0], sent[1], "the build that knows the field derives what the build that did not sent")
	require.NotEqual(t, sent[0], sent[2], "a corrected request is another operation downstream")
}

// A handler that retries its own downstream gRPC call (after an error that
// says nothing was done, or a lost answer), and makes one downstream call
// only on some runs: the calls named with WithEffect keep their keys, so
// the re-run's calls are replays and the downstream service executes each
// effect once. The call made with the handler's context after the handler
// returned is refused with ErrCallEnded; nothing reaches the service.
func TestNamedDownstreamGRPCCallsKeepTheirKeys(t *testing.T) {
	t.Parallel()
	var innerKeys keyLog
	inner := newEnv(t, envConfig{interceptors: []grpc.UnaryServerInterceptor{innerKeys.intercept}})
	innerConn := dialKeyed(t, inner.addr, idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1)))
	invoke := func(ctx context.Context, body string) error {
		return innerConn.Invoke(ctx, methodCharge, wrapperspb.String(body), &wrapperspb.StringValue{})
	}
	var runs atomic.Int64
	kept := make(chan context.Context, 1)
	outer := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		run := runs.Add(1)
		if run == 1 {
			// Only on the first run: an effect of its own.
			if err := invoke(idempotency.WithEffect(ctx, "audit"), "audit"); err != nil {
				return nil, err
			}
		}
		charge := idempotency.WithEffect(ctx, "charge "+req.GetValue())
		for range 2 { // the handler's own retry of the same effect
			if err := invoke(charge, "charge"); err != nil {
				return nil, err
			}
		}
		if run == 1 {
			select {
			case kept <- ctx:
			default:
			}
			return nil, status.Error(codes.Unavailable, "the first run fails after its downstream calls")
		}
		return req, nil
	}})
	require.Equal(t, codes.Unavailable, status.Code(outer.call(context.Background(), methodCharge, "outer-9", "order-9").err))
	require.NoError(t, outer.call(context.Background(), methodCharge, "outer-9", "order-9").err)

	keys := innerKeys.all()
	require.Len(t, keys, 5, "audit, charge twice; then charge twice")
	require.Equal(t, []string{keys[1], keys[1], keys[1], keys[1]}, keys[1:], "one named effect, one key, on both runs")
	require.EqualValues(t, 2, inner.execs.Load(), "the audit and one charge")

	ended := <-kept
	err := invoke(ended, "after the call")
	require.ErrorIs(t, err, idempotency.ErrCallEnded)
	require.Len(t, innerKeys.all(), 5, "nothing was sent")
	_, ok := idempotency.CountedKey(ended, "x")
	require.False(t, ok, "no key from a call that has ended")
	_, ok = idempotency.EffectKey(ended, "x")
	require.False(t, ok)
}

// Under WithDerivedKeyVersion(1), counted keys are the first release's;
// named effects, which it did not have, derive version 2 keys, so a
// counted call to the target "effect charge" and the effect named
// "charge" never share a key. (It failed when a name was a version 1
// target "effect " + name.)
func TestVersion1EffectKeysDoNotCollideWithCountedKeys(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	for _, version := range []int{2, 1} {
		store := migratedStore(t, db, idempotency.WithDerivedKeyVersion(version))
		var named, counted string
		_, err := store.Execute(context.Background(), idempotency.Call{Scope: "s", Key: "k", Method: "m"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
			named, _ = idempotency.EffectKey(ctx, "charge")
			counted, _ = idempotency.CountedKey(ctx, "effect charge")
			return nil, errRelease
		})
		require.ErrorIs(t, err, errRelease)
		require.NotEqual(t, named, counted, "version %d: the effect \"charge\" and the first call to the target \"effect charge\" are two effects", version)
	}
}

// chargeClient is one way a handler charges a provider: start runs the
// provider and returns its address, send (one new request to the
// provider at addr, reporting whether the connection was refused), and
// what reached the provider and what it charged.
type chargeClient struct {
	name  string
	start func(t *testing.T) (addr string, send func(ctx context.Context, addr string) (refused bool, err error), arrived, charged func() int64)
}

// chargeClients are the clients of this package that send a key: an
// http.Client over HTTPTransport, HTTPClient, and the gRPC client chain.
var chargeClients = []chargeClient{
	{"HTTPTransport", func(t *testing.T) (string, func(context.Context, string) (bool, error), func() int64, func() int64) {
		return httpCharges(t, (&http.Client{Transport: &idempotency.HTTPTransport{}}).Do)
	}},
	{"HTTPClient", func(t *testing.T) (string, func(context.Context, string) (bool, error), func() int64, func() int64) {
		return httpCharges(t, (&idempotency.HTTPClient{MaxAttempts: 2, BackoffBase: time.Millisecond, BackoffMax: 10 * time.Millisecond}).Do)
	}},
	{"UnaryClientInterceptor", func(t *testing.T) (string, func(context.Context, string) (bool, error), func() int64, func() int64) {
		inner := newEnv(t, envConfig{})
		chain := idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(2), idempotency.WithRetryBackoff(time.Millisecond, 10*time.Millisecond))
		conns := map[string]*grpc.ClientConn{}
		send := func(ctx context.Context, addr string) (bool, error) {
			if conns[addr] == nil {
				conns[addr] = dialKeyed(t, addr, chain)
			}
			err := conns[addr].Invoke(ctx, methodCharge, wrapperspb.String("charge order-14"), &wrapperspb.StringValue{})
			return status.Code(err) == codes.Unavailable && strings.Contains(status.Convert(err).Message(), "connection refused"), err
		}
		return inner.addr, send, inner.arrived.Load, inner.execs.Load
	}},
}

// httpCharges is a provider behind HTTPMiddleware, charged through do.
func httpCharges(t *testing.T, do func(*http.Request) (*http.Response, error)) (string, func(context.Context, string) (bool, error), func() int64, func() int64) {
	p := startProvider(t)
	send := func(ctx context.Context, addr string) (bool, error) {
		resp, err := do(newPost(t, ctx, "http://"+addr+"/v1/charges", "charge order-14"))
		if err != nil {
			return errors.Is(err, syscall.ECONNREFUSED), err
		}
		if body := readAll(resp); resp.StatusCode != http.StatusOK {
			return false, fmt.Errorf("provider: %s %q", resp.Status, body)
		}
		return false, nil
	}
	arrived := func() int64 { return int64(len(p.headers.all())) }
	return strings.TrimPrefix(p.url, "http://"), send, arrived, p.execs.Load
}

// A handler charges a provider it knows at two addresses. On its first run
// the first address refuses the connection (nothing was sent), so the
// handler sends a new request to the second, which charges; then the run
// fails, releasing its key. The re-run starts with the address that
// answered. Unnamed, the charge gets no key inside the call: it is
// refused, nothing sent, with an error saying how to name it (a counted
// key gave the handler's second request the next ordinal, and the
// re-run's first request the first: two charges). Named, it keeps one key
// across the handler's own retry and the re-run: one charge.
func TestHandlerRetryingAnEffectWithANewRequest(t *testing.T) {
	t.Parallel()
	for _, c := range chargeClients {
		for _, named := range []bool{false, true} {
			name := c.name + "/unnamed"
			if named {
				name = c.name + "/named"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				addr, send, arrived, charged := c.start(t)
				refused := closedAddr(t)
				store := migratedStore(t, testdb.New(t, 2))
				call := idempotency.Call{Scope: "shop", Key: "order-14", Method: "Checkout"}

				answered := "" // the address that answered last: the handler tries it first
				var runs int
				run := func() error {
					_, err := store.Execute(context.Background(), call, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
						runs++
						if named {
							ctx = idempotency.WithEffect(ctx, "charge order-14")
						}
						addrs := []string{refused, addr}
						if answered != "" {
							addrs = []string{answered, refused}
						}
						for _, a := range addrs {
							wasRefused, err := send(ctx, a)
							if wasRefused {
								continue // the next address, with a new request
							}
							if err != nil {
								return nil, err
							}
							answered = a
							if runs == 1 {
								return nil, status.Error(codes.Unavailable, "fail after the provider charged, releasing the key")
							}
							return wrapperspb.String("charged"), nil
						}
						return nil, status.Error(codes.Unavailable, "no address answered")
					})
					return err
				}
				first, second := run(), run()

				if !named {
					require.Zero(t, charged(), "the provider charged nothing")
					require.Zero(t, arrived(), "nothing was sent")
					for _, err := range []error{first, second} {
						require.ErrorIs(t, err, idempotency.ErrUnnamedEffect)
						require.Equal(t, codes.Internal, status.Code(err), "a configuration error: %v", err)
						require.Contains(t, err.Error(), "WithEffect", "the error says how to name the effect")
					}
					return
				}
				require.Equal(t, codes.Unavailable, status.Code(first), "the first run fails after the provider charged: %v", first)
				require.NoError(t, second)
				require.EqualValues(t, 2, arrived(), "each run's charge reached the provider once")
				require.EqualValues(t, 1, charged(), "the provider charged once: the re-run sent the first run's key")
			})
		}
	}
}

// catalogDesc serves idempotency.test.Catalog (see harness_test.go: Get is
// NO_SIDE_EFFECTS, Put IDEMPOTENT, Buy unmarked), echoing the request.
func catalogDesc() *grpc.ServiceDesc {
	method := func(name string) grpc.MethodDesc {
		return grpc.MethodDesc{MethodName: name, Handler: func(_ any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
			req := &wrapperspb.StringValue{}
			if err := dec(req); err != nil {
				return nil, err
			}
			info := &grpc.UnaryServerInfo{FullMethod: "/idempotency.test.Catalog/" + name}
			return icpt(ctx, req, info, func(_ context.Context, req any) (any, error) { return req, nil })
		}}
	}
	return &grpc.ServiceDesc{
		ServiceName: "idempotency.test.Catalog",
		HandlerType: (*any)(nil),
		Methods:     []grpc.MethodDesc{method("Get"), method("Put"), method("Buy")},
	}
}

// Inside a running call, every outgoing call that needs a key and has
// neither a key nor a name is refused, nothing sent, whatever the client
// and however it is sent again; calls that need no key (GET, PUT, DELETE;
// a method protobuf marks NO_SIDE_EFFECTS or IDEMPOTENT) are sent without
// one, and a named call with its effect's key.
func TestOutgoingCallsInsideACallNeedANameOrAKey(t *testing.T) {
	t.Parallel()
	var httpKeys keyLog
	httpSrv := h2cServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		httpKeys.add(r.Header.Get(idempotency.HeaderKey))
	}), 0)
	var grpcKeys keyLog
	srv := grpc.NewServer(grpc.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		return grpcKeys.intercept(ctx, req, nil, h)
	}))
	srv.RegisterService(catalogDesc(), nil)
	srv.RegisterService(ledgerDesc(), &ledger{handler: func(_ context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) { return req, nil }})
	addr := serve(t, srv)
	conn := dialKeyed(t, addr, idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1)))
	noUnknownKeys := dialKeyed(t, addr, idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1), idempotency.WithKeysForUnknownMethods(false)))
	store := migratedStore(t, testdb.New(t, 2))

	transport := (&http.Client{Transport: &idempotency.HTTPTransport{}}).Do
	resent := (&http.Client{Transport: &resending{base: &idempotency.HTTPTransport{}, max: 3}}).Do
	client := fastRetries(nil).Do
	httpCall := func(do func(*http.Request) (*http.Response, error), method string) func(context.Context) error {
		return func(ctx context.Context) error {
			req, err := http.NewRequestWithContext(ctx, method, httpSrv.URL+"/v1/items", strings.NewReader("x"))
			require.NoError(t, err)
			resp, err := do(req)
			if err == nil {
				_ = readAll(resp)
			}
			return err
		}
	}
	grpcCall := func(conn *grpc.ClientConn, method string) func(context.Context) error {
		return func(ctx context.Context) error {
			return conn.Invoke(ctx, method, wrapperspb.String("x"), &wrapperspb.StringValue{})
		}
	}
	const (
		refused = "refused"
		noKey   = "sent without a key"
		named   = "sent with the effect's key"
	)
	for _, c := range []struct {
		name  string
		send  func(context.Context) error
		named bool
		want  string
		hint  string // in the refusal's message, beside WithEffect
	}{
		{"HTTPTransport POST", httpCall(transport, http.MethodPost), false, refused, "HTTPClient"},
		{"HTTPTransport PATCH", httpCall(transport, http.MethodPatch), false, refused, "HTTPClient"},
		{"HTTPTransport POST resent by a transport above", httpCall(resent, http.MethodPost), false, refused, "HTTPClient"},
		{"HTTPClient POST", httpCall(client, http.MethodPost), false, refused, "HTTPClient"},
		{"HTTPClient PATCH", httpCall(client, http.MethodPatch), false, refused, "HTTPClient"},
		{"HTTPTransport GET", httpCall(transport, http.MethodGet), false, noKey, ""},
		{"HTTPTransport PUT", httpCall(transport, http.MethodPut), false, noKey, ""},
		{"HTTPClient DELETE", httpCall(client, http.MethodDelete), false, noKey, ""},
		{"HTTPTransport POST named", httpCall(transport, http.MethodPost), true, named, ""},
		{"HTTPClient POST named", httpCall(client, http.MethodPost), true, named, ""},
		{"gRPC unmarked method", grpcCall(conn, "/idempotency.test.Catalog/Buy"), false, refused, "NO_SIDE_EFFECTS"},
		{"gRPC method not linked in", grpcCall(conn, methodCharge), false, refused, "WithKeysForUnknownMethods"},
		{"gRPC NO_SIDE_EFFECTS method", grpcCall(conn, "/idempotency.test.Catalog/Get"), false, noKey, ""},
		{"gRPC IDEMPOTENT method", grpcCall(conn, "/idempotency.test.Catalog/Put"), false, noKey, ""},
		{"gRPC method not linked in, WithKeysForUnknownMethods(false)", grpcCall(noUnknownKeys, methodCharge), false, noKey, ""},
		{"gRPC unmarked method named", grpcCall(conn, "/idempotency.test.Catalog/Buy"), true, named, ""},
	} {
		httpBefore, grpcBefore := len(httpKeys.all()), len(grpcKeys.all())
		var effect string
		_, err := store.Execute(context.Background(), idempotency.Call{Key: "order-15", Method: "Checkout"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
			if c.named {
				effect, _ = idempotency.EffectKey(ctx, "charge")
				ctx = idempotency.WithEffect(ctx, "charge")
			}
			if err := c.send(ctx); err != nil {
				return nil, err
			}
			return nil, status.Error(codes.Unavailable, "release the key, for the next case")
		})
		arrived := append(httpKeys.all()[httpBefore:], grpcKeys.all()[grpcBefore:]...)
		switch c.want {
		case refused:
			require.ErrorIs(t, err, idempotency.ErrUnnamedEffect, c.name)
			require.Equal(t, codes.Internal, status.Code(err), c.name)
			require.ErrorContains(t, err, "WithEffect", c.name)
			require.ErrorContains(t, err, c.hint, c.name)
			require.Empty(t, arrived, "%s: nothing was sent", c.name)
		case noKey:
			require.Equal(t, codes.Unavailable, status.Code(err), "%s: %v", c.name, err)
			require.Equal(t, []string{""}, arrived, "%s: sent once, without a key", c.name)
		case named:
			require.Equal(t, codes.Unavailable, status.Code(err), "%s: %v", c.name, err)
			requireDerived(t, []string{effect}, "order-15")
			require.Equal(t, []string{effect}, arrived, "%s: sent once, with the effect's key", c.name)
		}
	}
}

// A request sent from a goroutine the handler left behind, redirected
// (307) after the handler returned: http.Client makes the next hop a new
// request with the ended call's context, and HTTPTransport refuses it with
// ErrCallEnded, nothing sent. (It failed when the redirect's key was
// looked up first.)
func TestHTTPTransportRefusesARedirectHopAfterTheCallEnded(t *testing.T) {
	t.Parallel()
	p := startProvider(t)
	arrived, release := make(chan struct{}), newGate()
	old := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(arrived)
		_ = release.wait(r.Context())
		http.Redirect(w, r, p.url+r.URL.Path, http.StatusTemporaryRedirect)
	}))
	t.Cleanup(old.Close)
	t.Cleanup(release.open)
	store := migratedStore(t, testdb.New(t, 2))
	client := &http.Client{Transport: &idempotency.HTTPTransport{}}
	done := make(chan error, 1)
	_, err := store.Execute(context.Background(), idempotency.Call{Key: "order-4", Method: "m"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		go func() {
			_, err := post(idempotency.WithEffect(ctx, "charge"), client, http.MethodPost, old.URL+"/v1/charges", "charge")
			done <- err
		}()
		<-arrived // the request went out while the call ran
		return nil, nil
	})
	require.NoError(t, err)
	release.open() // the call has ended: now the old address redirects
	err = await(t, done, "the goroutine's request")
	require.Empty(t, p.headers.all(), "the hop made after the call ended was sent")
	require.ErrorIs(t, err, idempotency.ErrCallEnded)
}

// 16 goroutines derive keys and send requests with the handler's context
// while it returns: no race, no panic; once Execute has returned, every
// derivation says false and every request is refused with ErrCallEnded,
// nothing sent.
func TestDerivingWhileTheHandlerReturns(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, testdb.New(t, 2))
	var sentAfter atomic.Int64
	var ended atomic.Bool
	tr := &idempotency.HTTPTransport{Base: roundTripFunc(func(r *http.Request) (*http.Response, error) {
		if ended.Load() {
			sentAfter.Add(1)
		}
		return &http.Response{StatusCode: http.StatusOK, Body: http.NoBody, Request: r}, nil
	})}
	hc := &idempotency.HTTPClient{Client: &http.Client{Transport: tr}}
	for round := range 20 {
		var wg sync.WaitGroup
		stop := make(chan struct{})
		var afterEnd atomic.Int64 // derivations started after Execute returned that got a key
		ended.Store(false)
		_, err := store.Execute(context.Background(), idempotency.Call{Key: fmt.Sprintf("k-%d", round), Method: "m"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
			for i := range 16 {
				wg.Go(func() {
					for n := 0; ; n++ {
						select {
						case <-stop:
							return
						default:
						}
						after := ended.Load()
						_, ok1 := idempotency.EffectKey(ctx, fmt.Sprint("e", i))
						_, ok2 := idempotency.CountedKey(ctx, "t")
						req, _ := http.NewRequestWithContext(idempotency.WithEffect(ctx, "x"), http.MethodPost, "http://p.invalid/v1", strings.NewReader("b"))
						var err error
						if i%2 == 0 {
							_, err = tr.RoundTrip(req)
						} else {
							var resp *http.Response
							if resp, err = hc.Do(req); err == nil {
								_ = resp.Body.Close()
							}
						}
						if after && (ok1 || ok2 || !errors.Is(err, idempotency.ErrCallEnded)) {
							afterEnd.Add(1)
						}
					}
				})
			}
			time.Sleep(time.Millisecond)
			return nil, nil
		})
		ended.Store(true)
		require.NoError(t, err)
		time.Sleep(2 * time.Millisecond)
		close(stop)
		wg.Wait()
		require.Zero(t, afterEnd.Load(), "nothing derived or sent once the call has ended")
	}
	// A request whose key was taken before the end may still reach Base
	// after it (it was made while the call ran): sentAfter only counts them.
	t.Logf("requests that reached Base after Execute returned, made before: %d", sentAfter.Load())
}

// Derived keys of HTTP requests and messages: the same request derives
// the same keys, another query or body others; all 44 printable
// characters, valid keys.
func TestHTTPAndMessageDerivedKeys(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	var keys keyLog
	h := idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		k, _ := idempotency.EffectKey(r.Context(), "charge")
		keys.add(k)
		http.Error(w, "down", http.StatusServiceUnavailable) // releases the key
	}))
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	send := func(path, body string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+path, strings.NewReader(body))
		req.Header.Set(idempotency.HeaderKey, `"order-1"`)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		_ = readAll(resp)
	}
	send("/v1/charges?a=1", "x")
	send("/v1/charges?a=1", "x")
	send("/v1/charges?a=2", "x")
	send("/v1/charges?a=1", "y")
	msg := func(body string) {
		_, err := store.ProcessMessage(context.Background(), idempotency.Message{ID: "order-1", Body: []byte(body)}, func(ctx context.Context, _ pgx.Tx) error {
			k, _ := idempotency.EffectKey(ctx, "charge")
			keys.add(k)
			return errRelease
		})
		require.ErrorIs(t, err, errRelease)
	}
	msg("x")
	msg("x")
	msg("y")
	k := keys.all()
	require.Len(t, k, 7)
	require.Equal(t, k[0], k[1])
	require.Equal(t, k[4], k[5])
	requireDerived(t, []string{k[0], k[2], k[3], k[4], k[6]}, "order-1")
	for _, key := range k {
		require.Len(t, key, 44)
	}
}
