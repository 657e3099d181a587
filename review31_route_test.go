package idempotency_test

import (
	"io"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
)

// review31Router is a router of the kind services write to give a
// ServeMux a fallback of their own: it embeds *http.ServeMux and serves
// what the mux has no pattern for with a catch-all (a legacy API, a
// reverse proxy to the old service). The embedded Handler method makes it
// look like a ServeMux to the middleware.
type review31Router struct {
	*http.ServeMux
	fallback http.Handler
}

func (rt review31Router) ServeHTTP(w http.ResponseWriter, r *http.Request) {
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
func TestReview31RouterEmbeddingAServeMuxIsNotAServeMux(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var ran int
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v2/charges", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) })
	h := idempotency.HTTPMiddleware(store)(review31Router{ServeMux: mux, fallback: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
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
