package idempotency_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/textproto"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
)

// With the middleware mounted outside net/http's ServeMux (wrapping the
// whole mux, as services mount middleware), r.Pattern is still empty when
// the request is named, so the host a mux pattern names is never part of
// it: a.example/charges and b.example/charges are one call, and
// b.example's request under a.example's key and body is answered with
// a.example's stored response (Idempotency-Replayed: true); b.example's
// handler never runs.
func TestHTTPOutsideTheMuxHostRoutesAreDifferentCalls(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	mux := http.NewServeMux()
	for _, host := range []string{"a.example", "b.example"} {
		mux.HandleFunc("POST "+host+"/charges", func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			_, _ = io.WriteString(w, "charged at "+host)
		})
	}
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(mux))
	t.Cleanup(srv.Close)

	a := mountedPost(t, srv.URL+"/charges", "", "100")
	a.Host = "a.example"
	require.Equal(t, "charged at a.example", do(t, srv.Client(), a, "k-host-outside").body)
	b := mountedPost(t, srv.URL+"/charges", "", "100")
	b.Host = "b.example"
	rb := do(t, srv.Client(), b, "k-host-outside")
	require.Empty(t, rb.header.Get(idempotency.ReplayedHeader), "b.example got a.example's stored response: %q", rb.body)
	require.NotEqual(t, "charged at a.example", rb.body)
	require.Equal(t, http.StatusUnprocessableEntity, rb.status, "the route of another host is another request")
	require.EqualValues(t, 1, runs.Load())
}

// Routed by host on an outer mux and by path on an inner one (one mux per
// virtual host), the inner mux overwrites r.Pattern with its own host-less
// pattern ("POST /charges"), so the host the outer mux routed on is lost:
// b.example's request under a.example's key and body is answered with
// a.example's stored response, and b.example's handler never runs.
func TestHTTPNestedMuxHostRoutesAreDifferentCalls(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	idem := idempotency.HTTPMiddleware(store)
	var runs atomic.Int64
	outer := http.NewServeMux()
	for _, host := range []string{"a.example", "b.example"} {
		inner := http.NewServeMux()
		inner.Handle("POST /charges", idem(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			_, _ = io.WriteString(w, "charged at "+host)
		})))
		outer.Handle(host+"/", inner)
	}
	srv := httptest.NewServer(outer)
	t.Cleanup(srv.Close)

	a := mountedPost(t, srv.URL+"/charges", "", "100")
	a.Host = "a.example"
	require.Equal(t, "charged at a.example", do(t, srv.Client(), a, "k-host-nested").body)
	b := mountedPost(t, srv.URL+"/charges", "", "100")
	b.Host = "b.example"
	rb := do(t, srv.Client(), b, "k-host-nested")
	require.Empty(t, rb.header.Get(idempotency.ReplayedHeader), "b.example got a.example's stored response: %q", rb.body)
	require.NotEqual(t, "charged at a.example", rb.body)
	require.Equal(t, http.StatusUnprocessableEntity, rb.status, "the route of another host is another request")
	require.EqualValues(t, 1, runs.Load())
}

// A 1xx response copies every header the handler had set into the real
// writer's header map, and nothing takes them out again: a header the
// handler set for the 103 and then removed still goes out with the final
// first response (net/http would not send it), while the replay, built
// from the snapshot taken at WriteHeader, does not carry it. With Link in
// the replayed list, the first caller and the retry get different
// replayed headers.
func TestHTTPEarlyHintsHeadersDoNotLeakIntoTheFinalResponse(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store, idempotency.WithHTTPReplayedHeaders("Link"))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</style.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		w.Header().Del("Link") // for the hint only
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "charged")
	})))
	t.Cleanup(srv.Close)
	send := func() (mountedReply, []int) {
		var hints []int
		req := mountedPost(t, srv.URL, "", "x")
		req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
			Got1xxResponse: func(code int, _ textproto.MIMEHeader) error { hints = append(hints, code); return nil },
		}))
		return do(t, srv.Client(), req, "k-hint-leak"), hints
	}
	first, hints := send()
	require.Equal(t, []int{http.StatusEarlyHints}, hints)
	require.Equal(t, http.StatusCreated, first.status)
	require.Empty(t, first.header.Values("Link"), "the handler removed Link before its final status; net/http would not send it")
	replay, _ := send()
	require.Equal(t, "true", replay.header.Get(idempotency.ReplayedHeader))
	require.Equal(t, first.header.Values("Link"), replay.header.Values("Link"), "the first caller and the retry get different replayed headers")
}

// A form is fingerprinted from its parsed fields when a middleware in
// front parsed it, and from its bytes when it did not; the same request
// body gives two fingerprints. A CSRF check that reads the token from a
// header and falls back to the form (gorilla/csrf's order) parses the
// form on one attempt and not on its retry that sends the header: the
// retry of the very same body under the same key gets 422 instead of the
// stored response.
func TestHTTPFormRetryIsTheSameRequestWhetherOrNotParsedInFront(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	csrf := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			token := r.Header.Get("X-CSRF-Token")
			if token == "" {
				token = r.PostFormValue("csrf")
			}
			if token != "ok" {
				http.Error(w, "csrf", http.StatusForbidden)
				return
			}
			next.ServeHTTP(w, r)
		})
	}
	srv := httptest.NewServer(csrf(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		_, _ = fmt.Fprintf(w, "charged %s", r.PostFormValue("amount"))
	}))))
	t.Cleanup(srv.Close)
	const form = "application/x-www-form-urlencoded"

	first := do(t, srv.Client(), mountedPost(t, srv.URL, form, "csrf=ok&amount=100"), "k-csrf")
	require.Equal(t, "charged 100", first.body)
	retry := mountedPost(t, srv.URL, form, "csrf=ok&amount=100")
	retry.Header.Set("X-CSRF-Token", "ok")
	r := do(t, srv.Client(), retry, "k-csrf")
	require.Equal(t, http.StatusOK, r.status, "the same method, path and body under the same key: %s", r.body)
	require.Equal(t, "charged 100", r.body)
	require.Equal(t, "true", r.header.Get(idempotency.ReplayedHeader))
	require.EqualValues(t, 1, runs.Load())
}
