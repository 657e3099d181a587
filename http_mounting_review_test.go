package idempotency_test

import (
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

// It failed when the host was part of a request only through r.Pattern:
// with the middleware wrapping the whole mux, the pattern is empty when the
// request is named, and b.example's request under a.example's key and body
// was answered with a.example's stored response. The host the client sent
// is part of the fingerprint wherever the middleware is mounted.
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

// It failed the same way with one mux per virtual host: the inner mux's
// host-less pattern ("POST /charges") replaced the outer one's, and
// b.example got a.example's stored response.
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

// It failed when the headers a 1xx response carried stayed in the real
// writer's map: a header the handler set for the 103 and then removed went
// out with the first final response (net/http would not send it) and not
// with the replay, so the first caller and the retry got different
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

// It failed when a form was fingerprinted from its fields when a
// middleware in front parsed it and from its bytes when none did: a CSRF
// check that reads a header and falls back to the form (gorilla/csrf's
// order) parsed one attempt and not its retry, which got 422 for the very
// same body. A form is identified by its fields either way.
func TestHTTPFormRetryIsTheSameRequestWhetherOrNotParsedInFront(t *testing.T) {
	t.Parallel()
	requireOneChargeWhetherParsedInFront(t, "application/x-www-form-urlencoded", "csrf=ok&amount=100")
}
