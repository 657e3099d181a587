package idempotency_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
)

// csrfInFront parses the form only when the token header is missing, as
// gorilla/csrf does (r.PostFormValue, its error ignored): one attempt of a
// request is parsed in front, its retry with the header is not.
func csrfInFront(next http.Handler) http.Handler {
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

// curl -d sends application/x-www-form-urlencoded, and a JSON handler
// reads the bytes whatever the type says. The middleware fingerprints such
// a body by url.ParseQuery's fields, which unescapes "+" and %XX: the JSON
// {"note":"a+b"} and {"note":"a b"} are one fingerprint, and the second,
// a different request the handler would answer differently, gets the
// first's stored response instead of 422.
func TestHTTPJSONSentWithTheFormTypeIsNotAnotherRequestsReplay(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		var in struct{ Note string }
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		_, _ = fmt.Fprintf(w, "note %q", in.Note)
	})))
	t.Cleanup(srv.Close)
	const curlType = "application/x-www-form-urlencoded"

	first := do(t, srv.Client(), mountedPost(t, srv.URL, curlType, `{"note":"a+b"}`), "k-json-as-form")
	require.Equal(t, `note "a+b"`, first.body)
	other := do(t, srv.Client(), mountedPost(t, srv.URL, curlType, `{"note":"a b"}`), "k-json-as-form")
	require.Empty(t, other.header.Get(idempotency.ReplayedHeader), "another body got the first's stored response: %s", other.body)
	require.Equal(t, http.StatusUnprocessableEntity, other.status, "another body under the same key: %s", other.body)
	require.EqualValues(t, 1, runs.Load())
}

// A form url.ParseQuery refuses ("50%off", or a ";" separator) is
// fingerprinted by its bytes when it reaches the middleware unread, and by
// the fields net/http kept (ParseForm keeps the valid pairs and the error
// is ignored by PostFormValue) when a middleware in front parsed it: the
// retry of the very same body, parsed in front once and not the other
// time, gets 422 instead of the stored response.
func TestHTTPUnparsableFormRetryIsTheSameRequestWhetherOrNotParsedInFront(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	srv := httptest.NewServer(csrfInFront(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		_, _ = fmt.Fprintf(w, "charged %s", r.PostFormValue("amount"))
	}))))
	t.Cleanup(srv.Close)
	const form = "application/x-www-form-urlencoded"
	const body = "csrf=ok&amount=100&memo=50%off"

	first := do(t, srv.Client(), mountedPost(t, srv.URL, form, body), "k-unparsable")
	require.Equal(t, "charged 100", first.body)
	retry := mountedPost(t, srv.URL, form, body)
	retry.Header.Set("X-CSRF-Token", "ok")
	r := do(t, srv.Client(), retry, "k-unparsable")
	require.Equal(t, http.StatusOK, r.status, "the same body under the same key: %s", r.body)
	require.Equal(t, "charged 100", r.body)
	require.Equal(t, "true", r.header.Get(idempotency.ReplayedHeader))
	require.EqualValues(t, 1, runs.Load())
}

// net/http parses a form whose Content-Type has a malformed parameter
// ("; charset": mime.ParseMediaType returns the type with an error, which
// parsePostForm ignores); the middleware treats an error as "not a form"
// and fingerprints the bytes. Parsed in front once and not on the retry,
// the same request gets 422.
func TestHTTPFormWithAMalformedTypeParameterIsTheSameRequestWhetherOrNotParsedInFront(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	srv := httptest.NewServer(csrfInFront(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		_, _ = fmt.Fprintf(w, "charged %s", r.PostFormValue("amount"))
	}))))
	t.Cleanup(srv.Close)
	const form = "application/x-www-form-urlencoded; charset"

	first := do(t, srv.Client(), mountedPost(t, srv.URL, form, "csrf=ok&amount=100"), "k-bad-param")
	require.Equal(t, "charged 100", first.body)
	retry := mountedPost(t, srv.URL, form, "csrf=ok&amount=100")
	retry.Header.Set("X-CSRF-Token", "ok")
	r := do(t, srv.Client(), retry, "k-bad-param")
	require.Equal(t, http.StatusOK, r.status, "the same body under the same key: %s", r.body)
	require.Equal(t, "charged 100", r.body)
	require.Equal(t, "true", r.header.Get(idempotency.ReplayedHeader))
	require.EqualValues(t, 1, runs.Load())
}

// WithHTTPMaxRequestBytes is enforced only on the bytes left to read: a
// form over the limit that a middleware in front parsed (net/http reads
// up to 10 MB of it, a multipart form's files without limit) runs and is
// stored; its retry, not parsed in front, is refused with 413 "over N
// bytes, the most that can be fingerprinted" instead of getting the
// stored response. One key, two answers.
func TestHTTPFormOverTheLimitGetsOneAnswerWhetherOrNotParsedInFront(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	srv := httptest.NewServer(csrfInFront(idempotency.HTTPMiddleware(store, idempotency.WithHTTPMaxRequestBytes(1024))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		_, _ = fmt.Fprintf(w, "charged %s", r.PostFormValue("amount"))
	}))))
	t.Cleanup(srv.Close)
	const form = "application/x-www-form-urlencoded"
	body := "csrf=ok&amount=100&memo=" + strings.Repeat("x", 4096)

	first := do(t, srv.Client(), mountedPost(t, srv.URL, form, body), "k-over-limit")
	retry := mountedPost(t, srv.URL, form, body)
	retry.Header.Set("X-CSRF-Token", "ok")
	r := do(t, srv.Client(), retry, "k-over-limit")
	require.Equal(t, first.status, r.status, "first %d %q, retry %d %q", first.status, first.body, r.status, r.body)
	require.Equal(t, first.body, r.body)
}

// A form with no fields ("&", as some clients send an empty form) is
// fingerprinted as the empty form when it reaches the middleware unread,
// and as the empty byte string when a middleware in front parsed it
// (r.PostForm is empty, so requestBody does not see a parsed form): the
// retry of the same body, parsed in front once and not the other time,
// gets 422 instead of the stored response.
func TestHTTPEmptyFormRetryIsTheSameRequestWhetherOrNotParsedInFront(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	parseSometimes := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("X-Parse") != "" {
				_ = r.ParseForm()
			}
			next.ServeHTTP(w, r)
		})
	}
	srv := httptest.NewServer(parseSometimes(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		_, _ = fmt.Fprintf(w, "fields %d", len(r.PostForm))
	}))))
	t.Cleanup(srv.Close)
	const form = "application/x-www-form-urlencoded"

	first := mountedPost(t, srv.URL, form, "&")
	first.Header.Set("X-Parse", "1")
	require.Equal(t, http.StatusOK, do(t, srv.Client(), first, "k-empty-form").status)
	r := do(t, srv.Client(), mountedPost(t, srv.URL, form, "&"), "k-empty-form")
	require.Equal(t, http.StatusOK, r.status, "the same body under the same key: %s", r.body)
	require.Equal(t, "true", r.header.Get(idempotency.ReplayedHeader))
	require.EqualValues(t, 1, runs.Load())
}
