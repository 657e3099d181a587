package idempotency_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
)

// queryParsedInFront calls r.FormValue (which parses the form, setting
// r.PostForm even when the body is not a form) only when X-Skip is absent:
// one attempt of a request is parsed in front, its retry is not.
func queryParsedInFront(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Skip") == "" {
			_ = r.FormValue("token")
		}
		next.ServeHTTP(w, r)
	})
}

// chunked makes req's body of unknown length (Transfer-Encoding: chunked).
func chunked(req *http.Request) *http.Request {
	req.Body = io.NopCloser(struct{ io.Reader }{req.Body})
	req.ContentLength = -1
	req.GetBody = nil
	return req
}

// It failed because an empty body that a middleware in front "parsed" (a
// r.FormValue on a POST without a form type leaves r.PostForm empty, not
// nil) is fingerprinted with neither a body nor a form digest, while the
// same request unparsed has the body digest of no bytes: the retry of the
// same empty POST gets 422 only because of where it was parsed. So does a
// multipart body ParseMultipartForm read whole and failed on (r.PostForm
// empty, r.MultipartForm nil), which the handler fails to parse either way.
func TestHTTPBodyParsedInFrontToNoFormIsTheSameRequestAsUnparsed(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	srv := httptest.NewServer(queryParsedInFront(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		_, _ = io.WriteString(w, "captured")
	}))))
	t.Cleanup(srv.Close)
	for i, c := range []struct{ ct, body string }{
		{"", ""},
		{"application/json", ""},
		// A multipart body ParseMultipartForm fails on, read whole by it.
		{"multipart/form-data; boundary=X", "--X\r\nbad"},
	} {
		key := fmt.Sprintf("k-empty-%d", i)
		first := mountedPost(t, srv.URL+"/capture", c.ct, c.body)
		first.Header.Set("X-Skip", "1")
		require.Equal(t, "captured", do(t, srv.Client(), first, key).body)
		retry := do(t, srv.Client(), mountedPost(t, srv.URL+"/capture", c.ct, c.body), key)
		if !assert.Equal(t, http.StatusOK, retry.status, "Content-Type %q: the retry of the same POST, parsed in front: %s", c.ct, retry.body) {
			continue
		}
		assert.Equal(t, "true", retry.header.Get(idempotency.ReplayedHeader))
	}
}

// It failed when a chunked form parsed in front was held to the limit by
// a guess of its size (r.PostForm.Encode()) and an unparsed one by its
// bytes: "%41" (3 bytes) re-encodes as "A", pairs url.ParseQuery drops
// count for nothing, "é" (2 bytes) re-encodes as "%C3%A9" (6), so bodies
// over the limit were served parsed in front and bodies under it refused.
// A form sent without a length is held to the limit by the size of its
// encoded fields either way: one answer, and a replay for the retry.
func TestHTTPChunkedFormGetsOneAnswerWhetherOrNotParsedInFront(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	srv := httptest.NewServer(csrfInFront(idempotency.HTTPMiddleware(store, idempotency.WithHTTPMaxRequestBytes(1000))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		_, _ = fmt.Fprintf(w, "note of %d bytes", len(r.PostFormValue("note")))
	}))))
	t.Cleanup(srv.Close)
	const form = "application/x-www-form-urlencoded"
	served := 0
	for i, body := range []string{
		"csrf=ok&note=" + strings.Repeat("%41", 500),    // 1513 bytes, 513 encoded
		"csrf=ok&note=a&" + strings.Repeat("x;y&", 400), // 1615 bytes, 15 encoded
		"csrf=ok&note=" + strings.Repeat("é", 250),      // 513 bytes, 1513 encoded
		"csrf=ok&note=" + strings.Repeat("b", 2000),     // over either way
	} {
		key := fmt.Sprintf("k-chunked-%d", i)
		unparsed := chunked(mountedPost(t, srv.URL, form, body))
		unparsed.Header.Set("X-CSRF-Token", "ok")
		first := do(t, srv.Client(), unparsed, key)
		parsed := do(t, srv.Client(), chunked(mountedPost(t, srv.URL, form, body)), key)
		require.Equal(t, first.status, parsed.status, "body %d: one answer, parsed in front or not: %s / %s", i, first.body, parsed.body)
		require.Equal(t, first.body, parsed.body, "body %d", i)
		if first.status == http.StatusOK {
			served++
			require.Equal(t, "true", parsed.header.Get(idempotency.ReplayedHeader), "body %d: the retry is replayed", i)
		} else {
			require.Equal(t, http.StatusRequestEntityTooLarge, first.status, "body %d", i)
		}
	}
	require.EqualValues(t, served, runs.Load(), "one run per served body")
	require.Equal(t, 2, served, "the first two are within the limit by their fields, the last two are not")
}

// It failed because a form over ParseForm's own 10 MB cap, parsed in
// front, is read only up to the cap (ParseForm fails, r.PostForm empty):
// the rest is what the middleware reads and holds to the limit, so a body
// over WithHTTPMaxRequestBytes is served (the handler runs on the tail of
// the body) instead of getting 413 as it does unparsed.
func TestHTTPFormOverParseFormsCapParsedInFrontGets413(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	const limit = 10<<20 + 1000
	srv := httptest.NewServer(queryParsedInFront(idempotency.HTTPMiddleware(store, idempotency.WithHTTPMaxRequestBytes(limit))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		b, _ := io.ReadAll(r.Body)
		_, _ = fmt.Fprintf(w, "read %d bytes", len(b))
	}))))
	t.Cleanup(srv.Close)
	body := "note=" + strings.Repeat("a", 10<<20+2000)
	unparsed := mountedPost(t, srv.URL, "application/x-www-form-urlencoded", body)
	unparsed.Header.Set("X-Skip", "1")
	require.Equal(t, http.StatusRequestEntityTooLarge, do(t, srv.Client(), unparsed, "k-cap-a").status, "sanity: unparsed")
	parsed := do(t, srv.Client(), mountedPost(t, srv.URL, "application/x-www-form-urlencoded", body), "k-cap-b")
	require.Equal(t, http.StatusRequestEntityTooLarge, parsed.status, "a %d-byte body over the %d-byte limit, parsed in front: %s", len(body), limit, parsed.body)
	require.Zero(t, runs.Load())
}

// It failed because two bodies are compared by their bytes alone when both
// were read: the same bytes sent as a form and as text/plain share a
// stored response, though a form handler reads a field from one and
// nothing from the other (and a multipart body's fields depend on the
// boundary its Content-Type names).
func TestHTTPSameBytesUnderAnotherContentTypeIsNotAReplay(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		if a := r.PostFormValue("amount"); a != "" {
			_, _ = fmt.Fprintf(w, "charged %s", a)
			return
		}
		_, _ = io.WriteString(w, "nothing charged")
	})))
	t.Cleanup(srv.Close)
	first := do(t, srv.Client(), mountedPost(t, srv.URL, "text/plain", "amount=100"), "k-ctype")
	require.Equal(t, "nothing charged", first.body)
	other := do(t, srv.Client(), mountedPost(t, srv.URL, "application/x-www-form-urlencoded", "amount=100"), "k-ctype")
	require.Empty(t, other.header.Get(idempotency.ReplayedHeader), "a form got the stored response of the same bytes as text/plain: %s", other.body)
	require.NotEqual(t, "nothing charged", other.body)
}

// It failed because a stored version 4 fingerprint that does not parse
// (its flags byte not one the format knows, its length not the flags')
// is taken for an untagged one, so against any valid version 4
// fingerprint it is "not comparable" and counts as the same request: a
// different body under the key gets the stored response.
func TestHTTPMalformedStoredFingerprintIsNotTheSameRequest(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	store := migratedStore(t, db)
	var runs atomic.Int64
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		b, _ := io.ReadAll(r.Body)
		_, _ = fmt.Fprintf(w, "charged %s", b)
	})))
	t.Cleanup(srv.Close)
	for i, corrupt := range []string{
		`set_byte(fingerprint, 37, 7)`,         // unknown flag
		`substring(fingerprint from 1 for 50)`, // truncated
		`fingerprint || '\x00'::bytea`,         // a byte too many
	} {
		key := fmt.Sprintf("k-corrupt-%d", i)
		require.Equal(t, "charged 100", do(t, srv.Client(), mountedPost(t, srv.URL, "application/json", "100"), key).body)
		tag, err := db.Pool.Exec(context.Background(), `UPDATE idempotency_keys SET fingerprint = `+corrupt+` WHERE key LIKE '%'||$1`, key)
		require.NoError(t, err)
		require.EqualValues(t, 1, tag.RowsAffected())
		other := do(t, srv.Client(), mountedPost(t, srv.URL, "application/json", "999"), key)
		assert.Empty(t, other.header.Get(idempotency.ReplayedHeader), "corruption %q: another body got the stored response: %s", corrupt, other.body)
	}
}
