package idempotency_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
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
