package idempotency_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
)

// routeRecorder keeps the traced method of every call.
type routeRecorder struct {
	mu      sync.Mutex
	methods map[string]int
}

func (rr *routeRecorder) tracer() idempotency.Tracer {
	return endTracer(func(_ context.Context, data idempotency.TraceCallEndData) {
		rr.mu.Lock()
		defer rr.mu.Unlock()
		if rr.methods == nil {
			rr.methods = map[string]int{}
		}
		rr.methods[data.Method]++
	})
}

func (rr *routeRecorder) seen() map[string]int {
	rr.mu.Lock()
	defer rr.mu.Unlock()
	return rr.methods
}

// postWithKey sends a POST with a key and a body to h, as a server would
// hand it over.
func postWithKey(h http.Handler, target, key string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(http.MethodPost, target, strings.NewReader(`{"amount":100}`))
	req.Header.Set(idempotency.HeaderKey, key)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req)
	return w
}

// ordersMux is the API the route tests send requests to: refunds under an
// order, a collection whose pattern ends in a slash, and a GET route.
func ordersMux(handled *int) *http.ServeMux {
	mux := http.NewServeMux()
	created := func(w http.ResponseWriter, r *http.Request) {
		*handled++
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "refund of order "+r.PathValue("id"))
	}
	mux.HandleFunc("POST /v1/orders/{id}/refunds", created)
	mux.HandleFunc("POST /v1/carts/", created)
	mux.HandleFunc("GET /v1/orders/{id}", func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "order") })
	mux.HandleFunc("/v1/legacy", created) // any method
	return mux
}

// It failed when the middleware wrapped a ServeMux (HTTPMiddleware(store)(mux),
// as the README mounts it): it ran before the mux matched, r.Pattern was
// empty, and each path was a traced method of its own ("POST
// /v1/orders/20/refunds": 1,000 paths, 1,000 labels and span names). The
// traced method is the pattern the mux will match.
func TestHTTPTracedMethodIsTheRouteNotThePath(t *testing.T) {
	t.Parallel()
	var rr routeRecorder
	store := migratedStore(t, suiteDB(t), idempotency.WithTracer(rr.tracer()))
	var handled int
	h := idempotency.HTTPMiddleware(store)(ordersMux(&handled))
	for i := range 1000 {
		w := postWithKey(h, fmt.Sprintf("/v1/orders/%d/refunds", i), fmt.Sprintf("k-%d", i))
		require.Equal(t, http.StatusCreated, w.Code, w.Body.String())
	}
	require.Equal(t, http.StatusCreated, postWithKey(h, "/v1/legacy", "k-legacy").Code)
	require.Equal(t, map[string]int{"POST /v1/orders/{id}/refunds": 1000, "POST /v1/legacy": 1}, rr.seen())

	// A router the middleware cannot ask, without WithHTTPRoute: the
	// method alone, never the path.
	var rr2 routeRecorder
	store2 := migratedStore(t, suiteDB(t), idempotency.WithTracer(rr2.tracer()))
	opaque := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { ordersMux(&handled).ServeHTTP(w, r) })
	for i := range 20 {
		require.Equal(t, http.StatusCreated, postWithKey(idempotency.HTTPMiddleware(store2)(opaque), fmt.Sprintf("/v1/orders/%d/refunds", i), fmt.Sprintf("k-%d", i)).Code)
	}
	require.Equal(t, map[string]int{"POST": 20}, rr2.seen())

	// The same router with WithHTTPRoute: its route.
	var rr3 routeRecorder
	store3 := migratedStore(t, suiteDB(t), idempotency.WithTracer(rr3.tracer()))
	routed := idempotency.HTTPMiddleware(store3, idempotency.WithHTTPRoute(func(r *http.Request) string {
		if strings.HasPrefix(r.URL.Path, "/v1/orders/") {
			return "/v1/orders/{id}/refunds"
		}
		return ""
	}))(opaque)
	for i := range 20 {
		require.Equal(t, http.StatusCreated, postWithKey(routed, fmt.Sprintf("/v1/orders/%d/refunds", i), fmt.Sprintf("k-%d", i)).Code)
	}
	require.Equal(t, map[string]int{"POST /v1/orders/{id}/refunds": 20}, rr3.seen())
}

// It failed when every POST was a call, routed or not: a request no route
// matched had its 404 (or 405) stored under its key for a day, a key row
// per request anyone could send; and a path the mux redirects to its
// canonical form had the redirect stored, so the client that followed it
// with the same key got 422. Such requests pass through: the mux answers
// them, nothing is claimed, stored or traced.
func TestHTTPUnroutedRequestsClaimNoKey(t *testing.T) {
	t.Parallel()
	var rr routeRecorder
	db := suiteDB(t)
	store := migratedStore(t, db, idempotency.WithTracer(rr.tracer()))
	var handled int
	h := idempotency.HTTPMiddleware(store)(ordersMux(&handled))
	keyRows := func() int { return db.Count(t, `SELECT count(*) FROM idempotency_keys`) }

	for i := range 100 {
		w := postWithKey(h, fmt.Sprintf("/wp-admin/%d.php", i), fmt.Sprintf("k-%d", i))
		require.Equal(t, http.StatusNotFound, w.Code)
	}
	require.Equal(t, http.StatusMethodNotAllowed, postWithKey(h, "/v1/orders/7", "k-get-only").Code)
	require.Zero(t, keyRows(), "a key row for a request no route matched")

	w := postWithKey(h, "/v1/orders/7/./refunds", "k-redirect")
	require.Equal(t, http.StatusTemporaryRedirect, w.Code)
	require.Equal(t, "/v1/orders/7/refunds", w.Header().Get("Location"))
	w = postWithKey(h, "/v1/carts", "k-slash")
	require.Equal(t, http.StatusTemporaryRedirect, w.Code)
	require.Equal(t, "/v1/carts/", w.Header().Get("Location"))
	require.Zero(t, keyRows(), "a redirect stored under the key")
	require.Empty(t, rr.seen(), "nothing traced")

	// The client follows the redirects with the same keys.
	w = postWithKey(h, "/v1/orders/7/refunds", "k-redirect")
	require.Equal(t, http.StatusCreated, w.Code, w.Body.String())
	require.Equal(t, "refund of order 7", w.Body.String())
	require.Equal(t, http.StatusCreated, postWithKey(h, "/v1/carts/", "k-slash").Code)
	require.Equal(t, 2, keyRows())
	require.Equal(t, 2, handled)

	// WithHTTPRoute's "" is a request not routed.
	opaque := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { ordersMux(&handled).ServeHTTP(w, r) })
	h = idempotency.HTTPMiddleware(store, idempotency.WithHTTPRoute(func(r *http.Request) string {
		_, pattern := ordersMux(&handled).Handler(r)
		return pattern
	}))(opaque)
	for i := range 100 {
		require.Equal(t, http.StatusNotFound, postWithKey(h, fmt.Sprintf("/wp-login/%d", i), fmt.Sprintf("k-%d", i)).Code)
	}
	require.Equal(t, 2, keyRows())
}

// embeddedMuxRouter is a router of the kind services write to give a
// ServeMux a fallback of their own: it embeds *http.ServeMux and serves
// what the mux has no pattern for with a catch-all (a legacy API, a
// reverse proxy to the old service). The embedded Handler method makes it
// look like a ServeMux to the middleware.
type embeddedMuxRouter struct {
	*http.ServeMux
	fallback http.Handler
}

func (rt embeddedMuxRouter) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if _, pattern := rt.Handler(r); pattern == "" {
		rt.fallback.ServeHTTP(w, r)
		return
	}
	rt.ServeMux.ServeHTTP(w, r)
}

// The middleware asks any handler with a Handler(*http.Request)
// (http.Handler, string) method which pattern a request matches, and lets
// a request with none pass through unprotected, taking it for the mux's
// 404. A router that embeds a ServeMux has that method and serves such
// requests: a POST to the fallback, sent twice with one key, runs twice.
func TestHTTPRouterEmbeddingAServeMuxIsNotAServeMux(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var ran int
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v2/charges", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) })
	h := idempotency.HTTPMiddleware(store)(embeddedMuxRouter{ServeMux: mux, fallback: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ran++
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "legacy charge")
	})})
	for range 2 {
		w := postWithKey(h, "/v1/charges", "k-legacy")
		require.Equal(t, http.StatusCreated, w.Code, w.Body.String())
	}
	require.Equal(t, 1, ran, "the fallback's POST ran once per send: it was never protected")
}

// It failed when the method and fingerprint came from r.URL, which
// http.StripPrefix rewrites: tenant B's request got tenant A's stored
// response, and B's handler never ran. The same holds for routes that
// differ only in the host their mux pattern names.
func TestHTTPRoutesBehindStripPrefixAreDifferentCalls(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	idem := idempotency.HTTPMiddleware(store)
	var runs atomic.Int64
	tenant := func(name string) http.Handler {
		return idem(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			_, _ = io.WriteString(w, "charged tenant "+name)
		}))
	}
	mux := http.NewServeMux()
	mux.Handle("/tenant-a/", http.StripPrefix("/tenant-a", tenant("A")))
	mux.Handle("/tenant-b/", http.StripPrefix("/tenant-b", tenant("B")))
	mux.Handle("POST a.example/charges", tenant("A"))
	mux.Handle("POST b.example/charges", tenant("B"))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	a := do(t, srv.Client(), mountedPost(t, srv.URL+"/tenant-a/charges", "", "100"), "k-1")
	require.Equal(t, http.StatusOK, a.status)
	require.Equal(t, "charged tenant A", a.body)
	b := do(t, srv.Client(), mountedPost(t, srv.URL+"/tenant-b/charges", "", "100"), "k-1")
	require.Equal(t, http.StatusUnprocessableEntity, b.status, "tenant B's route is another request: %s", b.body)
	require.Empty(t, b.header.Get(idempotency.ReplayedHeader))
	again := do(t, srv.Client(), mountedPost(t, srv.URL+"/tenant-a/charges", "", "100"), "k-1")
	require.Equal(t, "charged tenant A", again.body)
	require.Equal(t, "true", again.header.Get(idempotency.ReplayedHeader))
	require.EqualValues(t, 1, runs.Load())

	hostA := mountedPost(t, srv.URL+"/charges", "", "100")
	hostA.Host = "a.example"
	require.Equal(t, "charged tenant A", do(t, srv.Client(), hostA, "k-2").body)
	hostB := mountedPost(t, srv.URL+"/charges", "", "100")
	hostB.Host = "b.example"
	require.Equal(t, http.StatusUnprocessableEntity, do(t, srv.Client(), hostB, "k-2").status, "the route of another host is another request")
	require.EqualValues(t, 2, runs.Load())
}

// b.example's request under a.example's key and body must never get
// a.example's stored response: the host the client sent is part of the
// fingerprint wherever the middleware is mounted.
//
// middleware outside the mux: it failed when the host was part of a request
// only through r.Pattern: with the middleware wrapping the whole mux, the
// pattern is empty when the request is named.
//
// one inner mux per host: it failed the same way with one mux per virtual
// host: the inner mux's host-less pattern ("POST /charges") replaced the
// outer one's.
func TestHTTPHostRoutesAreDifferentCalls(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, key string
		handler   func(store *idempotency.Store, runs *atomic.Int64) http.Handler
	}{
		{"middleware outside the mux", "k-host-outside", func(store *idempotency.Store, runs *atomic.Int64) http.Handler {
			mux := http.NewServeMux()
			for _, host := range []string{"a.example", "b.example"} {
				mux.HandleFunc("POST "+host+"/charges", func(w http.ResponseWriter, r *http.Request) {
					runs.Add(1)
					_, _ = io.WriteString(w, "charged at "+host)
				})
			}
			return idempotency.HTTPMiddleware(store)(mux)
		}},
		{"one inner mux per host", "k-host-nested", func(store *idempotency.Store, runs *atomic.Int64) http.Handler {
			idem := idempotency.HTTPMiddleware(store)
			outer := http.NewServeMux()
			for _, host := range []string{"a.example", "b.example"} {
				inner := http.NewServeMux()
				inner.Handle("POST /charges", idem(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					runs.Add(1)
					_, _ = io.WriteString(w, "charged at "+host)
				})))
				outer.Handle(host+"/", inner)
			}
			return outer
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			store := migratedStore(t, suiteDB(t))
			var runs atomic.Int64
			srv := httptest.NewServer(tc.handler(store, &runs))
			t.Cleanup(srv.Close)

			a := mountedPost(t, srv.URL+"/charges", "", "100")
			a.Host = "a.example"
			require.Equal(t, "charged at a.example", do(t, srv.Client(), a, tc.key).body)
			b := mountedPost(t, srv.URL+"/charges", "", "100")
			b.Host = "b.example"
			rb := do(t, srv.Client(), b, tc.key)
			require.Empty(t, rb.header.Get(idempotency.ReplayedHeader), "b.example got a.example's stored response: %q", rb.body)
			require.NotEqual(t, "charged at a.example", rb.body)
			require.Equal(t, http.StatusUnprocessableEntity, rb.status, "the route of another host is another request")
			require.EqualValues(t, 1, runs.Load())
		})
	}
}
