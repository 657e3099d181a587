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

// It failed when a form-typed body was identified by its fields alone:
// curl -d sends JSON as application/x-www-form-urlencoded, a JSON handler
// reads the bytes, and {"note":"a b"} got the stored response of
// {"note":"a+b"} (url.ParseQuery reads "+" as a space). Bodies read by the
// middleware are compared by their bytes.
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

// It failed when a form url.ParseQuery refuses ("50%off") was identified
// by its bytes unread and by the pairs net/http kept when parsed in front:
// the retry of the same body, parsed in front once, got 422.
func TestHTTPUnparsableFormRetryIsTheSameRequestWhetherOrNotParsedInFront(t *testing.T) {
	t.Parallel()
	requireOneChargeWhetherParsedInFront(t, "application/x-www-form-urlencoded", "csrf=ok&amount=100&memo=50%off")
}

// It failed when a Content-Type with a malformed parameter ("; charset")
// was not a form's to the middleware while net/http parses it as one:
// parsed in front once and not on the retry, the same request got 422.
func TestHTTPFormWithAMalformedTypeParameterIsTheSameRequestWhetherOrNotParsedInFront(t *testing.T) {
	t.Parallel()
	requireOneChargeWhetherParsedInFront(t, "application/x-www-form-urlencoded; charset", "csrf=ok&amount=100")
}

// It failed when WithHTTPMaxRequestBytes held only the bytes left to
// read: a form over the limit parsed in front ran and was stored, and its
// retry, not parsed in front, got 413. One key, two answers.
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

// It failed when a form with no fields ("&") parsed in front was taken
// for an empty body: the retry of the same body, parsed in front once and
// not the other time, got 422.
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

// requireOneChargeWhetherParsedInFront sends a charge of the form body
// twice under one key, parsed in front by csrfInFront the first time and
// not the second (its retry carries the CSRF header), and requires one run
// whose answer, "charged 100", the retry gets replayed.
func requireOneChargeWhetherParsedInFront(t *testing.T, contentType, body string) {
	t.Helper()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	srv := httptest.NewServer(csrfInFront(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		_, _ = fmt.Fprintf(w, "charged %s", r.PostFormValue("amount"))
	}))))
	t.Cleanup(srv.Close)
	first := do(t, srv.Client(), mountedPost(t, srv.URL, contentType, body), "k-charge")
	require.Equal(t, "charged 100", first.body)
	retry := mountedPost(t, srv.URL, contentType, body)
	retry.Header.Set("X-CSRF-Token", "ok")
	r := do(t, srv.Client(), retry, "k-charge")
	require.Equal(t, http.StatusOK, r.status, "the same request under the same key: %s", r.body)
	require.Equal(t, "charged 100", r.body)
	require.Equal(t, "true", r.header.Get(idempotency.ReplayedHeader))
	require.EqualValues(t, 1, runs.Load())
}
